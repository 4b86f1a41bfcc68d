"""The expert GEMMs over the capacity layout: y[e] = x[e] @ w[e] for x [E, C, K] (each local expert's rows
in a slot of C, zero rows past its count) and w [E, K, N], as one batched `dot_general` each way, custom VJP:
  forward  y[E, C, N]  = x[E, C, K] . w[E, K, N]     (batch E, contract K),
  dgrad    dx[E, C, K] = g[E, C, N] . w[E, K, N]     (batch E, contract N),
  wgrad    dw[E, K, N] = x[E, C, K] . g[E, C, N]     (batch E, contract C).
Unlike `ragged_dot` (quant/grouped.py), which XLA's GPU compiler expands into a GEMM over every row for every
local expert, these are batched GEMMs whose work is E x C rows: the routed copies and the slots' slack.

Quantization is grouped.py's, operand for operand and name for name (`quantized.<projection>.<operand>`), so
`save_quantized` keeps the same residuals and recomputes no quantize op: kernels per expert (per-expert
amaxes and block scales), activations and gradients with one amax over all rows, reduced over
`reduce_axes`. Block-scaled wgrad operands are quantized along C, so a block never spans two experts.

Per-tensor recipes multiply their scales into the *output* (x's and g's scalar, each expert's kernel scale
along E) and feed the GEMM the raw E4M3 / E5M2 values: XLA's GPU compiler runs that as one batched
cuBLASLt FP8 GEMM, where scales inside the operands (a per-expert vector) would leave it a bf16 GEMM.
Block-scaled recipes take quant/gemm.py's path for the platform (cuDNN's block-scaled GEMM on Blackwell).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ember.names import EXPERT_GEMM_SCOPE
from ember.quant.dot import SCOPE_ACTIVATION, SCOPE_GRADIENT, SCOPE_WEIGHT
from ember.quant.gemm import block_scaled_dot, output_dtype
from ember.quant.varying import sum_to, vma_of
from ember.quant.grouped import Shards, gathered, per_expert, scattered, whole, whole_shape
from ember.quant.naming import name_quantized
from ember.quant.quantizers import update_history
from ember.quant.recipe import ACTIVATION, GRADIENT, KERNEL, KERNEL_T, X, X_T, Recipe, pad_to
from ember.remat import quantized_name

F32 = jnp.float32
FORWARD = (((2,), (1,)), ((0,), (0,)))
DGRAD = (((2,), (2,)), ((0,), (0,)))
WGRAD = (((1,), (1,)), ((0,), (0,)))


def batched_matmul(x_ExCxK: jax.Array, w_ExKxN: jax.Array, *, recipe: Recipe, name: str,
                   history: tuple[jax.Array, jax.Array, jax.Array] | None = None, key: jax.Array | None = None,
                   dtype=jnp.bfloat16, reduce_axes: tuple[str, ...] = (),
                   stats: tuple[jax.Array, jax.Array, jax.Array] | None = None,
                   kernel_shards: Shards = None) -> jax.Array:
  """Each expert's slot of rows times its kernel, in `recipe`'s format; the arguments are
  `grouped_matmul`'s (quant/grouped.py), with the rows in the capacity layout instead of sorted."""
  dtype = jnp.dtype(dtype)
  with jax.named_scope(EXPERT_GEMM_SCOPE):
    if not recipe.quantized:
      assert kernel_shards is None, "an unquantized kernel is gathered whole before the GEMM"
      return _unquantized(x_ExCxK.astype(dtype), w_ExKxN.astype(dtype), (vma_of(x_ExCxK), vma_of(w_ExKxN)))
    if history is None:  # Unused outside fp8_delayed; keeps one signature.
      history = (jnp.zeros((1,), F32), jnp.zeros((w_ExKxN.shape[0], 1), F32), jnp.zeros((1,), F32))
    operand_info = (x_ExCxK.shape[1:], jnp.dtype(x_ExCxK.dtype), jnp.dtype(w_ExKxN.dtype), vma_of(x_ExCxK),
                    vma_of(w_ExKxN))
    return _bmm(x_ExCxK, w_ExKxN, tuple(history), key, None if stats is None else tuple(stats), recipe, name, dtype,
                tuple(reduce_axes), operand_info, kernel_shards)


def _dot(a, b, dims, out=F32):
  """f32 accumulation; written in `out` on GPUs (quant/gemm.py's `output_dtype`)."""
  return jax.lax.dot_general(a, b, dims, preferred_element_type=output_dtype(out)).astype(out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _unquantized(x_ExCxK, w_ExKxN, vmas):
  """In the compute dtype with f32 accumulation; the backward GEMMs on compute-dtype operands too (as
  quant/dot.py's `_unquantized`)."""
  return _dot(x_ExCxK, w_ExKxN, FORWARD, x_ExCxK.dtype)


def _unquantized_fwd(x_ExCxK, w_ExKxN, vmas):
  return _unquantized(x_ExCxK, w_ExKxN, vmas), (x_ExCxK, w_ExKxN)


def _unquantized_bwd(vmas, res, g_ExCxN):
  x, w = res
  g = g_ExCxN.astype(x.dtype)
  dx = sum_to(_dot(g, w, DGRAD, output_dtype(x.dtype)), vmas[0]).astype(x.dtype)
  return dx, sum_to(_dot(x, g, WGRAD), vmas[1]).astype(w.dtype)


_unquantized.defvjp(_unquantized_fwd, _unquantized_bwd)


def product(a, b, dims, dtype, out):
  """The batched GEMM of two quantized operands (see the module doc) for a consumer of dtype `out`: per-tensor
  ones on their raw values with the scales on the float32 output (a per-expert scale is no GEMM epilogue's
  scalar), block-scaled ones by quant/gemm.py."""
  if a.block:
    (ca, cb), _ = dims
    return block_scaled_dot(a, b, (ca[0], cb[0]), batched=True, dtype=dtype, out=out)
  return (_dot(a.data.astype(dtype), b.data.astype(dtype), dims) * _along_experts(a) * _along_experts(b)).astype(out)


def _along_experts(q):
  """A per-tensor scale, or each expert's (a per-expert kernel's [E]), shaped to scale a [E, ., .] output."""
  s = q.scale_inv.astype(F32)
  return s.reshape(-1, 1, 1) if s.ndim == 1 else s


def _quantize_operands(x, w, history, recipe: Recipe, name: str, reduce_axes, stats: bool = False,
                       shards: Shards = None):
  h_x, h_k, _ = history
  act = recipe.quantizer(ACTIVATION, h_x)
  q = {}
  with jax.named_scope(SCOPE_ACTIVATION):
    q[X] = act.quantize(x, axis=2, reduce_axes=reduce_axes, stats=stats)
    if recipe.has_x_t:
      q[X_T] = act.quantize(recipe.wgrad_transform(x, 1), axis=1, reduce_axes=reduce_axes)
  with jax.named_scope(SCOPE_WEIGHT):
    q[KERNEL] = per_expert(recipe, w, h_k, axis=0, stats=stats, shards=shards)
    if recipe.has_kernel_t:
      q[KERNEL_T] = per_expert(recipe, w, h_k, axis=1, shards=shards)
  return {k: name_quantized(v, quantized_name(name, k)) for k, v in q.items()}


def _forward(x, w, history, recipe, name, dtype, reduce_axes, stats=False, shards: Shards = None):
  b = recipe.block_size
  xp, wp = pad_to(x, (1, b, b)), pad_to(w, (1, b, b))
  q = _quantize_operands(xp, wp, history, recipe, name, reduce_axes, stats, shards)
  if recipe.forward_quantized:
    y = product(q[X], gathered(q[KERNEL], shards), FORWARD, dtype, dtype)
  else:  # quant.forward = "bf16": only the backward GEMMs read the quantized copies.
    y = _dot(xp.astype(dtype), whole(wp.astype(dtype), shards), FORWARD)
  return y[:, :x.shape[1], :whole_shape(w, shards)[2]].astype(dtype), q


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9, 10))
def _bmm(x, w, history, key, stats, recipe, name, dtype, reduce_axes, operand_info, shards):
  return _forward(x, w, history, recipe, name, dtype, reduce_axes, shards=shards)[0]


def _bmm_fwd(x, w, history, key, stats, recipe, name, dtype, reduce_axes, operand_info, shards):
  y, q = _forward(x, w, history, recipe, name, dtype, reduce_axes, stats is not None, shards)
  return y, (q, history, key)


def _bmm_bwd(recipe, name, dtype, reduce_axes, operand_info, shards, res, g_ExCxN):
  q, history, key = res
  with_stats = q[X].health is not None
  (c, k), x_dtype, w_dtype, x_vma, w_vma = operand_info
  n, b = g_ExCxN.shape[2], recipe.block_size
  g = pad_to(g_ExCxN, (1, b, b))
  grad_q = recipe.quantizer(GRADIENT, history[2])
  key_dgrad = key_wgrad = None
  if key is not None:
    key_dgrad, key_wgrad = jax.random.split(key)
  with jax.named_scope(SCOPE_GRADIENT):
    g_rows = grad_q.quantize(g, axis=2, rng=key_dgrad, reduce_axes=reduce_axes, stats=with_stats)
  dx = product(g_rows, gathered(q.get(KERNEL_T, q[KERNEL]), shards), DGRAD, dtype, x_dtype)
  if not recipe.has_x_t:  # Per-tensor: the forward copies serve wgrad too.
    g_cols, x_c = g_rows, q[X]
  else:  # Block-scaled: both operands along C (NVFP4 after the Hadamard transform).
    with jax.named_scope(SCOPE_GRADIENT):
      g_cols = grad_q.quantize(recipe.wgrad_transform(g, 1), axis=1, rng=key_wgrad, reduce_axes=reduce_axes)
    x_c = q[X_T]
  dw = product(x_c, g_cols, WGRAD, dtype, w_dtype)
  h_x, h_k, h_g = history
  if recipe.delayed:
    new_history = (update_history(h_x, q[X].amax), jax.vmap(update_history)(h_k, q[KERNEL].amax),
                   update_history(h_g, g_rows.amax))
  else:
    new_history = jax.tree.map(jnp.zeros_like, history)
  dx = sum_to(dx[:, :c, :k], x_vma).astype(x_dtype)
  dw = sum_to(scattered(dw[:, :k, :n], shards), w_vma).astype(w_dtype)
  health = (q[X].health, q[KERNEL].health, g_rows.health) if with_stats else None
  return dx, dw, new_history, None, health


_bmm.defvjp(_bmm_fwd, _bmm_bwd)
