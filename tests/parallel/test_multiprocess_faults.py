"""Two real processes (jax.distributed on 127.0.0.1): one slowed on purpose is named the straggler in
metrics.jsonl; then stopped (SIGSTOP), it stalls the other, which ends itself past
train.step_timeout_s with one line naming the step, its Python stacks and the hang's exit status."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from ember.trainer.watchdog import HUNG_EXIT_STATUS
from tests.helpers import train_processes

STEP_TIMEOUT_S = 10
ARGS = ["--config=configs/default.py:tiny", "--config.model.num_layers=1", "--config.model.seq_len=16",
        "--config.train.batch_size=8", "--config.data.source=synthetic", "--config.train.eval_every_steps=0",
        "--config.log.every_steps=2", "--config.checkpoint.every_steps=-1", "--config.quant.recipe=bf16",
        "--config.model.dtype=float32", "--config.mesh.fsdp=2", "--config.mesh.dcn_fsdp=2",
        "--config.log.tensorboard=false", "--config.steps=100000", f"--config.train.step_timeout_s={STEP_TIMEOUT_S}"]


class Throttle:
  """Slows a process on purpose, as a throttled device or a starved host would be: stopped five sixths of the time
  (SIGSTOP / SIGCONT in a thread). Unlike a CPU hog pinned beside it, it slows the process as much on a machine
  whose other CPU is busy with another test worker as on an idle one. Its running spells (5 ms) are shorter than
  the probe it slows (a CPU device's: about 15 ms on an idle core), so that every probe spans several: with spells
  of 20 ms (stopped 60 ms) a probe could run whole in one and read barely slower (a ratio under 1.5 failed the test
  once in a whole suite; the least of 4 runs beside a busy core was 2.7, against 3.6 now)."""

  def __init__(self, pid: int, on_s: float = 0.005, off_s: float = 0.025):
    self.pid, self.on_s, self.off_s = pid, on_s, off_s
    self.done = threading.Event()
    self.thread = threading.Thread(target=self._run, daemon=True)
    self.thread.start()

  def _run(self):
    while not self.done.is_set():
      os.kill(self.pid, signal.SIGSTOP)
      time.sleep(self.off_s)
      os.kill(self.pid, signal.SIGCONT)
      time.sleep(self.on_s)

  def stop(self):
    self.done.set()
    self.thread.join()


@pytest.mark.long
def test_a_slowed_process_is_named_and_a_stopped_one_ends_the_job(tmp_path):
  procs = train_processes([*ARGS, f"--config.workdir={tmp_path}"])
  throttle = None
  try:
    metrics, deadline = tmp_path / "metrics.jsonl", time.time() + 300
    records = []
    while len(records) < 6:
      assert procs[0].poll() is None, procs[0].communicate()[1][-3000:]
      assert time.time() < deadline
      if records and throttle is None:  # Compiled and stepping: slow process 1 from here on.
        throttle, slowed_from = Throttle(procs[1].pid), records[-1]["step"]
      time.sleep(0.2)
      records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    # Each record after the throttle started names process 1, well past log.straggler_ratio.
    slowed = [r for r in records if r["step"] > slowed_from + 2]
    assert slowed and all(r["straggler_process"] == 1 and r["straggler_ratio"] > 1.5 for r in slowed), records
    throttle.stop()
    stopped_at = time.time()
    procs[1].send_signal(signal.SIGSTOP)
    _, err = procs[0].communicate(timeout=STEP_TIMEOUT_S + 60)
    assert time.time() - stopped_at < STEP_TIMEOUT_S + 60
  finally:
    if throttle is not None:
      throttle.stop()
    for p in procs:
      p.kill()
  assert procs[0].returncode == HUNG_EXIT_STATUS, err[-3000:]
  assert "warning: process 1 is a straggler" in err
  line = next(line for line in err.splitlines() if line.startswith("error: process 0: step "))
  assert f"made no progress in {STEP_TIMEOUT_S} s (train.step_timeout_s)" in line
  assert "(most recent call first)" in err and 'File "' in err and "loop.py" in err  # faulthandler's stacks.
