"""Stragglers named: which process holds the others back, and by how much.

Every process runs the same step and meets the others in its collectives, so every process measures the same step
time: a slow one makes the others wait inside the step, where no timer of theirs can tell who was late. So each
process measures its own speed apart from the step, at every log step: a fixed GEMM probe on each of its devices,
timed alone (`probe_seconds`: its slowest device; a throttled GPU, a loaded host CPU or a slow launch path all show
here), and the time it waited for its input pipeline's batches over the interval. The processes gather both (one
small all-gather) and the record names the slowest prober (`straggler_process`), its probe time
(`straggler_probe_s`), the median of the others' (`median_probe_s`), their ratio (`straggler_ratio`: the median of
the others, so that with two processes a process at half speed reads 2), and the process that waited
longest for its input (`input_wait_process`, `input_wait_s` per step). A ratio past `log.straggler_ratio` prints a
warning line naming the process. One process: nothing to compare, no keys.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

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
