"""Two real processes (jax.distributed on 127.0.0.1): one slowed by CPU hogs pinned beside it is named the
straggler in metrics.jsonl; then stopped (SIGSTOP), it stalls the other, which ends itself past
train.step_timeout_s with one line naming the step, its Python stacks and the hang's exit status."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ember.trainer.watchdog import HUNG_EXIT_STATUS

ROOT = Path(__file__).resolve().parents[2]
STEP_TIMEOUT_S = 10
ARGS = ["--config=configs/default.py:tiny", "--config.model.num_layers=1", "--config.model.seq_len=16",
        "--config.train.batch_size=8", "--config.data.source=synthetic", "--config.train.eval_every_steps=0",
        "--config.log.every_steps=2", "--config.checkpoint.every_steps=-1", "--config.quant.recipe=bf16",
        "--config.model.dtype=float32", "--config.mesh.fsdp=2", "--config.mesh.dcn_fsdp=2",
        "--config.log.tensorboard=false", "--config.steps=100000", f"--config.train.step_timeout_s={STEP_TIMEOUT_S}"]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _pinned(cpu: int):
  return lambda: os.sched_setaffinity(0, {cpu})


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pins the two processes to two different CPUs")
def test_a_slowed_process_is_named_and_a_stopped_one_ends_the_job(tmp_path):
  cpus = sorted(os.sched_getaffinity(0))[:2]
  port = _free_port()
  env = {k: v for k, v in os.environ.items() if not k.startswith(("EMBER_", "XLA_FLAGS"))}
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2",
             EMBER_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", EMBER_NUM_PROCESSES="2")
  # Two busy loops share process 1's CPU: it gets a third of it, process 0 its CPU (whatever else the machine runs,
  # a test worker beside this one, lands on both).
  hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=_pinned(cpus[1])) for _ in range(2)]
  procs = [subprocess.Popen([sys.executable, "train.py", *ARGS, f"--config.workdir={tmp_path}"], cwd=ROOT,
                            env={**env, "EMBER_PROCESS_ID": str(i)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_pinned(cpus[i])) for i in range(2)]
  try:
    metrics, deadline = tmp_path / "metrics.jsonl", time.time() + 300
    records = []
    while len(records) < 7:
      assert procs[0].poll() is None, procs[0].communicate()[1][-3000:]
      assert time.time() < deadline
      time.sleep(0.2)
      records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    # Process 1's devices run the probe several times slower. Named in most records (a probe of a few tens of ms on a
    # shared CPU is noisy), with a ratio well past log.straggler_ratio to the other process.
    named = [r["straggler_process"] for r in records[1:]]
    assert named.count(1) > len(named) / 2, records
    assert np.median([r["straggler_ratio"] for r in records[1:] if r["straggler_process"] == 1]) > 1.5, records
    for hog in hogs:
      hog.kill()
    stopped_at = time.time()
    procs[1].send_signal(signal.SIGSTOP)
    _, err = procs[0].communicate(timeout=STEP_TIMEOUT_S + 60)
    assert time.time() - stopped_at < STEP_TIMEOUT_S + 60
  finally:
    for p in hogs + procs:
      p.kill()
  assert procs[0].returncode == HUNG_EXIT_STATUS, err[-3000:]
  assert "warning: process 1 is a straggler" in err
  line = next(line for line in err.splitlines() if line.startswith("error: process 0: step "))
  assert f"made no progress in {STEP_TIMEOUT_S} s (train.step_timeout_s)" in line
  assert "(most recent call first)" in err and 'File "' in err and "loop.py" in err  # faulthandler's stacks.
