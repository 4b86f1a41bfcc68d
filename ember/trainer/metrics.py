"""metrics.jsonl, TensorBoard (and Weights & Biases: trainer/wandb_run.py) and the console line; written by
process 0 only.

Each record is one complete line added at once (ember/storage.py: appended and fsync'd locally, the object
rewritten whole in a bucket), so a crash leaves at most a torn *last* line; `truncate_after` (called on resume)
rewrites the file atomically without it and without records past the restored step, so the file never holds a
step twice or a gap.
"""

from __future__ import annotations

import json
import math
import sys
import time

import jax

from ember import storage


# The keys of a record that measure this run's speed, not its training: they differ between two runs of the same
# job. (So may `data_skipped_records`, a count of each process's pipeline since it started, prefetch included.)
TIMING_KEYS = frozenset({"step_time_s", "tokens_per_s", "tflops_per_device", "mfu", "eta_s", "peak_bytes",
                         "peak_source", "straggler_process", "straggler_ratio", "straggler_probe_s", "median_probe_s",
                         "input_wait_process", "input_wait_s"})


def _clean(v):
  if isinstance(v, float) and not math.isfinite(v):
    return None
  return v


def read_records(path: str) -> list[dict]:
  """Complete records of a metrics file (a torn last line is skipped)."""
  if not storage.exists(path):
    return []
  out = []
  for line in storage.read_text(path).splitlines():
    try:
      out.append(json.loads(line))
    except json.JSONDecodeError:
      continue
  return out


class MetricsWriter:
  """`wandb`: a W&B run (trainer/wandb_run.py) that also takes every record's scalars, or None."""

  def __init__(self, workdir: str, *, tensorboard: bool = True, enabled: bool | None = None, wandb=None):
    self.enabled = jax.process_index() == 0 if enabled is None else enabled
    self.path = storage.join(workdir, "metrics.jsonl")
    self._wandb = wandb
    self._tb = None
    self._tb_dir = storage.Mirror(storage.join(workdir, "tensorboard")) if tensorboard and self.enabled else None
    if self.enabled:
      storage.makedirs(workdir)

  def _tensorboard(self, purge_step: int | None = None):
    """The TensorBoard writer, opened lazily; `purge_step` hides events at or after it (resume)."""
    if self._tb is None and self.enabled and self._tb_dir is not None:
      self._tb = _summary_writer()(self._tb_dir.local, purge_step=purge_step)
    return self._tb

  def truncate_after(self, step: int) -> None:
    """Keeps only complete records with step <= `step` (atomic rewrite); TensorBoard likewise; W&B's run opened,
    a new one where `step` is 0 (a new run in this workdir), this workdir's last one where it resumes."""
    if self._wandb is not None:
      self._wandb.start(new_run=step == 0)
    if not self.enabled:
      return
    self._tensorboard(purge_step=step + 1)
    if not storage.exists(self.path):
      return
    keep = [r for r in read_records(self.path) if r.get("step", 0) <= step]
    storage.write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in keep))

  def write(self, record: dict) -> None:
    if not self.enabled:
      return
    record = {k: _clean(v) for k, v in record.items()}
    storage.append_line(self.path, json.dumps(record))
    step = record["step"]
    scalars = {k: v for k, v in record.items()
               if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
    tb = self._tensorboard()
    if tb is not None:
      for k, v in scalars.items():
        tb.add_scalar(k, v, step)
      tb.flush()
      self._tb_dir.sync()
    if self._wandb is not None:
      self._wandb.log(scalars, step)

  def close(self, failed: bool = False):
    """`failed`: the run ends on an error (W&B marks its run failed, not finished)."""
    if self._tb is not None:
      self._tb.close()
      self._tb_dir.sync()
    if self._wandb is not None:
      self._wandb.close(failed)


def _say(msg: str, stream) -> None:
  """One timestamped line, on process 0 only."""
  if jax.process_index() == 0:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=stream, flush=True)


def console(msg: str) -> None:
  """The run's log: stderr."""
  _say(msg, sys.stderr)


def progress(msg: str) -> None:
  """What the run is doing while it sets up: stdout, so that a bad input found meanwhile is still the only line
  on stderr (docs: exit status 2 and one line)."""
  _say(msg, sys.stdout)


def format_count(n: float) -> str:
  """1234 -> 1.23K, 8.03e9 -> 8.03B: parameter and token counts at a glance."""
  for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
    if abs(n) >= size:
      return f"{n / size:.3g}{unit}"
  return f"{n:g}"


def format_eta(seconds: float) -> str:
  seconds = max(int(seconds), 0)
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def progress_line(r: dict, steps: int) -> str:
  mfu = "n/a" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%"
  return (f"step {r['step']:>6}/{steps}  loss {r['loss']:.4f}  lr {r['lr']:.2e}  grad_norm {r['grad_norm']:.3f}  "
          f"{r['tokens_per_s']:,.0f} tok/s  {r['tflops_per_device']:.2f} TFLOP/s/dev  MFU {mfu}  "
          f"step {r['step_time_s'] * 1e3:.0f} ms  ETA {format_eta(r['eta_s'])}")


def _summary_writer():
  """tensorboardX's SummaryWriter. tensorboardX imports torch wherever it is installed, only to accept torch
  tensors: 2-3 s of every start. ember logs floats, so unless torch is loaded already it is kept out of that
  import (a `None` entry in sys.modules makes `import torch` fail there, and is removed at once)."""
  hide_torch = "torch" not in sys.modules
  if hide_torch:
    sys.modules["torch"] = None
  try:
    from tensorboardX import SummaryWriter
  finally:
    if hide_torch:
      del sys.modules["torch"]
  return SummaryWriter
