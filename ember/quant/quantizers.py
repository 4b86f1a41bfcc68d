"""Quantizers: one immutable value object per scaling recipe.

Each is a frozen dataclass registered as a pytree (configuration in static
fields, state such as an amax history in data fields) with one method,

  quantize(x, axis=-1, *, rng=None, reduce_axes=(), stats=False, amax=None) -> QuantizedTensor.

`stats=True` also returns the tensor's health vector (ember/quant/health.py),
reduced in the same pass. `amax`: max|x| as `tensor_amax` takes it, taken by the
caller (a kernel quantized for each micro-batch of a step takes it once); per-tensor
quantizers (`reads_tensor_amax`) then skip their own pass over x, the others ignore it.

A quantizer holds no mesh, device or axis name. Under `jit` with sharded
inputs a plain `jnp.max` is already global, so nothing is needed; inside
`shard_map` the caller names the mesh axes to reduce the amax over with
`reduce_axes` (a `lax.pmax`). Block amaxes are always local: blocks never
straddle shards as long as shards hold whole blocks.

Which quantizer each recipe and role uses is the recipe table's business
(`ember.quant.recipe`). All arithmetic is float32, in the order written in each docstring; the
tests' NumPy reference does the same operations in the same order, so the
comparison is bit for bit. Scale policy shared by every recipe: a zero amax gives scale 1.0; a non-finite
per-tensor amax (current scaling's, NVFP4's global one) gives scale NaN, so the GEMM's output is NaN and the
step is skipped (a saturating cast would turn an Inf into the format's max: a finite, wrong step), while a
non-finite MXFP8 or NVFP4 block amax gives its block scale 1.0 (a NaN input stays NaN in E4M3/E5M2 data, +-Inf
saturates); a scale is clamped to the float32 max so that a tiny amax never makes it Inf (which would turn
0 * scale into NaN).

A per-tensor FP8 scale (current and delayed scaling) starts from its inverse:
scale_inv = amax * 2**margin / fmt.max rounded *up* to the nearest bfloat16
(`per_tensor_scale_inv`), scale = 1 / scale_inv. The GEMM dequantizes with scale_inv in the GEMM's own
dtype (`QuantizedTensor.dequantize`, the pattern XLA hands to cuBLASLt), so a
scale_inv that bf16 cannot hold would be rounded there by up to 2**-9: a bias
on every element of the tensor, the same sign everywhere. Held exactly, the
only error left is the cast's, and rounding up keeps |x * scale| <= fmt.max.
"""

import dataclasses
from typing import Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from ember.quant import formats, health
from ember.quant.formats import E2M1, E4M3, Format
from ember.quant.tensor import (QuantizedTensor, block_axes, block_broadcast,
                                block_reduce_max, normalize_axis, static_field)
from ember.remat import TENSOR_AMAX

_F32_MAX = float(np.finfo(np.float32).max)


def _reduce(amax: jax.Array, reduce_axes) -> jax.Array:
  """The max over the named mesh axes too (inside shard_map), if any."""
  return jax.lax.pmax(amax, tuple(reduce_axes)) if reduce_axes else amax


def tensor_amax(x: jax.Array, reduce_axes: tuple[str, ...] = (), *, finite: bool = False) -> jax.Array:
  """max |x| over the whole tensor, as float32; +Inf if any element is NaN (`formats.magnitude`). Taken in x's
  own dtype: abs and max are exact in every float format (and the widening after them too), so the pass reads
  bf16 bytes, not a float32 copy. `finite`: x holds no NaN by construction (a parameter: a step whose update is
  not finite is skipped, trainer/step.py), and |x| alone is taken: the NaN test changes how XLA fuses the
  stacked kernels' amaxes with their casts (3.7 ms of llama3_8b's fp8_current step on 8 H100s, compiled).

  Each row's max first, kept apart behind an optimization barrier: XLA then reduces the rows in a kernel that
  reads x where it lies, where one reduction over the whole tensor had it write |x| out first for a pass of its
  own (each RMSNorm output current scaling quantizes: llama3_8b's preset at Megatron-Bridge's batch on 8 H100s,
  135 GB a step, predicted -0.5%). Not where the amax is reduced over mesh axes too: there the barrier moved XLA's
  scheduling of those all-reduces (llama3_70b in Bridge's layout: predicted +0.1%)."""
  m = jnp.abs(x) if finite else formats.magnitude(x)
  if m.ndim > 1 and not reduce_axes:
    m = jax.lax.optimization_barrier(jnp.max(m, axis=-1))
  return _reduce(jnp.max(m).astype(jnp.float32), reduce_axes)


def block_amax(x: jax.Array, axes, block) -> jax.Array:
  """max |x| over each block, as float32, taken in x's own dtype (see `tensor_amax`)."""
  return block_reduce_max(formats.magnitude(x), axes, block).astype(jnp.float32)


def scale_from_amax(numerator: float, amax: jax.Array):
  """min(numerator / amax, f32 max); 1.0 for amax 0; NaN for a non-finite amax (NVFP4's global scale, applied in
  float32), as `per_tensor_scale_inv`."""
  ok = (amax > 0) & jnp.isfinite(amax)
  scale = jnp.float32(numerator) / jnp.where(ok, amax, 1.0)
  return jnp.where(ok, jnp.minimum(scale, _F32_MAX), _scale_of_no_amax(amax)).astype(jnp.float32)


def _scale_of_no_amax(amax: jax.Array) -> jax.Array:
  """A per-tensor scale where amax gives none: 1.0 for an all-zero tensor; NaN for a non-finite amax, so that the
  GEMM's output, and the step's loss or gradient norm, are NaN and the step is skipped (trainer/step.py): a
  saturating cast would turn an Inf into the format's max, a finite and wrong step."""
  return jnp.where(jnp.isfinite(amax), jnp.float32(1.0), jnp.float32(jnp.nan))


_BF16_MANTISSA = np.uint32(0xFFFF)  # The float32 bits below a bfloat16's.
# Float32 ulps above a bfloat16 that still round to it: a tensor that arrives quantized at scale_inv s (an MoE
# exchange's, layers/moe_dispatch.py) has amax fmt.max x s, and (fmt.max x s) x (1 / fmt.max) lands within two ulps
# of s; it must give s again, not the bfloat16 above it.
_ULPS_KEPT = np.uint32(3)
_MIN_SCALE_INV = np.float32(2.0**-126)  # The smallest normal float: 1 / scale_inv stays finite (2**126).


def per_tensor_scale_inv(fmt_max: float, amax: jax.Array, margin: int = 0) -> jax.Array:
  """amax x 2**margin x (1 / fmt_max), rounded up to a bfloat16 value (held in float32), at least 2**-126; 1.0 for
  amax 0, NaN for a non-finite amax (`_scale_of_no_amax`). See the module doc for why it is exact in bfloat16. A
  product, not a quotient: a compiler may turn a division by a constant into that product, and every one rounds
  the product alike. Up to `_ULPS_KEPT` ulps above a bfloat16 round down to it, so |x * scale| may pass fmt_max
  by as many ulps, where the saturating cast gives fmt_max, as rounding to nearest would."""
  ok = (amax > 0) & jnp.isfinite(amax)
  inv = jnp.where(ok, amax, 1.0).astype(jnp.float32) * jnp.float32(2.0**margin) * np.float32(1.0 / fmt_max)
  bits = jax.lax.bitcast_convert_type(inv, jnp.uint32)
  up = jax.lax.bitcast_convert_type((bits + (_BF16_MANTISSA - _ULPS_KEPT)) & ~_BF16_MANTISSA, jnp.float32)
  return jnp.where(ok, jnp.maximum(up, _MIN_SCALE_INV), _scale_of_no_amax(amax)).astype(jnp.float32)


def _per_tensor(x, axis, fmt, scale_inv, amax, recipe, *, stats=False, staleness=1.0,
                reduce_axes=()) -> QuantizedTensor:
  """scale = 1 / scale_inv, data = cast(x * scale)."""
  x32 = x.astype(jnp.float32)
  scale = jnp.float32(1.0) / scale_inv
  scaled = x32 * scale
  data = formats.cast(scaled, fmt)
  return QuantizedTensor(
      data=data,
      scale_inv=scale_inv,
      global_scale_inv=jnp.float32(1.0),
      amax=amax,
      recipe=recipe,
      axis=normalize_axis(axis, x.ndim),
      block=(),
      dtype=jnp.dtype(x.dtype).name,
      health=health.measure(x32, scaled, data, fmt.max, amax, scale, jnp.asarray(staleness, jnp.float32),
                            reduce_axes) if stats else None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CurrentScaling:
  """Per-tensor current scaling: scale = fmt.max / max|x| of this very tensor."""

  fmt: Format = static_field(E4M3)

  def __post_init__(self):
    object.__setattr__(self, "fmt", formats.get_format(self.fmt))

  # Its amax is a pass of its own over x: a caller that quantizes the same x again (a kernel, once per
  # micro-batch) takes it once and hands it in (`amax`).
  reads_tensor_amax = True

  def quantize(self, x, axis=-1, *, rng=None, reduce_axes=(), stats=False, amax=None):
    del rng  # Round to nearest.
    # Named `remat.TENSOR_AMAX`, which every policy keeps: the scale needs it before the cast, so a recompute
    # would pass over x twice (its amax, then the cast) where the saved scalar leaves it one.
    amax = checkpoint_name(tensor_amax(x, reduce_axes) if amax is None else amax, TENSOR_AMAX)
    scale_inv = per_tensor_scale_inv(self.fmt.max, amax)
    return _per_tensor(x, axis, self.fmt, scale_inv, amax, "fp8_current", stats=stats, reduce_axes=reduce_axes)


def update_history(history: jax.Array, amax: jax.Array) -> jax.Array:
  """Rolls `amax` in at index 0 and drops the oldest (last) entry."""
  amax = jnp.asarray(amax, history.dtype).reshape(1)
  return jnp.concatenate([amax, history[:-1]])


AMAX_ALGOS = ("max", "most_recent")  # How delayed scaling reads its history (DelayedScaling's doc).


def check_amax_algo(algo: str) -> None:
  if algo not in AMAX_ALGOS:
    raise ValueError(f"amax_compute_algo must be one of {', '.join(AMAX_ALGOS)}, got {algo!r}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DelayedScaling:
  """Per-tensor delayed scaling from the amaxes of earlier steps.

  scale = (fmt.max / ref) / 2**margin with ref = max(amax_history)
  ("max") or amax_history[0] ("most_recent"). The current amax is returned on
  the QuantizedTensor; the caller rolls it in with `update` (or
  `update_history`) and carries the new quantizer to the next step. Values
  past the stale amax saturate. A zero history (the start) gives scale 1.0.
  A non-finite amax never enters the history: the step that measures one is
  skipped (trainer/step.py's `unless_non_finite` checks the new histories).
  """

  amax_history: jax.Array
  fmt: Format = static_field(E4M3)
  margin: int = static_field(0)
  compute_algo: str = static_field("max")

  def __post_init__(self):
    object.__setattr__(self, "fmt", formats.get_format(self.fmt))
    check_amax_algo(self.compute_algo)

  @classmethod
  def create(cls, history_len=1024, fmt=E4M3, margin=0, compute_algo="max"):
    return cls(jnp.zeros((history_len,), jnp.float32), fmt, margin, compute_algo)

  @property
  def scale_inv(self) -> jax.Array:
    h = self.amax_history
    ref = jnp.max(h) if self.compute_algo == "max" else h[0]
    return per_tensor_scale_inv(self.fmt.max, ref, self.margin)

  reads_tensor_amax = True  # For the history (CurrentScaling's note).

  def quantize(self, x, axis=-1, *, rng=None, reduce_axes=(), stats=False, amax=None):
    del rng  # Round to nearest.
    amax = tensor_amax(x, reduce_axes) if amax is None else amax
    scale_inv = self.scale_inv
    # amax over the amax the scale was made for (fmt.max x scale_inv, margin undone).
    staleness = amax / (scale_inv * jnp.float32(self.fmt.max) / jnp.float32(2.0**self.margin))
    return _per_tensor(x, axis, self.fmt, scale_inv, amax, "fp8_delayed", stats=stats, staleness=staleness,
                       reduce_axes=reduce_axes)

  def update(self, amax: jax.Array) -> "DelayedScaling":
    return dataclasses.replace(
        self, amax_history=update_history(self.amax_history, amax))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MXFP8Scaling:
  """MXFP8: E4M3 data, one E8M0 power-of-two scale per `block` along `axis`.

  scale = 2**k with k the smallest integer such that block_amax / 2**k <= 448
  (= ceil(log2(block_amax / 448)) over the reals), found exactly from the
  frexp exponent of block_amax, never with a float log2. An all-zero block
  gets 2**-127; a non-finite block amax gets 1.0. data = cast(x * 2**-k),
  which equals x / 2**k exactly. `axis` must be a multiple of `block` long.
  """

  block: int = static_field(32)
  reads_tensor_amax = False  # Its block amaxes come from the pass that casts.

  def quantize(self, x, axis=-1, *, rng=None, reduce_axes=(), stats=False, amax=None):
    del rng, amax
    x32 = x.astype(jnp.float32)
    axis = normalize_axis(axis, x.ndim)
    axes, block = (axis,), (self.block,)
    amax_B = block_amax(x, axes, block)
    # E4M3 max = 448 = 0.875 * 2**9, amax = m * 2**e, m in [0.5, 1):
    # amax / 2**k <= 448  <=>  k >= e - 9 + (m > 0.875).
    max_m, max_e = np.frexp(E4M3.max)
    m, e = jnp.frexp(amax_B)
    k = e - int(max_e) + (m > max_m).astype(jnp.int32)
    k = jnp.where(amax_B == 0, -127, k)
    k = jnp.where(jnp.isfinite(amax_B), jnp.clip(k, -127, 127), 0)
    # -k <= 127 and k <= 120 for finite float32 amax, so 2**-k is normal.
    inv_pow2 = block_broadcast(formats.pow2(-k), x.shape, axes, block)
    amax = _reduce(jnp.max(amax_B), reduce_axes)
    scaled = x32 * inv_pow2
    data = formats.cast(scaled, E4M3)
    one = jnp.float32(1.0)
    return QuantizedTensor(
        data=data,
        scale_inv=formats.e8m0_from_exponent(k),
        global_scale_inv=one,
        amax=amax,
        recipe="mxfp8",
        axis=axis,
        block=block,
        dtype=jnp.dtype(x.dtype).name,
        health=health.measure(x32, scaled, data, E4M3.max, amax, one, one, reduce_axes) if stats else None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NVFP4Scaling:
  """NVFP4: E2M1 data, E4M3 block scales, a float32 per-tensor scale.

  In float32, in this order:
    global_scale = (6 * 448) / global_amax        (1.0 if amax 0, NaN if non-finite)
    block_scale  = cast_e4m3((block_amax / 6) * global_scale)   # RNE, saturating
    data         = e2m1((x * global_scale) / block_scale)  (0 where block_scale == 0)
    global_scale_inv = 1 / global_scale
    dequantized  = (data * block_scale) * global_scale_inv
  Blocks are 1x16 along `axis`, or with `tile_2d` 16x16 tiles over the last
  two dims, so one quantized weight serves both W and W.T GEMMs. With
  `stochastic_rounding` and an `rng` key the E2M1 cast is stochastic
  (`formats.stochastic_cast`); without a key it rounds to nearest even.
  A NaN in a block makes its E4M3 block scale NaN: the whole block
  dequantizes to NaN (E2M1 itself cannot hold NaN; its data there is 0).
  """

  tile_2d: bool = static_field(False)
  stochastic_rounding: bool = static_field(False)
  block: int = static_field(16)
  reads_tensor_amax = False  # Its tensor amax is the max of its block amaxes, from the pass that casts.

  def quantize(self, x, axis=-1, *, rng=None, reduce_axes=(), stats=False, amax=None):
    del amax
    x32 = x.astype(jnp.float32)
    axis = normalize_axis(axis, x.ndim)
    block = (self.block,) * (2 if self.tile_2d else 1)
    axes = block_axes(x.ndim, axis, block)
    amax_B = block_amax(x, axes, block)
    amax = _reduce(jnp.max(amax_B), reduce_axes)  # One pass over x for both.
    global_scale = scale_from_amax(6.0 * E4M3.max, amax)
    scale_B = formats.cast((amax_B / 6.0) * global_scale, E4M3)
    scale = block_broadcast(scale_B.astype(jnp.float32), x.shape, axes, block)
    y = jnp.where(scale == 0, 0.0, (x32 * global_scale) / scale)
    if self.stochastic_rounding and rng is not None:
      data = formats.stochastic_cast(y, E2M1, rng)
    else:
      data = formats.cast(y, E2M1)
    return QuantizedTensor(
        data=data,
        scale_inv=scale_B,
        global_scale_inv=jnp.float32(1.0) / global_scale,
        amax=amax,
        recipe="nvfp4",
        axis=axis,
        block=block,
        dtype=jnp.dtype(x.dtype).name,
        health=health.measure(x32, y, data, E2M1.max, amax, global_scale, jnp.float32(1.0),
                              reduce_axes) if stats else None)


Quantizer = Union[CurrentScaling, DelayedScaling, MXFP8Scaling, NVFP4Scaling]
