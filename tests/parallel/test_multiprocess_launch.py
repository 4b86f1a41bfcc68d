"""launch/: the XLA flags file, the SLURM script (under a stand-in srun) and the JobSet manifest."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from ember.config import defaults
from ember.parallel import distributed

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "launch"


def _flag_lines() -> list[tuple[int, str]]:
  lines = (LAUNCH / "xla_flags.sh").read_text().splitlines()
  return [(i, l.strip()) for i, l in enumerate(lines) if l.strip().startswith("--xla_")]


def test_xla_flags_each_have_a_comment_and_user_flags_win():
  lines = (LAUNCH / "xla_flags.sh").read_text().splitlines()
  flags = _flag_lines()
  assert len(flags) >= 8
  for i, flag in flags:
    assert lines[i - 1].strip().startswith("#"), f"{flag} has no comment of its own"
  names = [f.split("=")[0] for _, f in flags]
  assert len(names) == len(set(names))
  sourced = lambda **env: subprocess.run(
      ["bash", "-c", "source launch/xla_flags.sh; printf '%s\\n' \"$XLA_FLAGS\" \"$XLA_PYTHON_CLIENT_MEM_FRACTION\" "
       "\"$CUDA_DEVICE_MAX_CONNECTIONS\""], cwd=ROOT, env=dict(os.environ, XLA_FLAGS="--xla_mine=1", **env),
      capture_output=True, text=True, check=True).stdout.splitlines()
  out = sourced(EMBER_LOOP_PIPELINING="1")
  exported = out[0].split()
  assert exported == [f for _, f in flags] + ["--xla_mine=1"]  # Hand-set flags come last and win.
  assert float(out[1]) <= 1.0 and out[2] == "1"
  # EMBER_LOOP_PIPELINING=0 leaves out the loop-pipelining flags, and only those.
  loop_pipelining = {"--xla_gpu_enable_pipelined_all_gather=true", "--xla_gpu_enable_pipelined_reduce_scatter=true",
                     "--xla_gpu_enable_pipelined_all_reduce=true", "--xla_gpu_enable_while_loop_double_buffering=true"}
  assert sourced(EMBER_LOOP_PIPELINING="0")[0].split() == [f for f in exported if f not in loop_pipelining]
  assert loop_pipelining <= set(exported)


def _run_slurm_script(tmp_path, **env) -> tuple[list[str], dict[str, str]]:
  """launch/slurm.sbatch under stand-ins: `srun` runs its command once, as task 0 of 2; `python` prints what it got;
  `nvidia-smi` leaves a file `nvidia-smi.called`. Returns (srun's options, {XLA, IDS, PLATFORMS: what python saw})."""
  (tmp_path / "srun").write_text("#!/usr/bin/env bash\n"
                                 "while [[ $1 == --* ]]; do echo \"SRUN $1\"; shift; done\n"
                                 "SLURM_PROCID=0 SLURM_NTASKS=2 exec \"$@\"\n")
  (tmp_path / "python").write_text("#!/usr/bin/env bash\n"
                                   "printf 'ARG %s\\n' \"$@\"\n"
                                   "printf '%s\\n' \"XLA $XLA_FLAGS\" \"IDS ${JAX_LOCAL_DEVICE_IDS:-}\" "
                                   "\"PLATFORMS ${JAX_PLATFORMS:-}\"\n")
  (tmp_path / "nvidia-smi").write_text("#!/usr/bin/env bash\ntouch \"$0.called\"; echo GPU 0\n")
  for f in ("srun", "python", "nvidia-smi"):
    (tmp_path / f).chmod(0o755)
  base_env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}  # conftest's.
  p = subprocess.run(["bash", str(LAUNCH / "slurm.sbatch"), "--config=configs/default.py:tiny",
                      "--config.workdir=/shared/run one"], cwd=tmp_path, capture_output=True, text=True,
                     env=dict(base_env, PATH=f"{tmp_path}:{os.environ['PATH']}", SLURM_SUBMIT_DIR=str(ROOT), **env))
  assert p.returncode == 0, p.stderr
  lines = [line.split(" ", 1) for line in p.stdout.splitlines()]
  assert [v for k, v in lines if k == "ARG"] == ["train.py", "--config=configs/default.py:tiny",
                                                  "--config.workdir=/shared/run one"]
  return [v for k, v in lines if k == "SRUN"], {k: v for k, v in lines if k not in ("ARG", "SRUN")}


def test_slurm_script_runs_train_py_once_per_node_with_all_gpus(tmp_path):
  script = (LAUNCH / "slurm.sbatch").read_text()
  directives = dict(re.findall(r"^#SBATCH --([\w-]+)=?(\S*)", script, re.M))
  assert directives["ntasks-per-node"] == "1" and "gpus-per-node" in directives
  assert directives["signal"].startswith("TERM@") and "requeue" in directives
  srun, out = _run_slurm_script(tmp_path, SLURM_NTASKS_PER_NODE="1", SLURM_GPUS_ON_NODE="4")
  assert "--ntasks-per-node=1" in srun and "--kill-on-bad-exit=1" in srun
  assert "--xla_gpu_enable_latency_hiding_scheduler=true" in out["XLA"]
  assert out["IDS"] == "0,1,2,3" and out["PLATFORMS"] == ""


def test_slurm_script_with_tasks_per_gpu_leaves_each_task_its_own_gpu(tmp_path):
  """sbatch --ntasks-per-node=8 (a process per GPU): JAX's SLURM detection gives task k GPU k; all 8 ids for
  every task would have each process claim every GPU of the node."""
  _, out = _run_slurm_script(tmp_path, SLURM_NTASKS_PER_NODE="8", SLURM_GPUS_ON_NODE="8")
  assert out["IDS"] == ""


def test_slurm_script_on_cpu_nodes_gives_each_task_its_cpu_devices(tmp_path):
  srun, out = _run_slurm_script(tmp_path, EMBER_CPU_DEVICES="2", SLURM_NTASKS_PER_NODE="2")
  assert "--ntasks-per-node=2" in srun and "--kill-on-bad-exit=1" in srun  # The allocation's layout.
  assert out["XLA"].split() == ["--xla_force_host_platform_device_count=2"]  # No GPU flags.
  assert out["IDS"] == "" and out["PLATFORMS"] == "cpu" and not (tmp_path / "nvidia-smi.called").exists()


def _jobset() -> tuple[dict, dict, dict]:
  """launch/jobset.yaml: (the document, its one replicated job's Job spec, its one container)."""
  doc = yaml.safe_load((LAUNCH / "jobset.yaml").read_text())
  (rjob,) = doc["spec"]["replicatedJobs"]
  job = rjob["template"]["spec"]
  (container,) = job["template"]["spec"]["containers"]
  return doc, job, container


def test_jobset_manifest_is_consistent():
  doc, job, container = _jobset()
  assert doc["kind"] == "JobSet"
  name = doc["metadata"]["name"]
  (rjob,) = doc["spec"]["replicatedJobs"]
  assert rjob["replicas"] == 1  # Process ids are completion indices within one Job: a second Job would repeat them.
  assert job["completionMode"] == "Indexed" and job["parallelism"] == job["completions"]
  pod = job["template"]["spec"]
  env = {e["name"]: e for e in container["env"]}
  assert int(env["EMBER_NUM_PROCESSES"]["value"]) == job["parallelism"]
  assert "job-completion-index" in env["EMBER_PROCESS_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
  host, port = env["EMBER_COORDINATOR_ADDRESS"]["value"].rsplit(":", 1)
  assert host == f"{name}-{rjob['name']}-0-0.{name}"  # Pod 0 through the JobSet's headless service.
  assert int(port) in [p["containerPort"] for p in container["ports"]]
  command = " ".join(container["command"] + container["args"])
  assert "source launch/xla_flags.sh" in command and "python train.py" in command
  config = re.search(r"--config=(\S+)", command).group(1).split(":")[0]
  assert (ROOT / config).is_file()
  dcn = [int(n) for n in re.findall(r"--config\.mesh\.dcn_\w+=(\d+)", command)]
  assert dcn and math.prod(dcn) == job["parallelism"]  # One host per process along the dcn axes.
  workdir = re.search(r"--config\.workdir=(\S+)", command).group(1)
  mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
  assert workdir.startswith(mounts["workdir"])
  assert pod["terminationGracePeriodSeconds"] >= 60  # Time to save a checkpoint on SIGTERM.


def test_jobset_pods_get_what_ember_reads_to_form_one_job(monkeypatch):
  """Each pod's environment, as Kubernetes fills it in, through ember's own reader (ember/parallel/distributed.py):
  one coordinator, the pod count, and distinct process ids 0..N-1."""
  _, job, container = _jobset()
  for key in list(os.environ):
    if key.startswith(("EMBER_", "SLURM_")):
      monkeypatch.delenv(key)
  found = []
  for index in range(job["parallelism"]):
    for e in container["env"]:  # The one fieldRef is the pod's completion index.
      monkeypatch.setenv(e["name"], e["value"] if "value" in e else str(index))
    found.append(distributed.settings(defaults.get_config().distributed))
  address = next(e["value"] for e in container["env"] if e["name"] == "EMBER_COORDINATOR_ADDRESS")
  assert found == [dict(coordinator_address=address, num_processes=job["parallelism"], process_id=i)
                   for i in range(job["parallelism"])]


def test_local_sh_usage_error():
  p = subprocess.run(["launch/local.sh", "two", "2", sys.executable], cwd=ROOT, capture_output=True, text=True)
  assert p.returncode == 2 and "usage" in p.stderr
