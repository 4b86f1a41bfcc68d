"""Hangs end the job, stragglers are named.

Hangs: a deadline on each stage of the training loop, and what happens past it. A stopped or dead process stalls
every other one in its next collective, and nothing raises: the job would hold its nodes forever. The loop tells the
`Watchdog` what it starts and how long that may take (`expect`); past the deadline the watchdog's thread writes one
line naming the stage and the stall, then every thread's Python stack (faulthandler), to stderr (the process's log),
and ends the process with `HUNG_EXIT_STATUS` without running exit handlers (they would wait on the same stalled
collective). SLURM (a `--requeue` or retry loop) or a JobSet then restarts the job, which resumes from its newest
checkpoint (docs/multihost.md, "When a job fails").

How long a stage may take (`Deadlines`): `train.step_timeout_s` for a step and its logging once set; by default
(0) `AUTO_MULTIPLE` x the median of the steps timed so far, at least `AUTO_FLOOR_S`, once `AUTO_AFTER_STEPS`
steps are timed. A stage that may compile (the first step of a precision phase, the first evaluation) or write
a checkpoint, and every step before the timing starts, gets `train.compile_timeout_s`. XLA's own collective
timeouts on GPUs (`xla_flags`) are set a margin past the watchdog's, so that the watchdog, which names the step,
speaks first.

Stragglers: which process holds the others back, and by how much. Every process runs the same step and meets the
others in its collectives, so every process measures the same step time: a slow one makes the others wait inside the
step, where no timer of theirs can tell who was late. So each process measures its own speed apart from the step, at
every log step: a fixed GEMM probe on each of its devices, timed alone (`probe_seconds`: its slowest device; a
throttled GPU, a loaded host CPU or a slow launch path all show here), and the time it waited for its input
pipeline's batches over the interval. The processes gather both (one small all-gather) and the record names the
slowest prober (`straggler_process`), its probe time (`straggler_probe_s`), the median of the others'
(`median_probe_s`), their ratio (`straggler_ratio`: the median of the others, so that with two processes a process
at half speed reads 2), and the process that waited longest for its input (`input_wait_process`, `input_wait_s` per
step). A ratio past `log.straggler_ratio` prints a warning line naming the process. One process: nothing to compare,
no keys.
"""

from __future__ import annotations

import faulthandler
import functools
import os
import statistics
import sys
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ember import native_output
from ember import xla_flags as xla_flags_lib


HUNG_EXIT_STATUS = 75  # sysexits' EX_TEMPFAIL: "try again later"; docs/multihost.md lists every status.
STEP_KEY, COMPILE_KEY = "train.step_timeout_s", "train.compile_timeout_s"  # What each deadline's line names.
AUTO_MULTIPLE = 10.0
AUTO_FLOOR_S = 120.0
AUTO_AFTER_STEPS = 5
XLA_MARGIN_S = 60  # XLA's collective timeouts: this much past the step's (or the compile's) timeout.


def _exit_now(status: int) -> None:
  """Ends the process at once (no clean-up: a collective may never return), its last lines written first: the
  console's pipes (ember/native_output.py) drained to their descriptors."""
  native_output.restore()
  os._exit(status)


class Watchdog:
  """A daemon thread that ends the process when the stage set by `expect` outlives its deadline."""

  def __init__(self, *, process_index: int = 0, out=None, exit: Callable[[int], None] | None = None):
    self._process, self._out, self._exit = process_index, out, exit or _exit_now
    self._cond = threading.Condition()
    self._deadline: float | None = None
    self._what, self._seconds, self._key, self._closed = "", 0.0, "", False
    self._thread = threading.Thread(target=self._watch, name="ember-watchdog", daemon=True)
    self._thread.start()

  def expect(self, what: str, seconds: float | None, key: str) -> None:
    """`what` starts now and must end within `seconds` (None or <= 0: no deadline), which config `key` set."""
    with self._cond:
      self._what, self._seconds, self._key = what, seconds or 0.0, key
      self._deadline = time.monotonic() + seconds if seconds and seconds > 0 else None
      self._cond.notify()

  def disarm(self) -> None:
    self.expect("", None, STEP_KEY)

  def close(self) -> None:
    with self._cond:
      self._closed, self._deadline = True, None
      self._cond.notify()
    self._thread.join(timeout=5)

  def _watch(self) -> None:
    with self._cond:
      while not self._closed:
        if self._deadline is None:
          self._cond.wait()
          continue
        left = self._deadline - time.monotonic()
        if left > 0:
          self._cond.wait(timeout=left)
          continue
        self._fire()
        return

  def _fire(self) -> None:
    out = self._out or sys.stderr
    out.write(f"error: process {self._process}: {self._what} made no progress in {self._seconds:.0f} s "
              f"({self._key}): a stopped or lost process, or a stalled collective; exiting with status "
              f"{HUNG_EXIT_STATUS} so the job can be restarted from its newest checkpoint. Python stacks:\n")
    out.flush()
    try:
      faulthandler.dump_traceback(file=out, all_threads=True)
    except (AttributeError, ValueError, OSError):  # A stream without a file descriptor (a test's StringIO).
      import traceback
      for thread_id, frame in sys._current_frames().items():
        out.write(f"Thread {thread_id:#x}:\n{''.join(traceback.format_stack(frame))}")
    out.flush()
    self._exit(HUNG_EXIT_STATUS)


class Deadlines:
  """How long each stage of the loop may take (the module's docstring says the rule); `timed(seconds)` feeds the
  measured steps."""

  def __init__(self, step_timeout_s: float, compile_timeout_s: float):
    self.step_timeout_s, self.compile_timeout_s = step_timeout_s, compile_timeout_s
    self._times: list[float] = []

  def timed(self, seconds: float) -> None:
    self._times = (self._times + [seconds])[-100:]

  def step(self) -> tuple[float | None, str]:
    """(seconds, the config key that set them) of a step (or its logging) that compiles nothing."""
    if self.step_timeout_s < 0:
      return None, STEP_KEY
    if self.step_timeout_s > 0:
      return self.step_timeout_s, STEP_KEY
    if len(self._times) < AUTO_AFTER_STEPS:
      return self.compile_timeout_s, COMPILE_KEY
    return max(AUTO_MULTIPLE * statistics.median(self._times), AUTO_FLOOR_S), STEP_KEY

  def long(self) -> tuple[float | None, str]:
    """(seconds, the config key that set them) of a stage that may compile or write a checkpoint."""
    if self.step_timeout_s < 0:
      return None, STEP_KEY
    return (self.compile_timeout_s, COMPILE_KEY) if self.compile_timeout_s >= self.step_timeout_s else \
        (self.step_timeout_s, STEP_KEY)


def xla_flags(xla_flags_value: str, step_timeout_s: float, compile_timeout_s: float) -> str:
  """XLA_FLAGS with the GPU's collective timeouts set `XLA_MARGIN_S` past the watchdog's, unless the user set them:
  a collective after `train.step_timeout_s` (or, while that is measured, `train.compile_timeout_s`), and the first
  collective of a program, which waits for the slowest process's compile, after `train.compile_timeout_s`.
  Unchanged when timeouts are off (-1). XLA reads them when JAX starts its backend."""
  if step_timeout_s < 0:
    return xla_flags_value
  wanted = {"--xla_gpu_nccl_termination_timeout_seconds": (step_timeout_s or compile_timeout_s),
            "--xla_gpu_first_collective_call_terminate_timeout_seconds": max(step_timeout_s, compile_timeout_s)}
  return xla_flags_lib.with_xla_flags(xla_flags_value, {flag: str(int(s) + XLA_MARGIN_S) for flag, s in wanted.items()})


# The probe: REPEATS products of a [SIZE, SIZE] matrix with itself (bfloat16 on GPUs: ~1.1 TFLOP, about a
# millisecond on an H100; float32 and small on CPUs). Big enough that the GEMMs, not the launch, dominate.
PROBE = {"gpu": (4096, 8, jnp.bfloat16), "cpu": (512, 8, jnp.float32)}


@functools.cache
def _probe_fn(size: int, repeats: int, dtype):
  def run(x):
    return jax.lax.fori_loop(0, repeats, lambda _, y: jnp.tanh(y @ x), x)
  return jax.jit(run)


_warm: set = set()  # The devices the probe has run on: compiled for them, and warm.


def probe_seconds(devices=None) -> float:
  """The slowest of this process's devices' times for the probe, each timed alone. A device's first probe runs it
  once untimed (its compile); later ones time their first run: between two log steps the device ran the train
  steps, so it is as warm as a warm-up would make it, and a second run at every log step would double the probe's
  cost (a tenth of a second a log step on CPU devices)."""
  devices = jax.local_devices() if devices is None else devices
  slowest = 0.0
  for device in devices:
    size, repeats, dtype = PROBE["gpu" if device.platform in ("gpu", "cuda", "rocm") else "cpu"]
    x = jnp.full((size, size), 1.0 / size, dtype, device=device)
    fn = _probe_fn(size, repeats, dtype)
    if device not in _warm:
      fn(x).block_until_ready()
      _warm.add(device)
    t0 = time.perf_counter()
    fn(x).block_until_ready()
    slowest = max(slowest, time.perf_counter() - t0)
  return slowest


class Stragglers:
  def __init__(self, warn_ratio: float):
    self.warn_ratio = warn_ratio
    self._input_s, self._steps = 0.0, 0

  def add_input_wait(self, seconds: float) -> None:
    """One step's wait for its next batch on this process."""
    self._input_s += seconds
    self._steps += 1

  def take(self, gather, probe=probe_seconds) -> tuple[dict, str | None]:
    """(the record's keys, a warning line or None) for the interval since the last call; `gather(values)` stacks
    every process's `values` ([processes, ...]); every process calls this at the same step."""
    mine = np.asarray([probe(), self._input_s / max(self._steps, 1)], np.float64)
    self._input_s, self._steps = 0.0, 0
    probes, inputs = np.asarray(gather(mine)).reshape(-1, 2).T
    slowest, waiter = int(np.argmax(probes)), int(np.argmax(inputs))
    median = float(np.median(np.delete(probes, slowest))) if len(probes) > 1 else float(probes[0])
    ratio = float(probes[slowest] / median) if median > 0 else 1.0
    record = {"straggler_process": slowest, "straggler_ratio": ratio, "straggler_probe_s": float(probes[slowest]),
              "median_probe_s": median, "input_wait_process": waiter, "input_wait_s": float(inputs[waiter])}
    warning = None
    if ratio >= self.warn_ratio:
      warning = (f"process {slowest} is a straggler: its devices run the probe in {probes[slowest] * 1e3:.1f} ms "
                 f"against the others' median {median * 1e3:.1f} ms ({ratio:.2f}x, log.straggler_ratio "
                 f"{self.warn_ratio:g}); every other process waits for it in each step's collectives (a throttled "
                 "GPU, a loaded host)")
    return record, warning
