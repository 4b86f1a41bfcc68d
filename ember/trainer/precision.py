"""Precision schedules (`quant.schedule`): which quantization config runs each step, and the state between.

The phases are a function of the config and the step (`ember/config/phases.py` parses them; `Settings.phases`): phase i runs steps
[start_i, start_{i+1}). The step is the loop's (batches consumed, a checkpoint's step; `state.step` counts the
updates applied, fewer by any skipped for a non-finite gradient), so the schedule position is part of every
checkpoint: a resumed run is in the phase its step says, whichever side of a switch it was saved on. The state *after* step s was made by the phase of step s - 1
(`state_phase`); before running a step of another phase the loop moves the state over (`carry`) and
compiles that phase's step once.

What moves: parameters and optimizer state layer by layer (recipes do not change their shapes, but another
`quant.exclude` can regroup the layers' scan segments); the quantization state (delayed-scaling amax histories)
layer by layer where the new phase still keeps the same history (same layer, projection and shape), zeros where
it starts one; histories the new phase does not use are dropped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ember.config import Settings
from ember.layers.decoder import rows_by_layer, stacked_like
from ember.trainer.state import TrainState


class Phases:
  def __init__(self, cfg: Settings):
    self.settings, self.phases = cfg, cfg.phases

  def __len__(self) -> int:
    return len(self.phases)

  def at(self, step: int) -> int:
    """The phase that runs step `step` (0-based)."""
    return max(i for i, (start, _) in enumerate(self.phases) if start <= step)

  def state_phase(self, step: int) -> int:
    """The phase whose step made the state that has taken `step` steps (phase 0 before any)."""
    return self.at(max(step - 1, 0))

  def cfg(self, phase: int):
    """The settings that run phase `phase`."""
    return self.settings.at_phase(phase)

  def start(self, phase: int) -> int:
    return self.phases[phase][0]

  def describe(self, phase: int) -> str:
    q = self.phases[phase][1]
    forward = "" if q.forward == "recipe" else f", forward GEMMs {q.forward}"
    return f"phase {phase} (recipe {q.name}{forward})"


def restacked(tree, old_cfg: Settings, new_cfg: Settings, like, missing=None):
  """`tree` (a state tree stacked as `old_cfg` stacks the layers) stacked as `new_cfg` does, in the structure of
  `like` (another `quant.exclude` groups the layers into other scan segments): each layer's row where the new
  stacking puts that layer. A row `tree` lacks (or holds in another shape or dtype) is `missing(key, want, kept)`
  (`kept`: the row held, or None), or an error without it."""
  rows = rows_by_layer(tree, old_cfg.model, old_cfg.quant)

  def row_of(key, want):
    kept = rows.get(key)
    if kept is not None and kept.shape == want.shape and kept.dtype == want.dtype:
      return kept
    if missing is None:
      raise ValueError(f"precision schedule: no {key} of shape {want.shape} to carry into the next phase")
    return missing(key, want, kept)
  return stacked_like(row_of, new_cfg.model, new_cfg.quant, like)


def _history_or_zeros(key, want, kept):
  """An amax history of another length (newest entry first: quant/quantizers.py's `update_history`) cut to its
  newest entries or padded with zeros; any other new row of the quantization state, zeros. A switch that changes
  only `quant.amax_history_len` keeps the scales its layers had: a zero history would scale by 1 for a step."""
  _, path = key
  if (kept is not None and path and path[-1] == "amax_history" and kept.dtype == want.dtype
      and kept.shape[:-1] == want.shape[:-1]):
    n = want.shape[-1]
    return jnp.pad(kept[..., :n], [(0, 0)] * (kept.ndim - 1) + [(0, max(n - kept.shape[-1], 0))])
  return jnp.zeros(want.shape, want.dtype)


def carry(state: TrainState, old_cfg, new_cfg, abstract: TrainState, shardings: TrainState) -> TrainState:
  """`state` (made under `old_cfg`) in the structure of `new_cfg`'s phase (`abstract`, placed by `shardings`).
  Each layer's parameters and optimizer state move to where the new phase stacks that layer (a phase whose
  `quant.exclude` differs can group the layers into other scan segments); each layer's amax history is kept where
  the new phase keeps the same one (its newest entries where the new one is shorter, padded with the empty
  entries a history starts with where longer), zeros where it starts one; and everything is laid out as the new
  phase's step takes it (its optimizer state split over the replicas or not: trainer/state.py's
  `replica_axes`)."""
  regrouped = lambda tree, like, missing=None: restacked(tree, old_cfg, new_cfg, like, missing)
  params_like = lambda x: isinstance(x, dict) and "segments" in x  # A tree stacked as the parameters are.
  if old_cfg.model.segments(old_cfg.quant) == new_cfg.model.segments(new_cfg.quant):
    # The layers stacked alike: parameters and optimizer state as they are (no second copy of them at the switch).
    params, opt_state = state.params, state.opt_state
  else:
    params = regrouped(state.params, abstract.params)
    opt_state = jax.tree.map(lambda old, like: regrouped(old, like) if params_like(old) else old,
                             state.opt_state, abstract.opt_state, is_leaf=params_like)
  new = TrainState(step=state.step, params=params, opt_state=opt_state,
                   quant_state=regrouped(state.quant_state, abstract.quant_state, missing=_history_or_zeros))
  return jax.device_put(new, shardings)
