"""Two real processes (launch/local.sh 2 2) against one process with 4 devices: same losses, one
writer of metrics, preemption agreed across processes, and a checkpoint that restores in one process."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.xla_cpu import FAST_CPU_CODEGEN, cpu_xla_flags

# One worker runs this module (`--dist loadgroup`): its tests share module-scoped state.
pytestmark = pytest.mark.xdist_group("test_multiprocess")

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--config=configs/default.py:tiny", "--config.model.num_layers=1", "--config.model.seq_len=16",
        "--config.train.batch_size=8", "--config.data.source=synthetic", "--config.train.eval_every_steps=0",
        "--config.log.every_steps=1", "--config.checkpoint.every_steps=5", "--config.train.decay_steps=100",
        "--config.train.warmup_steps=2",
        "--config.quant.recipe=bf16", "--config.model.dtype=float32",
        "--config.train.device_batch_size=2"]  # No data.num_shards: batches never depend on the process count; 2
# sequences a device: one micro-batch on 4 devices, two on 2.
TWO_HOSTS = ["--config.mesh.fsdp=2", "--config.mesh.dcn_fsdp=2"]  # The same mesh (fsdp=4), hybrid over processes.
PIPELINE = ["--config.model.num_layers=2", "--config.mesh.fsdp=2", "--config.train.device_batch_size=0",
            "--config.train.grad_accum_steps=2"]  # Two stages of a layer each, two micro-batches.


def _env(cache: Path, **extra) -> dict:
  env = {k: v for k, v in os.environ.items() if not k.startswith(("EMBER_", "XLA_FLAGS"))}
  env.update(JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             XLA_FLAGS=FAST_CPU_CODEGEN)  # launch/local.sh adds the device count.
  env.update(extra)
  return env


def _records(workdir: Path) -> list[dict]:
  path = workdir / "metrics.jsonl"
  return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _losses(workdir: Path) -> dict[int, float]:
  return {r["step"]: r["loss"] for r in _records(workdir)}


def _one_process(cache, workdir, steps, devices: int = 4) -> subprocess.CompletedProcess:
  p = subprocess.run([sys.executable, "train.py", *ARGS, f"--config.mesh.fsdp={devices}", "--config.log.tensorboard=false",
                      f"--config.workdir={workdir}", f"--config.steps={steps}"], cwd=ROOT, capture_output=True,
                     text=True, timeout=300,
                     env=_env(cache, XLA_FLAGS=cpu_xla_flags(devices)))
  assert p.returncode == 0, p.stderr[-3000:]
  return p


@pytest.fixture(scope="session")
def cache(tmp_path_factory) -> Path:
  """JAX's compilation cache, shared with tests/trainer/test_checkpoint_e2e.py (same programs)."""
  base = tmp_path_factory.getbasetemp()
  root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "ember_ckpt_shared"
  root.mkdir(exist_ok=True)
  return root / "jax_cache"


@pytest.mark.long
def test_two_processes_match_one_process_and_their_checkpoint_restores_in_one(tmp_path, cache):
  mp = tmp_path / "two_processes"
  # 2 processes x 2 devices, stopped by SIGTERM to the launcher once step 5 is logged.
  proc = subprocess.Popen(["launch/local.sh", "2", "2", sys.executable, "train.py", *ARGS, *TWO_HOSTS,
                           f"--config.workdir={mp}", "--config.steps=1000"], cwd=ROOT, env=_env(cache),
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
  deadline = time.time() + 300
  while not any(r["step"] >= 5 for r in _records(mp)):
    assert proc.poll() is None, proc.stderr.read()[-3000:]
    assert time.time() < deadline
    time.sleep(0.02)
  proc.send_signal(signal.SIGTERM)
  _, stderr = proc.communicate(timeout=180)
  assert proc.returncode == 0, stderr[-3000:]

  records = _records(mp)
  stopped = records[-1]["step"]
  assert [r["step"] for r in records] == list(range(1, stopped + 1))  # Process 0 alone writes metrics.
  assert stderr.count(f"step {stopped:>6}/1000") == 1  # ... and the console.
  assert len(list((mp / "tensorboard").glob("events.out.tfevents.*"))) == 1  # ... and TensorBoard.
  assert f"preempted (SIGTERM): saved a checkpoint at step {stopped}" in stderr
  saved = mp / "checkpoints" / str(stopped)
  assert sorted(p.name for p in (saved / "data").glob("*.json")) == ["process_0-of-2.json", "process_1-of-2.json"]

  # One process with 4 devices, the same mesh (fsdp=4): the same losses.
  sp = tmp_path / "one_process"
  after = range(stopped + 1, stopped + 4)  # The steps a resumed run takes.
  _one_process(cache, sp, after[-1])
  mp_losses, sp_losses = _losses(mp), _losses(sp)
  assert [mp_losses[s] for s in range(1, stopped + 1)] == pytest.approx(
      [sp_losses[s] for s in range(1, stopped + 1)], rel=1e-6)

  # The two-process checkpoint resumes in one process, with both processes' data positions.
  resumed = tmp_path / "resumed"
  shutil.copytree(mp, resumed)
  p = _one_process(cache, resumed, after[-1])
  assert f"at step {stopped}" in p.stderr and "warning" not in p.stderr
  assert [r["step"] for r in _records(resumed)] == list(range(1, after[-1] + 1))  # Each step logged once.
  resumed_losses = _losses(resumed)
  assert [resumed_losses[s] for s in after] == pytest.approx([sp_losses[s] for s in after], rel=1e-6)

  # ... and on half the devices (one process, 2): the same global batch, as 2 micro-batches of each device's 2
  # sequences (train.device_batch_size); the same rows each step, summed in another order.
  half = tmp_path / "half"
  shutil.copytree(mp, half)
  p = _one_process(cache, half, after[-1], devices=2)
  assert f"at step {stopped}" in p.stderr and "warning" not in p.stderr
  half_losses = _losses(half)
  assert [half_losses[s] for s in after] == pytest.approx([sp_losses[s] for s in after], rel=1e-5)


@pytest.mark.long
def test_pipeline_stages_on_two_processes_train_like_one_process(tmp_path, cache):
  """`mesh.dcn_pipeline=2`: each process holds one stage of every row of the batch, so both feed the whole batch
  (the rows their devices hold, not a share of an even split over the processes) and the run takes the losses
  of the same mesh in one process, its two stages inside it. The recipe's statistics, split by stage over the
  processes, are gathered where they are logged (each process failed to fetch the other's stage)."""
  two, one = tmp_path / "two_processes", tmp_path / "one_process"
  common = [*ARGS, *PIPELINE, "--config.steps=3", "--config.checkpoint.every_steps=0", "--config.log.tensorboard=false",
            "--config.quant.recipe=fp8_delayed", "--config.log.quant_stats_every=1"]
  p = subprocess.run(["launch/local.sh", "2", "2", sys.executable, "train.py", *common, "--config.mesh.dcn_pipeline=2",
                      f"--config.workdir={two}"], cwd=ROOT, env=_env(cache), capture_output=True, text=True,
                     timeout=300)
  assert p.returncode == 0, p.stderr[-3000:]
  p = subprocess.run([sys.executable, "train.py", *common, "--config.mesh.pipeline=2", f"--config.workdir={one}"],
                     cwd=ROOT, env=_env(cache, XLA_FLAGS=cpu_xla_flags(4)), capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stderr[-3000:]
  two_losses, one_losses = _losses(two), _losses(one)
  assert sorted(two_losses) == [1, 2, 3]
  assert [two_losses[s] for s in (1, 2, 3)] == pytest.approx([one_losses[s] for s in (1, 2, 3)], rel=1e-6)
  stats = lambda workdir: [{k: v for k, v in r.items() if k.startswith("quant")}
                           for r in map(json.loads, open(workdir / "metrics.jsonl")) if "loss" in r]
  assert stats(two) == stats(one) and all(len(s) > 2 for s in stats(two))


@pytest.mark.long
def test_a_context_group_across_two_processes_trains_like_one_process(tmp_path, cache):
  """`mesh.context=4` over two processes of two devices: each process feeds whole rows, the sequences split over
  both, and the run takes the losses of the same mesh in one process. (Without the batch's global shape, JAX read
  each process's rows as its share of the length: step-1 loss 5.5621 against 5.5607.)"""
  two, one = tmp_path / "two_processes", tmp_path / "one_process"
  common = [*ARGS, "--config.mesh.context=4", "--config.mesh.fsdp=1", "--config.train.device_batch_size=0",
            "--config.steps=3", "--config.checkpoint.every_steps=0", "--config.log.tensorboard=false"]
  p = subprocess.run(["launch/local.sh", "2", "2", sys.executable, "train.py", *common, f"--config.workdir={two}"],
                     cwd=ROOT, env=_env(cache), capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stderr[-3000:]
  p = subprocess.run([sys.executable, "train.py", *common, f"--config.workdir={one}"],
                     cwd=ROOT, env=_env(cache, XLA_FLAGS=cpu_xla_flags(4)), capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stderr[-3000:]
  two_losses, one_losses = _losses(two), _losses(one)
  assert sorted(two_losses) == [1, 2, 3]
  assert [two_losses[s] for s in (1, 2, 3)] == pytest.approx([one_losses[s] for s in (1, 2, 3)], rel=1e-6)


def test_local_sh_fails_when_a_process_fails(tmp_path):
  p = subprocess.run(["launch/local.sh", "2", "1", sys.executable, "-c",
                      "import os, sys, time; i = int(os.environ['EMBER_PROCESS_ID']); "
                      "sys.exit(3) if i == 1 else time.sleep(60)"],
                     cwd=ROOT, capture_output=True, text=True, timeout=60, env=_env(tmp_path))
  assert p.returncode == 3
  assert "exited with status 3" in p.stderr


def test_local_sh_sets_the_distributed_environment(tmp_path):
  script = ("import os, pathlib; e = os.environ; "
            f"pathlib.Path({str(tmp_path)!r}, e['EMBER_PROCESS_ID']).write_text(' '.join(["
            "e['EMBER_NUM_PROCESSES'], e['EMBER_COORDINATOR_ADDRESS'].split(':')[0], e['JAX_PLATFORMS'], "
            "e['XLA_FLAGS'].split()[-1]]))")
  p = subprocess.run(["launch/local.sh", "3", "2", sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                     text=True, timeout=60, env=_env(tmp_path))
  assert p.returncode == 0, p.stderr
  for i in range(3):
    assert (tmp_path / str(i)).read_text() == "3 127.0.0.1 cpu --xla_force_host_platform_device_count=2"
