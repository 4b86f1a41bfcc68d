"""Precision schedules (`quant.schedule`): which quantization config runs each step, and the state between.

The phases are a function of the config and the step (`config.precision_phases`): phase i runs steps
[start_i, start_{i+1}). The step that trains is the state's `step`, so the schedule position is part
of the train state and of every checkpoint: a resumed run is in the phase its step says, whichever
side of a switch it was saved on. The state *after* step s was made by the phase of step s - 1
(`state_phase`); before running a step of another phase the loop moves the state over (`carry`) and
compiles that phase's step once.

What moves: parameters and optimizer state unchanged (recipes do not change their shapes); the
quantization state (delayed-scaling amax histories) leaf by leaf where the new phase still keeps the
same history (same path and shape), zeros where it starts one; histories the new phase does not
use are dropped.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ember import config as config_lib
from ember.trainer.state import TrainState


class Phases:
  def __init__(self, cfg):
    self.phases = config_lib.precision_phases(cfg)

  def __len__(self) -> int:
    return len(self.phases)

  def at(self, step: int) -> int:
    """The phase that runs step `step` (0-based)."""
    return max(i for i, (start, _) in enumerate(self.phases) if start <= step)

  def state_phase(self, step: int) -> int:
    """The phase whose step made the state that has taken `step` steps (phase 0 before any)."""
    return self.at(max(step - 1, 0))

  def cfg(self, phase: int):
    return self.phases[phase][1]

  def start(self, phase: int) -> int:
    return self.phases[phase][0]

  def describe(self, phase: int) -> str:
    q = self.cfg(phase).quant
    forward = "" if q.forward == "recipe" else f", forward GEMMs {q.forward}"
    return f"phase {phase} (recipe {q.recipe}{forward})"


def _by_path(tree) -> dict:
  return {jax.tree_util.keystr(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def carry(state: TrainState, abstract: TrainState, shardings: TrainState) -> TrainState:
  """`state` in the structure of another phase (`abstract`, placed by `shardings`): amax histories kept
  where the phase keeps the same one, zeros where it starts one."""
  old = _by_path(state.quant_state)

  def take(path, leaf, sharding):
    kept = old.get(jax.tree_util.keystr(path))
    if kept is not None and kept.shape == leaf.shape and kept.dtype == leaf.dtype:
      return kept
    return jax.device_put(jnp.zeros(leaf.shape, leaf.dtype), sharding)

  quant_state = jax.tree_util.tree_map_with_path(take, abstract.quant_state, shardings.quant_state)
  return dataclasses.replace(state, quant_state=quant_state)
