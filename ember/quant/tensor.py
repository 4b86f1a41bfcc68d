"""QuantizedTensor: low-precision data plus the scales that undo it.

One pytree type serves every recipe so that custom VJPs, remat names and
checkpoints treat all of them alike. Its leaves are always the same four
arrays (`data`, `scale_inv`, `global_scale_inv`, `amax`), plus a `health`
vector when the quantizer was asked for statistics, so the tree structure
depends only on the static fields and that request, never on values.

`scale_inv` is always the factor that *multiplies* `data` on the way back:
  per-tensor (fp8_current, fp8_delayed): float32 scalar, a bfloat16 value; scale = 1 / scale_inv.
  mxfp8: one E8M0 power of two per block of 32 along `axis`.
  nvfp4: one E4M3 block scale per 1x16 block along `axis`, or per 16x16 tile
    over the last two dims (`block == (16, 16)`); `global_scale_inv` holds the
    float32 per-tensor factor.
Block scales have the data's shape with each blocked dim divided by its block.

Pytree registration uses `jax.tree_util.register_dataclass` with static
fields marked once in `dataclasses.field` metadata; nothing is flattened by
hand. All four dtypes (E4M3, E5M2, E2M1, E8M0) save and restore with Orbax
as they are, so no storage view is needed.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp


def static_field(default=dataclasses.MISSING):
  """A dataclass field that is pytree metadata (part of the treedef)."""
  return dataclasses.field(default=default, metadata=dict(static=True))


def normalize_axis(axis: int, ndim: int) -> int:
  if not -ndim <= axis < ndim:
    raise ValueError(f"axis {axis} is out of range for a {ndim}-d array")
  return axis % ndim


def block_axes(ndim: int, axis: int, block: tuple[int, ...]) -> tuple[int, ...]:
  """The dims a block layout runs along: `axis`, or the last two for tiles."""
  if len(block) == 2:
    if ndim < 2:
      raise ValueError("16x16 tiles need an array of at least 2 dims")
    return (ndim - 2, ndim - 1)
  return (axis,) if block else ()


def _split_shape(shape, axes, block):
  """Each blocked dim n becomes (n // b, b); returns the shape and inner dims."""
  out, inner = [], []
  for d, n in enumerate(shape):
    if d in axes:
      b = block[axes.index(d)]
      if n % b:
        raise ValueError(
            f"dim {d} has length {n}, not a multiple of the block size {b}; "
            f"pad it to {-(-n // b) * b} before quantizing")
      out += [n // b, b]
      inner.append(len(out) - 1)
    else:
      out.append(n)
  return tuple(out), tuple(inner)


def block_reduce_max(x: jax.Array, axes, block) -> jax.Array:
  """max over each block: the blocked dims shrink by their block size."""
  split, inner = _split_shape(x.shape, axes, block)
  return jnp.max(x.reshape(split), axis=inner)


def block_broadcast(s: jax.Array, shape, axes, block) -> jax.Array:
  """Repeats one value per block back to the full `shape`."""
  split, inner = _split_shape(shape, axes, block)
  s = jnp.expand_dims(s, inner)
  return jnp.broadcast_to(s, split).reshape(shape)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedTensor:
  """Quantized data and scales; `dequantize` reproduces the recipe exactly.

  Attributes:
    data: low-precision values, same shape as the input.
    scale_inv: dequantization factor(s), see the module doc.
    global_scale_inv: float32 scalar; 1 / global_scale for nvfp4, 1.0 otherwise.
    amax: float32 scalar, max |x| of the input (after `reduce_axes`). Delayed
      scaling rolls it into its history; other recipes report it for metrics.
    recipe: "fp8_current" | "fp8_delayed" | "mxfp8" | "nvfp4".
    axis: the (non-negative) contraction axis the caller quantized along.
    block: () per-tensor, (32,) MX, (16,) NVFP4 1x16, (16, 16) NVFP4 tiles.
    dtype: name of the input dtype, the default of `dequantize`.
  """

  data: jax.Array
  scale_inv: jax.Array
  global_scale_inv: jax.Array
  amax: jax.Array
  recipe: str = static_field()
  axis: int = static_field()
  block: tuple[int, ...] = static_field()
  dtype: str = static_field()
  health: jax.Array | None = None  # quant/health.py's STATS vector, when quantized with stats=True.

  @property
  def shape(self) -> tuple[int, ...]:
    return self.data.shape

  @property
  def block_axes(self) -> tuple[int, ...]:
    return block_axes(self.data.ndim, self.axis, self.block)

  @property
  def nbytes(self) -> int:
    """Bytes of the format: packed data bits plus every scale.

    E2M1 counts 4 bits an element (as packed in a checkpoint or fed to a
    GEMM), although XLA holds one element per byte in memory. `amax` is a
    statistic, not needed to dequantize, and is not counted.
    """
    data_bits = self.data.size * jnp.finfo(self.data.dtype).bits
    scales = (self.scale_inv, self.global_scale_inv)
    return math.ceil(data_bits / 8) + sum(
        s.size * jnp.dtype(s.dtype).itemsize for s in scales)

  @property
  def T(self) -> "QuantizedTensor":
    """A 2-d tensor quantized in 1-d blocks, stored transposed: the same values, its blocks now along the other
    axis (a GEMM that contracts that axis reads it as it is)."""
    assert self.data.ndim == 2 and len(self.block) <= 1, (self.data.shape, self.block)
    scale = self.scale_inv.T if self.scale_inv.ndim == 2 else self.scale_inv
    return dataclasses.replace(self, data=self.data.T, scale_inv=scale, axis=1 - self.axis)

  def dequantize(self, dtype=None) -> jax.Array:
    """Back to `dtype` (default: the input's dtype).

    per-tensor: data.astype(dtype) * scale_inv.astype(dtype), the pattern
      XLA's GPU compiler turns into a scaled FP8 GEMM when it feeds a dot.
    blocked: in float32, (data * block_scale) * global_scale_inv, then cast
      to `dtype` (global_scale_inv is 1.0 for mxfp8, so that product is exact).
    """
    dtype = jnp.dtype(self.dtype if dtype is None else dtype)
    if not self.block:
      return self.data.astype(dtype) * self.scale_inv.astype(dtype)
    s = block_broadcast(self.scale_inv.astype(jnp.float32), self.data.shape,
                        self.block_axes, self.block)
    x = (self.data.astype(jnp.float32) * s) * self.global_scale_inv
    return x.astype(dtype)
