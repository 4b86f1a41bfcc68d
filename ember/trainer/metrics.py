"""What a run reports: metrics.jsonl, TensorBoard, Weights & Biases and the console line, written by process 0 only;
and the MoE token counts summed between logged steps.

Each record is one complete line added at once (ember/storage.py: appended and fsync'd locally, the object
rewritten whole in a bucket), so a crash leaves at most a torn *last* line; `truncate_after` (called on resume)
rewrites the file atomically without it and without records past the restored step, so the file never holds a
step twice or a gap.

Weights & Biases (`WandbRun`): every metrics record also logged to a W&B run (`log.wandb_project`). The run's id is
kept in the workdir (`wandb_run_id`), so a resumed run continues the same W&B run rather than starting a second one;
a new run in that workdir (no checkpoint restored: metrics.jsonl starts over) starts a new W&B run under a new id,
since W&B would drop every step of it up to the last one the earlier run logged. W&B refuses a step at or below one
it already holds: records a crash logged past the restored step are not rewritten there (metrics.jsonl is the record
of truth; it is truncated to the restored step). W&B's own environment applies: WANDB_MODE=offline writes the run
under the workdir's `wandb/` for a later `wandb sync` (W&B's own files are local: for a gs:// workdir, under ./wandb
or WANDB_DIR).

MoE token counts over a log interval (`MoeCounts`): the train step returns each step's dropped, routed and overflowed
copies (overall and per layer); the loop adds them up on the device every step, and a logged step's record
holds the sums since the previous logged step. Nothing is sampled: a copy dropped on a step that is not
logged is counted all the same. Overflowed copies (outputs zeroed where a buffer the plan sized was full: the
ragged exchange's receive buffer, the capacity layout's slots; ember/layers/moe_dispatch.py) are warned about with
the layers they happened in and the setting that sizes that buffer.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from ember import storage
from ember.errors import ConfigError, one_line
from ember.layers import moe_dispatch
from ember.names import BY_LAYER, MOE_DROPPED_TOKENS, MOE_LAYER_COUNTS, MOE_OVERFLOW_TOKENS, MOE_ROUTED_TOKENS


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
  """`wandb`: a W&B run (`WandbRun`) that also takes every record's scalars, or None."""

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


WANDB_ID_FILE = "wandb_run_id"


def _wandb_run_id(workdir: str, new_run: bool) -> str:
  """This workdir's W&B run id, made and written (atomically) by its first run, and again by a new run there."""
  path = storage.join(workdir, WANDB_ID_FILE)
  if not new_run:
    return storage.kept_id(path, 4)
  run_id = secrets.token_hex(4)
  storage.write_atomic(path, run_id)
  return run_id


class WandbRun:
  """A W&B run that takes the metrics records (`log`) as metrics.jsonl writes them; `start` opens it, once the run
  knows whether it resumed (MetricsWriter.truncate_after)."""

  def __init__(self, *, project: str, entity: str, name: str, workdir: str, config: dict):
    self._args = dict(project=project, entity=entity or None, name=name or os.path.basename(workdir),
                      config=config)
    self._workdir = workdir
    self._run = None

  def start(self, *, new_run: bool) -> None:
    """Opens the W&B run: this workdir's last one continued, or a new one where `new_run`."""
    import wandb  # The optional extra; checked at validation (config.py).
    storage.makedirs(self._workdir)
    local = None if storage.is_remote(self._workdir) else self._workdir
    try:
      self._run = wandb.init(**self._args, id=_wandb_run_id(self._workdir, new_run), resume="allow", dir=local,
                             settings=wandb.Settings(console="off", quiet=True))
    except wandb.errors.Error as e:  # No API key, no network, an unknown entity: the user's to fix, in one line.
      raise ConfigError(f"config.log.wandb_project: W&B did not start ({one_line(e)}); run `wandb login`, or set "
                        "WANDB_MODE=offline to log locally for a later `wandb sync`") from None

  def log(self, scalars: dict, step: int) -> None:
    if self._run is None:
      self.start(new_run=False)
    self._run.log(scalars, step=step)

  def close(self, failed: bool = False) -> None:
    if self._run is not None:
      self._run.finish(exit_code=1 if failed else 0)


MOE_TOTALS = (MOE_DROPPED_TOKENS, MOE_ROUTED_TOKENS, MOE_OVERFLOW_TOKENS)
MOE_KEYS = MOE_TOTALS + tuple(k + BY_LAYER for k in MOE_LAYER_COUNTS)


class MoeCounts:
  def __init__(self):
    self.sums, self.first = None, None

  def add(self, step: int, step_metrics) -> None:
    """Adds one step's counts (device arrays: no wait for the step)."""
    if MOE_DROPPED_TOKENS not in step_metrics:  # A dense model.
      return
    counts = {k: step_metrics[k] for k in MOE_KEYS}
    self.sums = counts if self.sums is None else jax.tree.map(jnp.add, self.sums, counts)
    self.first = step + 1 if self.first is None else self.first

  def take(self, done: int, plan: moe_dispatch.Plan | None = None) -> tuple[dict, list[str]]:
    """(the interval's totals for the record, warnings naming layers and `plan`'s buffers), and a new interval."""
    if self.sums is None:
      return {}, []
    host, first = jax.device_get(self.sums), self.first
    self.sums, self.first = None, None
    record = {k: float(host[k]) for k in MOE_TOTALS}
    overflow = np.asarray(host[MOE_OVERFLOW_TOKENS + BY_LAYER])
    warnings = []
    if overflow.sum() > 0:
      layers = ", ".join(f"layer {i}: {n:.0f}" for i, n in enumerate(overflow) if n > 0)
      steps = f"step {done}" if first == done else f"steps {first}-{done}"
      warnings.append(f"{steps}: {overflow.sum():.0f} MoE token copies did not fit {_moe_buffers(plan)} ({layers}); "
                      "their expert outputs are zero")
    return record, warnings


def _moe_buffers(plan: moe_dispatch.Plan | None) -> str:
  """The buffers that can overflow under `plan`, each with the setting that sizes it."""
  named = []
  if plan is None or plan.exchange == moe_dispatch.RAGGED:
    named.append("the ragged exchange's receive buffer (raise config.model.moe_ragged_buffer)")
  if plan is None or plan.expert_gemm == moe_dispatch.CAPACITY and plan.capacity is None:
    named.append("the capacity layout's slots (raise config.model.moe_expert_buffer, or set "
                 "config.model.moe_expert_gemm=ragged_dot)")
  return " or ".join(named)
