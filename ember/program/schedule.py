"""The train step compiled with XLA's latency-hiding scheduler told what each of its kernels and collectives takes.

The scheduler places each asynchronous collective's start and done by its own estimate of the collective and of
the kernels it could hide behind (on GPUs, XLA's speed-of-light model). Timed at ember's rates (predict.py: fit to
measured steps), its schedules leave collectives waiting that it thought hidden: llama3_8b's preset at
Megatron-Bridge's batch on `h100x8` (16 micro-batches) waited 0.37 s a step on reduce-scatters each started a
kernel or two before its done.

XLA also takes those estimates from a profile: a `ProfiledInstructionsProto`, the cost of each instruction by name,
the file JAX's profile-guided scheduling writes from a measured run. `compile_scheduled` compiles the step, writes
the predicted time of each of its kernels and transfers as that profile (predict.latency_profile), and compiles the
step again with it. The second compile sees the same program up to the scheduler, so every name matches, and the
profile of its result is the same one: once is enough. The scheduler stays a heuristic, told the times or not, so
the program predicted faster of the two is kept. Compiled for described H100s this takes up to 3.5% off the
predicted step (docs/performance.md, "The scheduler told the predicted times"); the compile takes about twice as
long. Another schedule of the same kernels can win back at most what the first one waits on its transfers
(predict.waits_s), so where that is under `WORTH_A_SECOND_COMPILE` of the step (one GPU: nothing) the step is
compiled once.

It is done where ember has the GPU's rates (ember/hardware/) and `train.schedule_by_prediction` is on, by every
compile of the step (the run, the bench, the compile report, the planner), so what is predicted is what runs. A
profile the user gives XLA (a measured one, `--xla_gpu_pgle_profile_file_or_directory_path`) is left to rule.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
from typing import Any

from ember import storage
from ember.program import cost, hlo, predict
from ember.xla_flags import xla_flag_value

PROFILE_OPTION = "xla_gpu_pgle_profile_file_or_directory_path"  # The DebugOptions field XLA reads a profile from.
# The share of the first program's predicted step that its waits on transfers must reach for a second compile:
# what a second schedule could win at best, against a compile as long as the first.
WORTH_A_SECOND_COMPILE = 0.005


@dataclasses.dataclass(frozen=True)
class Scheduled:
  """A compiled step, and the predicted steps of the two schedules where both were compiled."""
  compiled: Any  # jax.stages.Compiled.
  predicted_s: tuple[float, float] | None = None  # (XLA's estimates, told the predicted times).
  waits_s: float | None = None  # What the first program's predicted step waits on transfers; None: not predicted.

  @property
  def by_prediction(self) -> bool:
    """Whether the program kept is the one scheduled by the predicted times."""
    return self.predicted_s is not None and bool(self.predicted_s[1] <= self.predicted_s[0])


def compile_scheduled(lowered, compiler_options: dict | None, mesh, by_prediction: bool = True,
                      beat_s: float | None = None) -> Scheduled:
  """`lowered` (a lowered jit on `mesh`) compiled with `compiler_options`; where `compiles_twice` and the first
  program waits enough on its transfers to be worth it, compiled again with the scheduler told the first program's
  predicted times (module doc), and the program predicted faster kept: the scheduler's heuristics can place a
  collective worse even when told the times. `beat_s`: a predicted step the caller already has (the planner's best
  so far), or None: a program that no schedule could make faster than it is compiled once."""
  compiled = lowered.compile(compiler_options=compiler_options)
  if not compiles_twice(compiler_options, mesh, by_prediction):
    return Scheduled(compiled)
  machine = cost.Machine.of_mesh(mesh)
  walk = predict.Walk(hlo.Program(compiled.as_text()))
  first = predict.predict(walk, machine)
  waits = float(predict.waits_s(walk, machine, first))
  if waits <= WORTH_A_SECOND_COMPILE * first.step_s or (beat_s is not None and first.step_s - waits >= beat_s):
    return Scheduled(compiled, waits_s=waits)
  profile = predict.latency_profile(walk, machine)
  again = lowered.compile(compiler_options={**(compiler_options or {}), PROFILE_OPTION: profile_file(profile)})
  steps = (float(first.step_s), float(predict.predict(predict.Walk(hlo.Program(again.as_text())), machine).step_s))
  return Scheduled(again if steps[1] <= steps[0] else compiled, steps, waits)


def compiles_twice(compiler_options: dict | None, mesh, by_prediction: bool = True) -> bool:
  """Whether `compile_scheduled` compiles a second time: on GPUs ember/hardware/ has rates for, `by_prediction`,
  and no profile given (in the compile's options or in XLA_FLAGS)."""
  machine = cost.Machine.of_mesh(mesh) if by_prediction else None
  given = ((compiler_options or {}).get(PROFILE_OPTION)
           or xla_flag_value(os.environ.get("XLA_FLAGS", ""), "--" + PROFILE_OPTION))
  return machine is not None and machine.rates is not None and not given


def profile_file(profile: str) -> str:
  """A file holding `profile`, named by its content: the same program gets the same path in every process and run,
  so the path in the compile options keeps JAX's compilation cache key. XLA reads a profile by its `.pbtxt` suffix."""
  digest = hashlib.sha256(profile.encode()).hexdigest()[:24]
  path = os.path.join(tempfile.gettempdir(), "ember-schedules", f"{digest}.pbtxt")
  if not os.path.exists(path):  # Processes of a node may write it at once: each writes a whole file and renames it.
    storage.makedirs(os.path.dirname(path))
    storage.write_atomic(path, profile)
  return path
