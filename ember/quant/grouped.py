"""The grouped quantized matmul of mixture-of-experts layers: y = x @ w[expert of row], custom VJP.

Rows of x[M, K] are sorted by expert; `group_sizes[E]` says how many consecutive rows each expert
owns (empty experts allowed; rows past the last group are ignored and give zero rows). The three
GEMMs are `jax.lax.ragged_dot(_general)` calls:
  forward  y[M, N]     = ragged x[M, K] @ w[E, K, N]            (ragged rows),
  dgrad    dx[M, K]    = ragged g[M, N] @ w[E, N, K]            (the transposed kernels),
  wgrad    dw[E, K, N] = x[M, K].T @ g[M, N], contracting each group's rows separately.
The structure mirrors quant/dot.py: the same quantizers, operands, names and padding, with these
differences:
  * kernels are quantized per expert (a vmap of the quantizer): per-expert amaxes (per-tensor
    recipes, NVFP4's global scale) and per-expert block scales;
  * activations and gradients keep one per-tensor amax for all rows, reduced over `reduce_axes` (the
    mesh axes their rows are sharded over inside `shard_map`), so every shard uses one scale;
  * the wgrad operands of block-scaled recipes (`x_t`, and the gradient along M) are quantized along
    the rows in a layout whose groups start at multiples of the block (zero rows in between), so a
    block never spans two experts; NVFP4's 16-row Hadamard transform then stays inside a group too.
Every quantized operand is named `quantized.<projection>.<operand>` in the primal function and in
the forward rule alike (both run `_quantize_operands`), so `save_quantized` recomputes no quantize op
in an MoE layer. On CPU the GEMMs run on dequantized values: numerics identical to a loop over
experts of dense GEMMs on the same quantized operands.

Inside `shard_map` the rows vary over the token shards while a kernel may be replicated over some
of them: the backward rule sums its wgrad over those axes (`varying.sum_to`), as shard_map's transpose of
the implicit broadcast would, since a custom VJP must return a cotangent of its primal's type.

Delayed scaling: `history = (x [H], kernel [E, H], grad [H])`, the three row groups of the layer's
[E + 2, H] QuantState; the backward rule returns them with this step's amaxes rolled in as their
cotangent (the dense convention). They are separate arrays so that under expert parallelism the
per-expert rows can be sharded over the expert axis and the others replicated.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from ember.names import EXPERT_GEMM_SCOPE
from ember.quant.varying import sum_to, vma_of
from ember.quant.dot import SCOPE_ACTIVATION, SCOPE_GRADIENT, SCOPE_WEIGHT
from ember.quant.gemm import output_dtype
from ember.quant.naming import name_quantized
from ember.quant.quantizers import update_history
from ember.quant.recipe import ACTIVATION, GRADIENT, KERNEL, KERNEL_T, WEIGHT, X, X_T, Recipe, pad_to
from ember.remat import quantized_name


def grouped_matmul(x_MxK: jax.Array, w_ExKxN: jax.Array, group_sizes_E: jax.Array, *, recipe: Recipe, name: str,
                   history: tuple[jax.Array, jax.Array, jax.Array] | None = None, key: jax.Array | None = None,
                   dtype=jnp.bfloat16, reduce_axes: tuple[str, ...] = (),
                   stats: tuple[jax.Array, jax.Array, jax.Array] | None = None,
                   kernel_shards: Shards = None) -> jax.Array:
  """Rows of x (sorted by expert, `group_sizes_E` each) times their expert's kernel, in `recipe`'s
  format. `name` is the projection (names the residuals); `history` the delayed-scaling histories
  (fp8_delayed only); `key` seeds stochastic rounding of gradients (nvfp4); `reduce_axes` the mesh
  axes the rows are sharded over (inside shard_map), for the per-tensor amaxes. `stats`: inputs
  (x [S], kernels [E, S], grad [S]) whose "gradient" is the operands' health (quant/health.py), or None.
  `kernel_shards`: `w_ExKxN` is this device's shard of the kernel (see `Shards`); it is quantized on the
  shard and gathered in the recipe's format, and its gradient is reduce-scattered back."""
  with jax.named_scope(EXPERT_GEMM_SCOPE):
    return _grouped_matmul(x_MxK, w_ExKxN, group_sizes_E, recipe=recipe, name=name, history=history, key=key,
                           dtype=dtype, reduce_axes=reduce_axes, stats=stats, kernel_shards=kernel_shards)


def _grouped_matmul(x_MxK, w_ExKxN, group_sizes_E, *, recipe, name, history, key, dtype, reduce_axes, stats,
                    kernel_shards):
  dtype = jnp.dtype(dtype)
  group_sizes_E = group_sizes_E.astype(jnp.int32)
  if not recipe.quantized:
    assert kernel_shards is None, "an unquantized kernel is gathered whole before the GEMM"
    return _unquantized(x_MxK.astype(dtype), w_ExKxN.astype(dtype), group_sizes_E, (vma_of(x_MxK), vma_of(w_ExKxN)))
  if history is None:  # Unused outside fp8_delayed; keeps one signature.
    history = (jnp.zeros((1,), jnp.float32), jnp.zeros((w_ExKxN.shape[0], 1), jnp.float32),
               jnp.zeros((1,), jnp.float32))
  operand_info = (x_MxK.shape[1], jnp.dtype(x_MxK.dtype), jnp.dtype(w_ExKxN.dtype), vma_of(x_MxK), vma_of(w_ExKxN))
  return _gmm(x_MxK, w_ExKxN, group_sizes_E, tuple(history), key, None if stats is None else tuple(stats), recipe,
              name, dtype, tuple(reduce_axes), operand_info, kernel_shards)


# dw[e] = x[rows of e].T @ g[rows of e]: the ragged dimension (rows) is contracted.
_WGRAD_DIMS = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])),
                                                lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _unquantized(x_MxK, w_ExKxN, group_sizes_E, vmas):
  """The grouped GEMM in the compute dtype, f32 accumulation, rounded to it. As `dot._unquantized`, the
  custom VJP keeps dgrad and wgrad on compute-dtype operands (autodiff would pair the f32 cotangent with
  them and run f32 GEMMs); the cotangent of a compute-dtype output is exact in it."""
  out = output_dtype(x_MxK.dtype)  # The GEMM writes the compute dtype on GPUs (quant/gemm.py).
  return jax.lax.ragged_dot(x_MxK, w_ExKxN, group_sizes_E, preferred_element_type=out).astype(x_MxK.dtype)


def _unquantized_fwd(x_MxK, w_ExKxN, group_sizes_E, vmas):
  return _unquantized(x_MxK, w_ExKxN, group_sizes_E, vmas), (x_MxK, w_ExKxN, group_sizes_E)


def _unquantized_bwd(vmas, res, g_MxN):
  x_MxK, w_ExKxN, group_sizes_E = res
  g_MxN = g_MxN.astype(x_MxK.dtype)
  dx = jax.lax.ragged_dot(g_MxN, jnp.swapaxes(w_ExKxN, 1, 2), group_sizes_E,
                          preferred_element_type=output_dtype(x_MxK.dtype))
  dw = jax.lax.ragged_dot_general(x_MxK, g_MxN, group_sizes_E, _WGRAD_DIMS, preferred_element_type=jnp.float32)
  x_vma, w_vma = vmas
  return sum_to(dx, x_vma).astype(x_MxK.dtype), sum_to(dw, w_vma).astype(w_ExKxN.dtype), None


_unquantized.defvjp(_unquantized_fwd, _unquantized_bwd)


def per_expert(recipe: Recipe, w_ExKxN, h_ExH, axis, stats: bool = False, shards: "Shards" = None):
  """Each expert's kernel quantized on its own (per-expert amax and scales, per-expert histories);
  leaves gain a leading E. With `shards`, `w_ExKxN` is this device's shard of the kernel and the amaxes
  (and statistics) are reduced over the shard axes: every shard quantizes with the whole kernel's scales."""
  axes = () if shards is None else shards[1]
  return jax.vmap(lambda w, h: recipe.quantizer(WEIGHT, h).quantize(w, axis=axis, stats=stats, reduce_axes=axes))(
      w_ExKxN, h_ExH)


# A kernel sharded inside shard_map: (its sharded dim of [E, K, N], the mesh axes over which), or None (whole).
Shards = tuple[int, tuple[str, ...]] | None


def gathered(q, shards: Shards):
  """A per-expert kernel quantized on its shard (`per_expert`), made whole in the recipe's format: the data
  and the block scales all-gathered along the sharded dim. Per-expert scalars are whole already. The shard
  must hold whole blocks along that dim (moe.py shards only kernels that do)."""
  if shards is None:
    return q
  dim, axes = shards
  gather = lambda a: whole(a, shards) if a.ndim == q.data.ndim else a
  return dataclasses.replace(q, data=gather(q.data), scale_inv=gather(q.scale_inv))


def whole(a_ExKxN, shards: Shards):
  """An array laid out as the kernel, all-gathered along its sharded dim."""
  return a_ExKxN if shards is None else jax.lax.all_gather(a_ExKxN, shards[1], axis=shards[0], tiled=True)


def scattered(dw_ExKxN, shards: Shards):
  """The wgrad of a sharded kernel: summed over the shard axes and cut to this device's shard (the transpose
  of `gathered`)."""
  if shards is None:
    return dw_ExKxN
  dim, axes = shards
  return jax.lax.psum_scatter(dw_ExKxN, axes, scatter_dimension=dim, tiled=True)


def whole_shape(w_ExKxN, shards: Shards) -> tuple[int, int, int]:
  """The kernel's [E, K, N] shape when gathered."""
  shape = list(w_ExKxN.shape)
  if shards is not None:
    shape[shards[0]] *= math.prod(jax.lax.axis_size(a) for a in shards[1])
  return tuple(shape)


def dequantize_experts(q, dtype):
  return q.dequantize(dtype) if q.data.ndim == 2 else jax.vmap(lambda t: t.dequantize(dtype))(q)


def group_ids(group_sizes_E: jax.Array, m: int) -> jax.Array:
  """The expert of each of `m` sorted rows; E for rows past the last group."""
  return jnp.searchsorted(jnp.cumsum(group_sizes_E), jnp.arange(m, dtype=jnp.int32), side="right")


def _mask_rows(a_MxK, group_sizes_E):
  """Zeros the rows past the last group (they would otherwise enter the per-tensor amax)."""
  live = jnp.arange(a_MxK.shape[0]) < jnp.sum(group_sizes_E)
  return jnp.where(live[:, None], a_MxK, jnp.zeros((), a_MxK.dtype))


def block_layout(group_sizes_E: jax.Array, m: int, block: int):
  """(destination row of each sorted row, padded group sizes, layout length) of the layout in which
  every group starts at a multiple of `block` (rows past the last group go nowhere)."""
  e = group_sizes_E.shape[0]
  length = -(-(m + e * (block - 1)) // block) * block
  padded_E = -(-group_sizes_E // block) * block
  starts_E = jnp.cumsum(group_sizes_E) - group_sizes_E
  padded_starts_E = jnp.cumsum(padded_E) - padded_E
  gid = group_ids(group_sizes_E, m)
  g = jnp.minimum(gid, e - 1)
  dest = jnp.where(gid < e, padded_starts_E[g] + jnp.arange(m) - starts_E[g], length)
  return dest, padded_E, length


def _to_layout(a_MxK, layout):
  dest, _, length = layout
  return jnp.zeros((length, a_MxK.shape[1]), a_MxK.dtype).at[dest].set(a_MxK, mode="drop")


def _quantize_operands(x, w, group_sizes, history, recipe: Recipe, name: str, reduce_axes, stats: bool = False,
                       shards: Shards = None):
  """Quantizes every operand copy the recipe's GEMMs read, each named for remat (as quant/dot.py). A sharded
  kernel's copies are its shard's: what remat saves is the shard, gathered again where a GEMM reads it."""
  h_x, h_k, _ = history
  act = recipe.quantizer(ACTIVATION, h_x)
  q = {}
  with jax.named_scope(SCOPE_ACTIVATION):
    q[X] = act.quantize(x, axis=1, reduce_axes=reduce_axes, stats=stats)
    if recipe.has_x_t:
      x_layout = _to_layout(x, block_layout(group_sizes, x.shape[0], recipe.block_size))
      q[X_T] = act.quantize(recipe.wgrad_transform(x_layout, 0), axis=0, reduce_axes=reduce_axes)
  with jax.named_scope(SCOPE_WEIGHT):
    q[KERNEL] = per_expert(recipe, w, h_k, axis=0, stats=stats, shards=shards)
    if recipe.has_kernel_t:
      q[KERNEL_T] = per_expert(recipe, w, h_k, axis=1, shards=shards)
  return {k: name_quantized(v, quantized_name(name, k)) for k, v in q.items()}


def _forward(x, w, group_sizes, history, recipe, name, dtype, reduce_axes, stats=False, shards: Shards = None):
  n, b = whole_shape(w, shards)[2], recipe.block_size
  xp, wp = pad_to(_mask_rows(x, group_sizes), (1, b)), pad_to(w, (1, b, b))
  q = _quantize_operands(xp, wp, group_sizes, history, recipe, name, reduce_axes, stats, shards)
  if recipe.forward_quantized:
    y = jax.lax.ragged_dot(q[X].dequantize(dtype), dequantize_experts(gathered(q[KERNEL], shards), dtype),
                           group_sizes, preferred_element_type=jnp.float32)
  else:  # quant.forward = "bf16": only the backward GEMMs read the quantized copies.
    y = jax.lax.ragged_dot(xp.astype(dtype), whole(wp.astype(dtype), shards), group_sizes,
                           preferred_element_type=jnp.float32)
  return y[:, :n].astype(dtype), q


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10, 11))
def _gmm(x, w, group_sizes, history, key, stats, recipe, name, dtype, reduce_axes, operand_info, shards):
  return _forward(x, w, group_sizes, history, recipe, name, dtype, reduce_axes, shards=shards)[0]


def _gmm_fwd(x, w, group_sizes, history, key, stats, recipe, name, dtype, reduce_axes, operand_info, shards):
  y, q = _forward(x, w, group_sizes, history, recipe, name, dtype, reduce_axes, stats is not None, shards)
  return y, (q, group_sizes, history, key)


def _gmm_bwd(recipe, name, dtype, reduce_axes, operand_info, shards, res, g_MxN):
  q, group_sizes, history, key = res
  with_stats = q[X].health is not None
  (m, n), (k, x_dtype, w_dtype, x_vma, w_vma) = g_MxN.shape, operand_info
  b = recipe.block_size
  g = pad_to(_mask_rows(g_MxN, group_sizes), (1, b))
  grad_q = recipe.quantizer(GRADIENT, history[2])
  key_dgrad = key_wgrad = None
  if key is not None:
    key_dgrad, key_wgrad = jax.random.split(key)
  # dgrad: contract N with each expert's kernel copy quantized along N (per-tensor, 2D tiles: the same).
  with jax.named_scope(SCOPE_GRADIENT):
    g_rows = grad_q.quantize(g, axis=1, rng=key_dgrad, reduce_axes=reduce_axes, stats=with_stats)
  kernel_n = dequantize_experts(gathered(q.get(KERNEL_T, q[KERNEL]), shards), dtype)
  dx = jax.lax.ragged_dot(g_rows.dequantize(dtype), jnp.swapaxes(kernel_n, 1, 2), group_sizes,
                          preferred_element_type=jnp.float32)
  # wgrad: contract each group's rows. Per-tensor recipes reuse the forward copies; block recipes
  # quantize along the rows in the block-aligned layout (NVFP4 after the Hadamard transform).
  if not recipe.has_x_t:
    g_cols, x_m, sizes = g_rows, q[X], group_sizes
  else:
    layout = block_layout(group_sizes, m, b)
    with jax.named_scope(SCOPE_GRADIENT):
      g_cols = grad_q.quantize(recipe.wgrad_transform(_to_layout(g, layout), 0), axis=0, rng=key_wgrad,
                               reduce_axes=reduce_axes)
    x_m, sizes = q[X_T], layout[1]
  dw = jax.lax.ragged_dot_general(x_m.dequantize(dtype), g_cols.dequantize(dtype), sizes, _WGRAD_DIMS,
                                  preferred_element_type=jnp.float32)
  h_x, h_k, h_g = history
  if recipe.delayed:
    new_history = (update_history(h_x, q[X].amax), jax.vmap(update_history)(h_k, q[KERNEL].amax),
                   update_history(h_g, g_rows.amax))
  else:
    new_history = jax.tree.map(jnp.zeros_like, history)
  dx, dw = sum_to(dx[:, :k], x_vma).astype(x_dtype), sum_to(scattered(dw[:, :k, :n], shards), w_vma).astype(w_dtype)
  health = (q[X].health, q[KERNEL].health, g_rows.health) if with_stats else None
  return dx, dw, None, new_history, None, health


_gmm.defvjp(_gmm_fwd, _gmm_bwd)
