"""MoE token counts over a log interval: the train step returns each step's dropped, routed and overflowed
copies (overall and per layer); the loop adds them up on the device every step, and a logged step's record
holds the sums since the previous logged step. Nothing is sampled: a copy dropped on a step that is not
logged is counted all the same. Overflowed copies (outputs zeroed where a buffer the plan sized was full: the
ragged exchange's receive buffer, the capacity layout's slots; ember/layers/moe_dispatch.py) are warned about with
the layers they happened in and the setting that sizes that buffer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ember.layers import moe_dispatch
from ember.names import BY_LAYER, MOE_DROPPED_TOKENS, MOE_LAYER_COUNTS, MOE_OVERFLOW_TOKENS, MOE_ROUTED_TOKENS

TOTALS = (MOE_DROPPED_TOKENS, MOE_ROUTED_TOKENS, MOE_OVERFLOW_TOKENS)
KEYS = TOTALS + tuple(k + BY_LAYER for k in MOE_LAYER_COUNTS)


class MoeCounts:
  def __init__(self):
    self.sums, self.first = None, None

  def add(self, step: int, step_metrics) -> None:
    """Adds one step's counts (device arrays: no wait for the step)."""
    if MOE_DROPPED_TOKENS not in step_metrics:  # A dense model.
      return
    counts = {k: step_metrics[k] for k in KEYS}
    self.sums = counts if self.sums is None else jax.tree.map(jnp.add, self.sums, counts)
    self.first = step + 1 if self.first is None else self.first

  def take(self, done: int, plan: moe_dispatch.Plan | None = None) -> tuple[dict, list[str]]:
    """(the interval's totals for the record, warnings naming layers and `plan`'s buffers), and a new interval."""
    if self.sums is None:
      return {}, []
    host, first = jax.device_get(self.sums), self.first
    self.sums, self.first = None, None
    record = {k: float(host[k]) for k in TOTALS}
    overflow = np.asarray(host[MOE_OVERFLOW_TOKENS + BY_LAYER])
    warnings = []
    if overflow.sum() > 0:
      layers = ", ".join(f"layer {i}: {n:.0f}" for i, n in enumerate(overflow) if n > 0)
      steps = f"step {done}" if first == done else f"steps {first}-{done}"
      warnings.append(f"{steps}: {overflow.sum():.0f} MoE token copies did not fit {_buffers(plan)} ({layers}); "
                      "their expert outputs are zero")
    return record, warnings


def _buffers(plan: moe_dispatch.Plan | None) -> str:
  """The buffers that can overflow under `plan`, each with the setting that sizes it."""
  named = []
  if plan is None or plan.exchange == moe_dispatch.RAGGED:
    named.append("the ragged exchange's receive buffer (raise config.model.moe_ragged_buffer)")
  if plan is None or plan.expert_gemm == moe_dispatch.CAPACITY and plan.capacity is None:
    named.append("the capacity layout's slots (raise config.model.moe_expert_buffer, or set "
                 "config.model.moe_expert_gemm=ragged_dot)")
  return " or ".join(named)
