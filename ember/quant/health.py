"""Quantization health: what each quantize op can report about its tensor, and when it is a problem.

With `log.quant_stats_every > 0`, every quantized projection's operands (activation x along K, the
weight along K, the output gradient along N: the copies the forward GEMM and dgrad read) are
quantized with `stats=True`, and the quantizer returns, next to its data, a vector over `STATS`:

  amax        max |x| of the tensor (over the shards of a shard_map group too)
  scale       the tensor scale used: 1 / scale_inv, about fmt.max / amax for current scaling, the history's for delayed,
              NVFP4's float32 global scale; 1 for MXFP8, which has block scales only
  saturated   elements whose scaled value |x * scale| exceeded the format's max and were clipped
  underflow   nonzero elements that quantized to zero
  nonzero     nonzero elements (the denominator of both fractions; padding zeros count in neither)
  staleness   amax / the amax the scale was made for: 1 for current scaling; for delayed scaling
              above 1 when the tensor grew past its history (a spike: it saturates)

Counts are float32 sums, computed in the same pass that scales and casts the tensor, so XLA fuses
the reductions into the quantize fusion instead of reading the tensor again. The trainer turns them
into fractions and aggregates them per projection and role (ember/trainer/quant_stats.py).

The thresholds of the console warning are here, one table (`THRESHOLDS`): a fraction of a tensor
underflowing or saturating, or a delayed scale 2**k behind its tensor; a recipe's own limits are in its
row of the recipe table (quant/recipe.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

STATS = ("amax", "scale", "saturated", "underflow", "nonzero", "staleness")
NUM_STATS = len(STATS)

# statistic -> (threshold, what it means). A statistic above its threshold in any layer warns. These
# are the defaults (set for FP8); a recipe whose format sits above them by design says so in its row of
# the recipe table (`Scheme.health_limits`, quant/recipe.py).
THRESHOLDS = {
    "underflow": (0.01, "of the nonzero elements quantized to zero"),
    "saturated": (0.001, "of the nonzero elements saturated at the format's max"),
    "staleness": (2.0**4, "amax above the amax its delayed scale was made for"),
}


def thresholds(limits=()) -> dict[str, tuple[float, str]]:
  """The warning thresholds: THRESHOLDS with a recipe's own `(statistic, limit)` pairs in their place."""
  overrides = dict(limits)
  return {stat: (overrides.get(stat, limit), meaning) for stat, (limit, meaning) in THRESHOLDS.items()}


# A value counts as saturated past the format's max by more than float32's rounding of `scaled`: the amax itself,
# scaled at a scale_inv up to three ulps below amax / max (ember/quant/quantizers.py), lands up to a few ulps above
# the max, and the cast loses nothing there.
SATURATION_SLACK = 1.0 + 2.0**-19


def measure(x32: jax.Array, scaled: jax.Array, data: jax.Array, fmt_max: float, amax: jax.Array, scale: jax.Array,
            staleness: jax.Array, reduce_axes: tuple[str, ...] = ()) -> jax.Array:
  """The `STATS` vector of one quantized tensor: `x32` the input in float32, `scaled` the value handed
  to the cast (before rounding and clipping), `data` the cast's result."""
  nonzero = x32 != 0
  counts = jnp.stack([jnp.sum(jnp.abs(scaled) > fmt_max * SATURATION_SLACK, dtype=jnp.float32),
                      jnp.sum(nonzero & (data == 0), dtype=jnp.float32),
                      jnp.sum(nonzero, dtype=jnp.float32)])
  if reduce_axes:
    counts = jax.lax.psum(counts, tuple(reduce_axes))
  return jnp.stack([amax, scale, counts[0], counts[1], counts[2], staleness]).astype(jnp.float32)


# How two micro-batches' measurements of a projection combine into the step's (ember/trainer/step.py). A
# projection's statistics are rows [..., R, STATS]: the first (x) and the last (the gradient) measure a
# different tensor in every micro-batch: the largest amax and staleness, the smallest scale (that of the
# largest amax), the counts summed. The rows between are its kernel(s), the same tensor every time: kept.
_COMBINE = {"amax": jnp.maximum, "scale": jnp.minimum, "saturated": jnp.add, "underflow": jnp.add,
            "nonzero": jnp.add, "staleness": jnp.maximum}
_IDENTITY = {"amax": 0.0, "scale": float("inf"), "saturated": 0.0, "underflow": 0.0, "nonzero": 0.0, "staleness": 0.0}


def _kernel_rows(shape) -> jax.Array:
  rows = jnp.arange(shape[-2])
  return ((rows > 0) & (rows < shape[-2] - 1))[:, None]


def combine(a: jax.Array, b: jax.Array) -> jax.Array:
  """Two micro-batches' statistics of the same projections combined, as if the step had measured them at once."""
  across = jnp.stack([_COMBINE[s](a[..., i], b[..., i]) for i, s in enumerate(STATS)], axis=-1)
  return jnp.where(_kernel_rows(a.shape), jnp.maximum(a, b), across)


def combine_identity(shape) -> jax.Array:
  """The statistics that `combine` leaves any measurement unchanged with."""
  across = jnp.broadcast_to(jnp.asarray([_IDENTITY[s] for s in STATS], jnp.float32), shape)
  return jnp.where(_kernel_rows(shape), 0.0, across)
