"""launch/: the XLA flags file, the SLURM script (under a stand-in srun) and the JobSet manifest."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

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
  out = subprocess.run(["bash", "-c", "source launch/xla_flags.sh; printf '%s\\n' \"$XLA_FLAGS\" "
                        "\"$XLA_PYTHON_CLIENT_MEM_FRACTION\" \"$CUDA_DEVICE_MAX_CONNECTIONS\""],
                       cwd=ROOT, env=dict(os.environ, XLA_FLAGS="--xla_mine=1"), capture_output=True, text=True,
                       check=True).stdout.splitlines()
  exported = out[0].split()
  assert exported == [f for _, f in flags] + ["--xla_mine=1"]  # Hand-set flags come last and win.
  assert float(out[1]) <= 1.0 and out[2] == "1"


def test_slurm_script_runs_train_py_once_per_node_with_all_gpus(tmp_path):
  # Stand-ins: `srun` runs its command once as task 0 of 2 with 4 GPUs; `python` prints what it got.
  (tmp_path / "srun").write_text("#!/usr/bin/env bash\n"
                                 "while [[ $1 == --* ]]; do shift; done\n"
                                 "SLURM_PROCID=0 SLURM_NTASKS=2 SLURM_NTASKS_PER_NODE=1 SLURM_GPUS_ON_NODE=4 exec \"$@\"\n")
  (tmp_path / "python").write_text("#!/usr/bin/env bash\n"
                                   "printf 'ARG %s\\n' \"$@\"; printf '%s\\n' \"XLA $XLA_FLAGS\" \"IDS $JAX_LOCAL_DEVICE_IDS\"\n")
  for f in ("srun", "python"):
    (tmp_path / f).chmod(0o755)
  script = (LAUNCH / "slurm.sbatch").read_text()
  directives = dict(re.findall(r"^#SBATCH --([\w-]+)=?(\S*)", script, re.M))
  assert directives["ntasks-per-node"] == "1" and "gpus-per-node" in directives
  assert directives["signal"].startswith("TERM@") and "requeue" in directives
  env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}", SLURM_SUBMIT_DIR=str(ROOT))
  p = subprocess.run(["bash", str(LAUNCH / "slurm.sbatch"), "--config=configs/default.py:tiny",
                      "--config.workdir=/shared/run one"], cwd=tmp_path, env=env, capture_output=True, text=True)
  assert p.returncode == 0, p.stderr
  lines = [line.split(" ", 1) for line in p.stdout.splitlines()]
  assert [v for k, v in lines if k == "ARG"] == ["train.py", "--config=configs/default.py:tiny",
                                                  "--config.workdir=/shared/run one"]
  out = {k: v for k, v in lines if k != "ARG"}
  assert "--xla_gpu_enable_latency_hiding_scheduler=true" in out["XLA"]
  assert out["IDS"] == "0,1,2,3"


def test_jobset_manifest_is_consistent():
  doc = yaml.safe_load((LAUNCH / "jobset.yaml").read_text())
  assert doc["kind"] == "JobSet"
  name = doc["metadata"]["name"]
  (rjob,) = doc["spec"]["replicatedJobs"]
  job = rjob["template"]["spec"]
  assert job["completionMode"] == "Indexed" and job["parallelism"] == job["completions"]
  pod = job["template"]["spec"]
  (container,) = pod["containers"]
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
  workdir = re.search(r"--config\.workdir=(\S+)", command).group(1)
  mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
  assert workdir.startswith(mounts["workdir"])
  assert pod["terminationGracePeriodSeconds"] >= 60  # Time to save a checkpoint on SIGTERM.


def test_local_sh_usage_error():
  p = subprocess.run(["launch/local.sh", "two", "2", sys.executable], cwd=ROOT, capture_output=True, text=True)
  assert p.returncode == 2 and "usage" in p.stderr
