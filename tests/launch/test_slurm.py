"""launch/slurm.sbatch on a real one-node SLURM cluster of this module's own (slurmctld + slurmd + munged, all
state under a temp dir, stopped by their process ids at the end): 2 tasks x 2 CPU devices train as one process
with 4 devices; a job whose tasks get SIGTERM mid-run saves and stops, and requeued (`scontrol requeue`) runs again
from that checkpoint and ends with the metrics of an uninterrupted job, bitwise; a task that dies ends the whole
job at once.

SLURM is Debian's slurm-wlm: installed with apt-get when it is missing and this process may (root), skipped with
the reason otherwise.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ember.trainer.metrics import TIMING_KEYS
from tests.xla_cpu import FAST_CPU_CODEGEN, cpu_xla_flags

# One worker runs this module (`--dist loadgroup`): its tests share module-scoped state.
pytestmark = [pytest.mark.long, pytest.mark.xdist_group("test_slurm")]

ROOT = Path(__file__).resolve().parents[2]
DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "scontrol", "scancel", "sinfo")
# The model of tests/parallel/test_multiprocess.py: a tiny float32 step, 4 devices as fsdp=4 (2 per task).
ARGS = ["--config=configs/default.py:tiny", "--config.model.num_layers=1", "--config.model.seq_len=16",
        "--config.train.batch_size=8", "--config.data.source=synthetic", "--config.train.eval_every_steps=0",
        "--config.log.every_steps=1", "--config.checkpoint.every_steps=1000", "--config.train.decay_steps=100",
        "--config.quant.recipe=bf16", "--config.model.dtype=float32", "--config.mesh.fsdp=4",
        "--config.log.tensorboard=false"]
STEPS = 40
# The module's tests share one cluster, so they belong in one pytest process (`pytest -n 2 --dist loadgroup`, as
# .ci/run does); under plain `-n 2` each worker starts a cluster of its own, which also works.


def _ensure_slurm() -> None:
  if os.geteuid() != 0:
    pytest.skip("a SLURM cluster of the test's own runs its daemons and jobs as root")
  if (os.cpu_count() or 1) < 2:
    pytest.skip("a one-node cluster running 2 tasks needs 2 CPUs")
  if all(shutil.which(d) for d in DAEMONS):
    return
  if not shutil.which("apt-get"):
    pytest.skip("SLURM (slurm-wlm, munge) is not installed and there is no apt-get to install it")
  env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
  install = ["apt-get", "install", "-y", "-q", "slurm-wlm", "munge"]
  if subprocess.run(install, env=env, capture_output=True).returncode:
    subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
    p = subprocess.run(install, env=env, capture_output=True, text=True)
    if p.returncode:
      pytest.skip(f"apt-get could not install slurm-wlm and munge: {p.stderr.strip().splitlines()[-1:]}")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Cluster:
  """One node of SLURM under `root`; every command here runs with its SLURM_CONF."""

  def __init__(self, root: Path):
    self.root, self.procs = root, []
    self.env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "EMBER_", "XLA_FLAGS"))}
    self.env.update(SLURM_CONF=str(root / "slurm.conf"), PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
                    XLA_FLAGS=FAST_CPU_CODEGEN)  # Jobs export it; launch/slurm.sbatch adds the device count.

  def start(self) -> None:
    r = self.root
    for d in ("state", "spool", "run", "jobs"):
      (r / d).mkdir()
    (r / "munge.key").write_bytes(os.urandom(1024))
    (r / "munge.key").chmod(0o400)
    host = socket.gethostname()
    node = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
    node = re.sub(r"^NodeName=\S+", f"NodeName={host}", node)
    conf = [
        "ClusterName=embertest", f"SlurmctldHost={host}", "SlurmUser=root", "SlurmdUser=root",
        f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
        # Job ids start at random: JAX derives its coordinator port from the job id (two clusters, two ports).
        f"FirstJobId={random.randrange(1, 1 << 20)}",
        "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={r}/munge.sock",
        f"StateSaveLocation={r}/state", f"SlurmdSpoolDir={r}/spool",
        f"SlurmctldPidFile={r}/run/slurmctld.pid", f"SlurmdPidFile={r}/run/slurmd.pid",
        f"SlurmctldLogFile={r}/slurmctld.log", f"SlurmdLogFile={r}/slurmd.log",
        # No cgroups: processes tracked by their parent ids, no task binding.
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
        "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
        # Finished jobs stay visible to `scontrol show job` (and requeue) for 5 minutes; SIGKILL follows
        # SIGTERM after 10 s (default 30).
        "ReturnToService=2", "JobRequeue=1", "KillOnBadExit=1", "MinJobAge=300", "KillWait=10", "InactiveLimit=0",
        f"{node} State=UNKNOWN",
        f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP",
    ]
    (r / "slurm.conf").write_text("\n".join(conf) + "\n")
    self._daemon(["munged", "-F", "-f", f"--socket={r}/munge.sock", f"--key-file={r}/munge.key",
                  f"--log-file={r}/munged.log", f"--pid-file={r}/run/munged.pid", f"--seed-file={r}/munged.seed"])
    self._wait(lambda: (r / "munge.sock").exists(), "munged")
    self._daemon(["slurmctld", "-D", "-f", str(r / "slurm.conf")])
    self._daemon(["slurmd", "-D", "-f", str(r / "slurm.conf")])
    self._wait(lambda: "idle" in self.run("sinfo", "-h", "-o", "%T", check=False).stdout, "the node to be idle")

  def _daemon(self, cmd: list[str]) -> None:
    with open(self.root / f"{cmd[0]}.out", "w") as log:
      self.procs.append(subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True))

  def _wait(self, ready, what: str, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while not ready():
      dead = [p.args[0] for p in self.procs if p.poll() is not None]
      assert not dead and time.time() < deadline, f"waiting for {what}: {dead or 'timed out'}\n{self.logs()}"
      time.sleep(0.2)

  def logs(self) -> str:
    return "\n".join(f"--- {f.name}\n{f.read_text()[-2000:]}" for f in sorted(self.root.glob("*.out")))

  def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=self.env, capture_output=True, text=True, check=check, timeout=60)

  def sbatch(self, name: str, *args: str, sbatch_flags=()) -> tuple[str, Path]:
    """Submits launch/slurm.sbatch as 2 tasks x 2 CPU devices on the one node: (job id, workdir)."""
    workdir = self.root / "jobs" / name
    out = self.run("sbatch", "--parsable", f"--job-name={name}", "--nodes=1", "--ntasks=2", "--ntasks-per-node=2",
                   "--gpus-per-node=0", "--cpus-per-task=1", "--time=10", f"--output={self.root}/jobs/{name}.out",
                   f"--chdir={ROOT}", "--export=ALL,EMBER_CPU_DEVICES=2", *sbatch_flags,
                   str(ROOT / "launch" / "slurm.sbatch"), *ARGS, f"--config.workdir={workdir}", *args)
    return out.stdout.strip().split(";")[0], workdir

  def job(self, job_id: str) -> dict[str, str]:
    text = self.run("scontrol", "show", "job", job_id).stdout
    return dict(re.findall(r"(\w+)=(\S*)", text))

  def wait_job(self, job_id: str, timeout: float = 150) -> dict[str, str]:
    deadline = time.time() + timeout
    while (info := self.job(job_id))["JobState"] not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
      assert time.time() < deadline, f"job {job_id} still {info['JobState']}\n{self.logs()}"
      time.sleep(0.3)
    return info

  def output(self, name: str) -> str:
    return (self.root / "jobs" / f"{name}.out").read_text()

  def stop(self) -> None:
    subprocess.run(["scancel", "--full", "--user=root"], env=self.env, capture_output=True)
    self._kill_job_processes(signal.SIGKILL)
    for p in reversed(self.procs):  # slurmd, slurmctld, munged: by their process ids.
      p.terminate()
      try:
        p.wait(timeout=15)
      except subprocess.TimeoutExpired:
        p.kill()
        p.wait()

  def _kill_job_processes(self, sig) -> None:
    for pid in self.train_pids():
      try:
        os.kill(pid, sig)
      except ProcessLookupError:
        pass

  def train_pids(self, workdir: Path | None = None) -> list[int]:
    """train.py processes of this cluster's jobs (of one workdir's job, if given)."""
    pattern = f"^python[0-9.]* train.py .*--config.workdir={workdir or self.root / 'jobs'}"  # Not srun's line.
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
  _ensure_slurm()
  c = Cluster(tmp_path_factory.mktemp("slurm"))
  try:
    c.start()
    yield c
  finally:
    c.stop()


def _records(workdir: Path) -> list[dict]:
  path = workdir / "metrics.jsonl"
  return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _computed(records: list[dict]) -> list[dict]:
  return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]


@pytest.fixture(scope="module")
def uninterrupted(cluster) -> Path:
  """A 2-task job of STEPS steps, never interrupted: its workdir."""
  job_id, workdir = cluster.sbatch("uninterrupted", f"--config.steps={STEPS}")
  info = cluster.wait_job(job_id)
  assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", cluster.output("uninterrupted")
  return workdir


def test_two_tasks_of_two_cpu_devices_train_as_one_process_with_four(cluster, uninterrupted, tmp_path):
  out = cluster.output("uninterrupted")
  assert "'fsdp': 4" in out and "step     40/40" in out  # One 4-device mesh over the two tasks; one console.
  one = tmp_path / "one_process"
  env = dict(cluster.env, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_xla_flags(4))
  p = subprocess.run([sys.executable, "train.py", *ARGS, f"--config.workdir={one}", f"--config.steps={STEPS}"],
                     cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stderr[-3000:]
  two_tasks = {r["step"]: r["loss"] for r in _records(uninterrupted) if "loss" in r}
  one_process = {r["step"]: r["loss"] for r in _records(one) if "loss" in r}
  assert sorted(two_tasks) == list(range(1, STEPS + 1))
  assert [two_tasks[s] for s in sorted(two_tasks)] == pytest.approx([one_process[s] for s in sorted(two_tasks)],
                                                                     rel=1e-6)


def _wait_for_step(cluster, job_id: str, name: str, workdir: Path, step: int) -> None:
  deadline = time.time() + 120
  while not any(r.get("step", 0) >= step for r in _records(workdir)):
    assert cluster.job(job_id)["JobState"] in ("PENDING", "RUNNING"), cluster.output(name)
    assert time.time() < deadline, cluster.output(name)
    time.sleep(0.05)


def _sigterm_pending(pid: int) -> bool:
  status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
  return bool((int(status["SigPnd"], 16) | int(status["ShdPnd"], 16)) & (1 << (signal.SIGTERM - 1)))


def test_a_job_signalled_mid_run_saves_and_requeued_logs_what_an_uninterrupted_job_does(
    cluster, uninterrupted):
  name = "preempted"
  job_id, workdir = cluster.sbatch(name, f"--config.steps={STEPS}")  # As the docs submit it: --requeue and
  # --open-mode=append are the script's own.
  _wait_for_step(cluster, job_id, name, workdir, 5)
  # The notice must land mid-run however fast the steps are, and JAX's SIGTERM listener looks once a second:
  # the tasks are paused while SLURM delivers the signal (it stays pending) and for that second, then resumed,
  # so that they see it at once. They agree on a step, save and exit 0.
  pids = cluster.train_pids(workdir)
  assert len(pids) == 2, pids
  for pid in pids:
    os.kill(pid, signal.SIGSTOP)
  cluster.run("scancel", "--signal=TERM", job_id)  # To the job's tasks, as `#SBATCH --signal=TERM@300` does.
  deadline = time.time() + 30
  while not all(_sigterm_pending(pid) for pid in pids):
    assert time.time() < deadline, "SIGTERM never reached the paused tasks"
    time.sleep(0.05)
  time.sleep(1.1)
  for pid in pids:
    os.kill(pid, signal.SIGCONT)
  info = cluster.wait_job(job_id)
  out = cluster.output(name)
  assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", out
  stopped = re.search(r"preempted \(SIGTERM\): saved a checkpoint at step (\d+)", out)
  assert stopped and 5 <= int(stopped.group(1)) < STEPS, out

  cluster.run("scontrol", "requeue", job_id)  # Back to pending; it runs with SLURM_RESTART_COUNT=1.
  # SLURM holds a requeued job back (its begin time) because slurmd refuses a credential of the job issued in
  # the second the last run ended; start it now, a second later.
  time.sleep(1.1)
  cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
  info = cluster.wait_job(job_id)
  out = cluster.output(name)
  assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0" and info["Restarts"] == "1", out
  assert stopped.group(0) in out, "the requeued run truncated the log of the run before it"
  assert f"resumed from {workdir}/checkpoints at step {stopped.group(1)}" in out.split(stopped.group(0), 1)[1]
  records = _records(workdir)
  assert [r["step"] for r in records if "loss" in r] == list(range(1, STEPS + 1))  # No step logged twice.
  assert _computed(records) == _computed(_records(uninterrupted))  # Bitwise: JSON floats round-trip exactly.


@pytest.mark.extended  # tests/parallel/test_multiprocess_faults.py checks the same of local processes.
def test_a_task_that_dies_ends_the_whole_job_within_a_minute(cluster):
  name = "one_task_dies"
  job_id, workdir = cluster.sbatch(name, "--config.steps=100000")
  _wait_for_step(cluster, job_id, name, workdir, 2)
  pids = cluster.train_pids(workdir)
  assert len(pids) == 2, pids
  killed = time.time()
  os.kill(max(pids), signal.SIGKILL)
  info = cluster.wait_job(job_id, timeout=60)
  took = time.time() - killed
  assert info["JobState"] == "FAILED" and info["ExitCode"] != "0:0", (info["JobState"], info["ExitCode"])
  assert took < 60, took
  time.sleep(1)
  assert not cluster.train_pids(workdir)  # No rank left waiting in a collective.
