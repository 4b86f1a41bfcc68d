"""The grouped quantized matmul of mixture-of-experts layers: y = x @ w[expert of row].

Rows of x[M, K] are sorted by expert; `group_sizes[E]` says how many consecutive rows each expert
owns (empty experts allowed; rows past the last group are ignored and give zero rows). The three
GEMMs are `jax.lax.ragged_dot(_general)` calls:
  forward  y[M, N]     = ragged x[M, K] @ w[E, K, N]            (ragged rows),
  dgrad    dx[M, K]    = ragged g[M, N] @ w[E, N, K]            (the transposed kernels),
  wgrad    dw[E, K, N] = x[M, K].T @ g[M, N], contracting each group's rows separately.
The quantized GEMM, its operands, names and custom VJP are quant/core.py's; `RaggedLayout` says how this
layout differs from a dense projection's:
  * kernels are quantized per expert (a vmap of the quantizer): per-expert amaxes (per-tensor
    recipes, NVFP4's global scale) and per-expert block scales (`ExpertLayout`, shared with the capacity
    layout of quant/batched.py), possibly on this device's shard of them (`Shards`);
  * activations and gradients keep one per-tensor amax for all rows, reduced over `reduce_axes` (the
    mesh axes their rows are sharded over inside `shard_map`), so every shard uses one scale;
  * the wgrad operands of block-scaled recipes (`x_t`, and the gradient along M) are quantized along
    the rows in a layout whose groups start at multiples of the block (zero rows in between), so a
    block never spans two experts; NVFP4's 16-row Hadamard transform then stays inside a group too.
On CPU the GEMMs run on dequantized values: numerics identical to a loop over experts of dense GEMMs on
the same quantized operands.

Inside `shard_map` the rows vary over the token shards while a kernel may be replicated over some
of them: the backward rule sums its wgrad over those axes (`varying.sum_to`), as shard_map's transpose of
the implicit broadcast would, since a custom VJP must return a cotangent of its primal's type.

Delayed scaling: `history = (x [H], kernel [E, H], grad [H])`, the three row groups of the layer's
[E + 2, H] QuantState (quant/core.py). They are separate arrays so that under expert parallelism the
per-expert rows can be sharded over the expert axis and the others replicated.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from ember.names import EXPERT_GEMM_SCOPE
from ember.quant.core import quantized_gemm
from ember.quant.gemm import output_dtype
from ember.quant.recipe import WEIGHT, Recipe, pad_to
from ember.quant.tensor import QuantizedTensor
from ember.quant.unquantized import unquantized_matmul


def grouped_matmul(x_MxK: jax.Array, w_ExKxN: jax.Array, group_sizes_E: jax.Array, *, recipe: Recipe, name: str,
                   history: tuple[jax.Array, jax.Array, jax.Array] | None = None, key: jax.Array | None = None,
                   dtype=jnp.bfloat16, reduce_axes: tuple[str, ...] = (),
                   stats: tuple[jax.Array, jax.Array, jax.Array] | None = None,
                   kernel_shards: Shards = None, error: jax.Array | None = None) -> jax.Array:
  """Rows of x (sorted by expert, `group_sizes_E` each) times their expert's kernel, in `recipe`'s
  format. `name` is the projection (names the residuals); `history` the delayed-scaling histories
  (fp8_delayed only); `key` seeds stochastic rounding of gradients (nvfp4); `reduce_axes` the mesh
  axes the rows are sharded over (inside shard_map), for the per-tensor amaxes. `stats`: inputs
  (x [S], kernels [E, S], grad [S]) whose "gradient" is the operands' health (quant/health.py), or None.
  `kernel_shards`: `w_ExKxN` is this device's shard of the kernel (see `Shards`); it is quantized on the
  shard and gathered in the recipe's format, and its gradient is reduce-scattered back. `error`: a [2] input
  whose "gradient" is the forward output's error (quant/core.py), or None."""
  with jax.named_scope(EXPERT_GEMM_SCOPE):
    return _grouped_matmul(x_MxK, w_ExKxN, group_sizes_E, recipe=recipe, name=name, history=history, key=key,
                           dtype=dtype, reduce_axes=reduce_axes, stats=stats, kernel_shards=kernel_shards,
                           error=error)


def _grouped_matmul(x_MxK, w_ExKxN, group_sizes_E, *, recipe, name, history, key, dtype, reduce_axes, stats,
                    kernel_shards, error):
  dtype = jnp.dtype(dtype)
  group_sizes_E = group_sizes_E.astype(jnp.int32)
  if not recipe.quantized:
    assert kernel_shards is None, "an unquantized kernel is gathered whole before the GEMM"
    return unquantized_matmul(_contract, x_MxK, w_ExKxN.astype(dtype), group_sizes_E, dtype=dtype,
                              wgrad_dtype=recipe.wgrad_out(w_ExKxN.dtype))
  layout = RaggedLayout(reduce_axes=tuple(reduce_axes), shards=kernel_shards)
  return quantized_gemm(x_MxK, w_ExKxN, group_sizes_E, history, key, stats, layout=layout, recipe=recipe, name=name,
                        dtype=dtype, error=error)


# dw[e] = x[rows of e].T @ g[rows of e]: the ragged dimension (rows) is contracted.
_WGRAD_DIMS = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])),
                                                lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


def _contract(a, b, group_sizes_E, step, preferred):
  """The grouped layout's three GEMMs (quant/unquantized.py): ragged rows forward and dgrad (the kernels
  transposed), each group's rows contracted in wgrad."""
  if step == "wgrad":
    return jax.lax.ragged_dot_general(a, b, group_sizes_E, _WGRAD_DIMS, preferred_element_type=preferred)
  return jax.lax.ragged_dot(a, b if step == "forward" else jnp.swapaxes(b, 1, 2), group_sizes_E,
                            preferred_element_type=preferred)


def quantize_per_expert(recipe: Recipe, w_ExKxN, h_ExH, axis, stats: bool = False, shards: "Shards" = None):
  """Each expert's kernel quantized on its own (per-expert amax and scales, per-expert histories);
  leaves gain a leading E. With `shards`, `w_ExKxN` is this device's shard of the kernel and the amaxes
  (and statistics) are reduced over the shard axes: every shard quantizes with the whole kernel's scales."""
  axes = () if shards is None else shards[1]
  return jax.vmap(lambda w, h: recipe.quantizer(WEIGHT, h).quantize(w, axis=axis, stats=stats, reduce_axes=axes))(
      w_ExKxN, h_ExH)


# A kernel sharded inside shard_map: (its sharded dim of [E, K, N], the mesh axes over which), or None (whole).
Shards = tuple[int, tuple[str, ...]] | None


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
  """What the expert layouts share (quant/core.py's `Layout`): kernels [E, K, N] quantized per expert, possibly
  on this device's shard (`shards`): quantized there with the whole kernel's scales (amaxes reduced over the
  shard axes), all-gathered in the recipe's format where a GEMM reads them, their gradient reduce-scattered
  back. The shard must hold whole blocks along its dim (layers/moe.py shards only kernels that do)."""
  reduce_axes: tuple[str, ...] = ()
  shards: Shards = None
  per_expert = True
  transposed = False  # Wgrad copies stay in the layout they are quantized in.

  def wgrad_copy(self, q):
    return q

  def pad_kernel(self, w, block):
    return pad_to(w, (1, block, block))

  def quantize_kernel(self, recipe: Recipe, w, history, axis, stats, amax=None):
    del amax  # Per expert, on its shard: not taken ahead.
    return quantize_per_expert(recipe, w, history, axis, stats, self.shards)

  def whole(self, a):
    """A kernel shard, quantized (data and block scales gathered; per-expert scalars are whole already) or
    not, made whole."""
    if self.shards is None:
      return a
    dim, axes = self.shards
    gather = lambda t: jax.lax.all_gather(t, axes, axis=dim, tiled=True)
    if not isinstance(a, QuantizedTensor):
      return gather(a)
    return dataclasses.replace(a, data=gather(a.data),
                               scale_inv=gather(a.scale_inv) if a.scale_inv.ndim == a.data.ndim else a.scale_inv)

  def kernel_gradient(self, dw_ExKxN):
    """The whole kernel's wgrad summed over the shard axes and cut to this device's shard."""
    if self.shards is None:
      return dw_ExKxN
    dim, axes = self.shards
    return jax.lax.psum_scatter(dw_ExKxN, axes, scatter_dimension=dim, tiled=True)

  def whole_kernel_shape(self, w_ExKxN) -> tuple[int, int, int]:
    shape = list(w_ExKxN.shape)
    if self.shards is not None:
      shape[self.shards[0]] *= math.prod(jax.lax.axis_size(a) for a in self.shards[1])
    return tuple(shape)


def dequantize_experts(q, dtype):
  """A per-expert quantized kernel (or a compute-dtype kernel) as `dtype` values."""
  if not isinstance(q, QuantizedTensor):
    return q.astype(dtype)
  return q.dequantize(dtype) if q.data.ndim == 2 else jax.vmap(lambda t: t.dequantize(dtype))(q)


def group_ids(group_sizes_E: jax.Array, m: int) -> jax.Array:
  """The expert of each of `m` sorted rows; E for rows past the last group."""
  return jnp.searchsorted(jnp.cumsum(group_sizes_E), jnp.arange(m, dtype=jnp.int32), side="right")


def _mask_rows(a_MxK, group_sizes_E):
  """Zeros the rows past the last group (they would otherwise enter the per-tensor amax)."""
  live = jnp.arange(a_MxK.shape[0]) < jnp.sum(group_sizes_E)
  return jnp.where(live[:, None], a_MxK, jnp.zeros((), a_MxK.dtype))


def padded_sizes(group_sizes_E: jax.Array, block: int) -> jax.Array:
  """Each group's rows rounded up to a multiple of `block`: the groups of `block_layout`."""
  return -(-group_sizes_E // block) * block


def starts(sizes: jax.Array, axis: int = -1) -> jax.Array:
  """Where each group begins in rows sorted by group: the exclusive cumulative sum of the group sizes."""
  return jnp.cumsum(sizes, axis=axis) - sizes


def block_layout(group_sizes_E: jax.Array, m: int, block: int):
  """(destination row of each sorted row, padded group sizes, layout length) of the layout in which
  every group starts at a multiple of `block` (rows past the last group go nowhere)."""
  e = group_sizes_E.shape[0]
  length = -(-(m + e * (block - 1)) // block) * block
  padded_E = padded_sizes(group_sizes_E, block)
  starts_E, padded_starts_E = starts(group_sizes_E), starts(padded_E)
  gid = group_ids(group_sizes_E, m)
  g = jnp.minimum(gid, e - 1)
  dest = jnp.where(gid < e, padded_starts_E[g] + jnp.arange(m) - starts_E[g], length)
  return dest, padded_E, length


def _to_layout(a_MxK, layout):
  dest, _, length = layout
  return jnp.zeros((length, a_MxK.shape[1]), a_MxK.dtype).at[dest].set(a_MxK, mode="drop")


@dataclasses.dataclass(frozen=True)
class RaggedLayout(ExpertLayout):
  """Rows sorted by expert, `rows` = the group sizes (see the module doc)."""
  x_axis = 1
  row_axis = 0

  def prepare(self, a_MxK, group_sizes_E, block):
    return pad_to(_mask_rows(a_MxK, group_sizes_E), (1, block))

  def wgrad_rows(self, a_MxK, group_sizes_E, block):
    return _to_layout(a_MxK, block_layout(group_sizes_E, a_MxK.shape[0], block))

  def forward(self, x, w, group_sizes_E, dtype):
    x = x.dequantize(dtype) if isinstance(x, QuantizedTensor) else x.astype(dtype)
    return jax.lax.ragged_dot(x, dequantize_experts(w, dtype), group_sizes_E,
                              preferred_element_type=output_dtype(dtype)).astype(dtype)

  def dgrad(self, g, w, group_sizes_E, dtype, out):
    w_ExNxK = jnp.swapaxes(dequantize_experts(w, dtype), 1, 2)
    return jax.lax.ragged_dot(g.dequantize(dtype), w_ExNxK, group_sizes_E,
                              preferred_element_type=output_dtype(out)).astype(out)

  def wgrad(self, x, g, group_sizes_E, block, dtype, out):
    sizes = group_sizes_E if block is None else padded_sizes(group_sizes_E, block)
    return jax.lax.ragged_dot_general(x.dequantize(dtype), g.dequantize(dtype), sizes, _WGRAD_DIMS,
                                      preferred_element_type=output_dtype(out)).astype(out)
