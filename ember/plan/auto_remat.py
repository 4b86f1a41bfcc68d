"""`remat.policy=auto`: the fastest preset whose compiled step fits the budget.

For each candidate preset the real train step is traced and compiled ahead of time on abstract
sharded inputs (nothing is allocated): XLA's memory analysis gives the peak bytes per device, the
compiled program's predicted step (ember/program/predict.py: on GPUs ember/hardware/ knows, a run's or a
described target's) the cost; elsewhere the traced step's FLOPs (forward, recompute, backward, update;
ember/plan/step.py), since everything but the recomputation is the same. Candidates whose peak exceeds
`remat.memory_budget_gb` (GiB, 2**30 bytes, per device) are dropped; of the rest the one predicted
fastest wins (else the fewest FLOPs: the least recomputation). The prediction counts what FLOPs do
not: a preset that offloads its residuals waits for the host link (llama3_8b on 8 H100s: `minimal`'s
names offloaded predict 1.65 s, recomputing everything 1.06 s). Ties (presets that differ only in names
this model never produces) go to the one that moves nothing to host memory, then to the smaller peak.

Under a precision schedule (`quant.schedule`) each phase's recipe compiles its own step: a preset's peak is the
largest of its phases', its FLOPs and predicted step their mean weighted by the phases' steps.

Candidates: `remat.auto_candidates`, or every preset that can differ for this model: the quantized
presets only where a phase's recipe is quantized, the offloaded ones only where host offloading exists (not
on the CPU backend, whose compiler strips memory-placement annotations).
"""

from __future__ import annotations

import dataclasses
import math

import jax

from ember import remat
from ember.config import Settings
from ember.errors import ConfigError
from ember.plan import step as step_plan
from ember.plan.units import GiB, format_flops
from ember.trainer.metrics import console
from ember.trainer.optimizer import make_optimizer
from ember.trainer.state import state_shardings

_cache: dict[tuple, step_plan.StepFigures] = {}


@dataclasses.dataclass(frozen=True)
class Candidate:
  name: str
  flops: float
  peak_bytes: int
  predicted_s: float | None = None

  @property
  def offloads(self) -> bool:
    return bool(remat.PRESETS[self.name].offload)


def candidates(cfg: Settings, mesh=None) -> tuple[str, ...]:
  """The presets `auto` compiles: `remat.auto_candidates`, else every preset that can differ for this
  model (under any of its precision phases' recipes) on the mesh's platform (offloading needs a GPU or TPU)."""
  if cfg.remat.auto_candidates:
    return tuple(cfg.remat.auto_candidates)
  quantized = any(recipe.quantized for _, recipe in cfg.phases)
  names = [n for n, p in remat.PRESETS.items() if quantized or not p.quantized_only]
  platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
  if platform == "cpu":
    names = [n for n in names if not remat.PRESETS[n].offload]
  return tuple(names)


def measure(cfg: Settings, mesh, tx, schedule, names, *, compiler_options: dict | None = None) -> list[Candidate]:
  """Compiles the train step under each preset (cached per config, mesh and preset)."""
  # The budget and policy do not change what a preset compiles to.
  base = (dataclasses.replace(cfg, remat=None), tuple(mesh.shape.items()), tuple(d.id for d in mesh.devices.flat),
          mesh.devices.flat[0].platform, repr(sorted((compiler_options or {}).items())))
  out = []
  for name in names:
    key = base + (name,)
    if key not in _cache:
      _cache[key] = step_plan.step_figures(cfg, mesh, tx, schedule, remat.PRESETS[name],
                                           compiler_options=compiler_options)
    f = _cache[key]
    if f.peak_bytes is None:
      raise ConfigError("config.remat.policy: auto needs a memory analysis of the compiled step, and this backend "
                        "gives none; choose a preset")
    out.append(Candidate(name, f.flops, f.peak_bytes, f.predicted_s))
    predicted = "" if f.predicted_s is None else f"  predicted {f.predicted_s * 1e3:,.0f} ms/step"
    console(f"remat auto: {name:<26} peak {f.peak_bytes / GiB:9.4g} GiB/device  "
            f"{format_flops(f.flops):>13}/step{predicted}")
  return out


def phase_weights(cfg: Settings) -> list[tuple[Settings, float]]:
  """(the settings of each precision phase with a recipe of its own, its share of the run's steps): the programs
  the run compiles, each run for that share."""
  bounds = [start for start, _ in cfg.phases] + [cfg.steps]
  first, share = {}, {}
  for index, (_, recipe) in enumerate(cfg.phases):
    first.setdefault(recipe, index)
    share[recipe] = share.get(recipe, 0.0) + max(bounds[index + 1] - bounds[index], 0) / max(cfg.steps, 1)
  return [(cfg.at_phase(first[recipe]), share[recipe]) for recipe in first]


def measure_phases(cfg: Settings, mesh, tx, schedule, names, *,
                   compiler_options: dict | None = None) -> list[Candidate]:
  """`measure` under every precision phase's recipe: each preset at its largest peak over the phases, its FLOPs and
  predicted step weighted by the phases' shares of the steps (one phase: `measure`'s figures)."""
  phases = phase_weights(cfg)
  if len(phases) == 1:
    return measure(cfg, mesh, tx, schedule, names, compiler_options=compiler_options)
  found = []
  for settings, share in phases:
    console(f"remat auto: under {settings.quant.name} ({share:.0%} of the steps)")
    found.append((measure(settings, mesh, tx, schedule, names, compiler_options=compiler_options), share))
  out = []
  for i, name in enumerate(names):
    each = [(phase[i], share) for phase, share in found]
    predicted = None if any(c.predicted_s is None for c, _ in each) else sum(c.predicted_s * w for c, w in each)
    out.append(Candidate(name, sum(c.flops * w for c, w in each), max(c.peak_bytes for c, _ in each), predicted))
  return out


def pick(found: list[Candidate], budget_gb: float) -> Candidate:
  """The candidate within the budget predicted fastest (where every one has a prediction), else with the fewest
  FLOPs; ConfigError naming the smallest peak if none fits."""
  fits = [c for c in found if c.peak_bytes <= budget_gb * GiB]
  if not fits:
    smallest = min(found, key=lambda c: c.peak_bytes)
    raise ConfigError(f"config.remat.memory_budget_gb: no remat preset fits {budget_gb:g} GiB per device; the smallest "
                      f"compiled peak is {smallest.peak_bytes / GiB:.4g} GiB ({smallest.name})")
  order = {c.name: i for i, c in enumerate(found)}
  predicted = all(c.predicted_s is not None for c in fits)
  return min(fits, key=lambda c: (c.predicted_s if predicted else c.flops, c.offloads, c.peak_bytes, order[c.name]))


def state_bytes_per_device(cfg: Settings, mesh, tx) -> int:
  """One device's share of the train state (parameters, optimizer and quantization state): every preset's
  compiled peak holds it."""
  _, shardings, abstract = state_shardings(cfg, mesh, tx)
  sizes = jax.tree.map(lambda a, s: math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize, abstract, shardings)
  return int(sum(jax.tree.leaves(sizes)))


def choose(cfg: Settings, mesh, tx, schedule, *, compiler_options: dict | None = None) -> str:
  """The preset name `auto` resolves to for this config, mesh and optimizer (logged)."""
  budget = cfg.remat.memory_budget_gb
  if budget <= 0:  # The compile tools give `auto` the target's memory; a run must say its own.
    raise ConfigError("config.remat.memory_budget_gb: policy auto needs a budget > 0 (GiB per device)")
  state = state_bytes_per_device(cfg, mesh, tx)
  if state > budget * GiB:  # No preset can fit: say so before compiling any.
    raise ConfigError(f"config.remat.memory_budget_gb: {budget:g} GiB per device is less than the train state alone "
                      f"({state / GiB:.4g} GiB per device: parameters, optimizer state); no remat preset fits")
  console(f"remat auto: compiling the train step for {len(candidates(cfg, mesh))} presets (budget {budget:g} "
          "GiB/device)")
  best = pick(measure_phases(cfg, mesh, tx, schedule, candidates(cfg, mesh), compiler_options=compiler_options),
              budget)
  console(f"remat auto: chose {best.name} (peak {best.peak_bytes / GiB:.4g} GiB/device within {budget:g} GiB)")
  return best.name


def resolve(cfg: Settings, mesh, *, compiler_options: dict | None = None):
  """The config with `remat.policy=auto` replaced by the preset it chooses; any other config as it is.

  Called once before the loop starts (train.py, the tools), so the trainer only ever sees presets."""
  if cfg.remat.policy != "auto":
    return cfg
  tx, schedule = make_optimizer(cfg)
  chosen = choose(cfg, mesh, tx, schedule, compiler_options=compiler_options)
  return cfg.replace("remat.policy", chosen)
