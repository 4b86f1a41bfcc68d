"""The quantized matmul every projection uses: y[M, N] = x[M, K] @ w[K, N], with a custom VJP.

Forward: x and w are quantized along the contraction axis K and multiplied. Backward:
  dgrad  dx[M, K] = g[M, N] @ w.T   contracts N,
  wgrad  dw[K, N] = x.T @ g[M, N]   contracts M,
each from operands quantized along *its* contraction axis. Per-tensor FP8 copies serve every
GEMM; block-scaled recipes need a second copy of x along M (`x_t`) and, unless NVFP4's 16x16 weight
tiles make one copy serve both GEMMs, a second copy of w along N (`kernel_t`).

Every quantized operand is wrapped in `checkpoint_name("quantized.<projection>.<operand>")`, in
the primal function and in the forward rule alike (both run `_quantize_operands`). That is what
lets a remat policy keep them: when the backward pass recomputes this GEMM's output (it feeds a
nonlinearity that was not saved), it reuses the saved low-precision operands and runs the GEMM
alone, never a quantize op. Names only inside the forward rule would leave the quantize ops in
the recompute.

Per-tensor FP8 GEMMs dequantize as `data.astype(bf16) * scale` and dot: the pattern XLA's GPU compiler
rewrites into a cuBLASLt FP8 GEMM. Block-scaled ones (MXFP8, NVFP4) go through quant/gemm.py, whose one
rule picks the platform's way: cuDNN's block-scaled GEMM on Blackwell, `jax.lax.scaled_dot` on CPU, an
emulated bf16 GEMM elsewhere.

Delayed scaling: the histories [3 (x, kernel, grad), H] are an input whose "cotangent" is the
updated history (the step's amaxes rolled in). Gradient amaxes only exist in the backward pass,
so this is how all three reach the train state functionally (trainer/step.py stores them).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ember.quant.gemm import block_scaled_dot, output_dtype
from ember.quant.naming import name_quantized
from ember.quant.quantizers import update_history
from ember.quant.recipe import ACTIVATION, GRADIENT, KERNEL, KERNEL_T, WEIGHT, X, X_T, Recipe, pad_to
from ember.remat import quantized_name

# Name scopes around every quantize call, so an analysis of a traced step can tell a forward
# operand's quantization (which a remat policy may recompute) from a gradient's (always in the
# backward pass) by `eqn.source_info.name_stack` (ember/plan/trace.py).
SCOPE_ACTIVATION = "quantize_activation"
SCOPE_WEIGHT = "quantize_weight"
SCOPE_GRADIENT = "quantize_gradient"


def quantized_matmul(x_MxK: jax.Array, w_KxN: jax.Array, *, recipe: Recipe, name: str,
                     history: jax.Array | None = None, key: jax.Array | None = None, dtype=jnp.bfloat16,
                     stats: jax.Array | None = None):
  """x @ w in `recipe`'s format. `name` is the projection (names its residuals); `history` the
  delayed-scaling amax histories (fp8_delayed only); `key` seeds stochastic rounding (nvfp4).
  `stats`: a [3 (x, kernel, grad), NUM_STATS] input whose "gradient" is the operands' health
  (ember/quant/health.py), or None: no statistics, and no trace of them in the program."""
  dtype = jnp.dtype(dtype)
  if not recipe.quantized:
    return _unquantized(x_MxK.astype(dtype), w_KxN.astype(dtype))
  if history is None:
    history = jnp.zeros((3, 1), jnp.float32)  # Unused outside fp8_delayed; keeps one signature.
  # Static facts the backward rule needs (residuals must be arrays): unpadded K and operand dtypes.
  operand_info = (x_MxK.shape[1], jnp.dtype(x_MxK.dtype), jnp.dtype(w_KxN.dtype))
  return _qmm(x_MxK, w_KxN, history, key, stats, recipe, name, dtype, operand_info)


def product(a, b, contracting: tuple[int, int], dtype, out):
  """The GEMM of two quantized 2-d operands contracting a's axis `contracting[0]` with b's `contracting[1]`,
  for a consumer of dtype `out` (quant/gemm.py's `output_dtype` rule; see the module doc)."""
  if a.block:
    return block_scaled_dot(a, b, contracting, batched=False, dtype=dtype, out=out)
  dims = ((contracting[:1], contracting[1:]), ((), ()))
  y = jax.lax.dot_general(a.dequantize(dtype), b.dequantize(dtype), dims, preferred_element_type=output_dtype(out))
  return y.astype(out)


def contract_last(a_MxN, b_KxN, out=jnp.float32):
  """a @ b.T with f32 accumulation, written as one dot_general (no transpose before the dot, so that under
  FSDP the kernel is all-gathered as it is, not as a transposed copy), for a consumer of dtype `out`."""
  y = jax.lax.dot_general(a_MxN, b_KxN, (((1,), (1,)), ((), ())), preferred_element_type=output_dtype(out))
  return y.astype(out)


def contract_first(a_MxK, b_MxN):
  """a.T @ b with f32 accumulation, as one dot_general (see `contract_last`)."""
  return jax.lax.dot_general(a_MxK, b_MxN, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


@jax.custom_vjp
def _unquantized(x_MxK, w_KxN):
  """x @ w in the operands' (compute) dtype with f32 accumulation, rounded to that dtype: written in it by
  the GEMM itself on GPUs (quant/gemm.py's `output_dtype`, the rule of every GEMM whose consumer reads
  bf16), in float32 and then rounded on the CPU (the reference).

  The custom VJP keeps the backward GEMMs on compute-dtype operands: autodiff of the plain dot would
  pair the f32 cotangent of `preferred_element_type=f32` with the operand and XLA would run dgrad and
  wgrad as f32 x f32 GEMMs. The cotangent of a bf16 output is bf16-exact, so casting it back changes no
  value. Both GEMMs accumulate in f32 and are rounded to the compute dtype, as autodiff of the plain
  dot rounds them; under FSDP XLA reduce-scatters the weight gradient before that rounding (in f32)."""
  return jnp.dot(x_MxK, w_KxN, preferred_element_type=output_dtype(x_MxK.dtype)).astype(x_MxK.dtype)


def _unquantized_fwd(x_MxK, w_KxN):
  return _unquantized(x_MxK, w_KxN), (x_MxK, w_KxN)


def _unquantized_bwd(res, g_MxN):
  x_MxK, w_KxN = res
  g_MxN = g_MxN.astype(x_MxK.dtype)
  return contract_last(g_MxN, w_KxN, x_MxK.dtype), contract_first(x_MxK, g_MxN).astype(w_KxN.dtype)


_unquantized.defvjp(_unquantized_fwd, _unquantized_bwd)


def _quantize_operands(x, w, history, recipe: Recipe, name: str, stats: bool = False):
  """Quantizes every operand copy the recipe's forward and backward GEMMs read, each named for remat
  (with `stats`, the forward copies carry their health, named and saved with them)."""
  act, weight = recipe.quantizer(ACTIVATION, history[0]), recipe.quantizer(WEIGHT, history[1])
  q = {}
  with jax.named_scope(SCOPE_ACTIVATION):
    q[X] = act.quantize(x, axis=1, stats=stats)
    if recipe.has_x_t:
      q[X_T] = act.quantize(recipe.wgrad_transform(x, 0), axis=0)
  with jax.named_scope(SCOPE_WEIGHT):
    q[KERNEL] = weight.quantize(w, axis=0, stats=stats)
    if recipe.has_kernel_t:
      q[KERNEL_T] = weight.quantize(w, axis=1)
  return {k: name_quantized(v, quantized_name(name, k)) for k, v in q.items()}


def _forward(x, w, history, recipe, name, dtype, stats=False):
  m, n = x.shape[0], w.shape[1]
  b = recipe.block_size
  xp, wp = pad_to(x, (b, b)), pad_to(w, (b, b))
  q = _quantize_operands(xp, wp, history, recipe, name, stats)
  if recipe.forward_quantized:
    y = product(q[X], q[KERNEL], (1, 0), dtype, dtype)
  else:  # quant.forward = "bf16": only the backward GEMMs read the quantized copies.
    y = jnp.dot(xp.astype(dtype), wp.astype(dtype), preferred_element_type=jnp.float32)
  return y[:m, :n].astype(dtype), q


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _qmm(x, w, history, key, stats, recipe, name, dtype, operand_info):
  return _forward(x, w, history, recipe, name, dtype)[0]


def _qmm_fwd(x, w, history, key, stats, recipe, name, dtype, operand_info):
  y, q = _forward(x, w, history, recipe, name, dtype, stats is not None)
  return y, (q, history, key)


def _qmm_bwd(recipe, name, dtype, operand_info, res, g_MxN):
  q, history, key = res
  with_stats = q[X].health is not None
  (m, n), (k, x_dtype, w_dtype) = g_MxN.shape, operand_info
  b = recipe.block_size
  g = pad_to(g_MxN, (b, b))
  grad_q = recipe.quantizer(GRADIENT, history[2])
  key_dgrad = key_wgrad = None
  if key is not None:
    key_dgrad, key_wgrad = jax.random.split(key)
  # dgrad: contract N. The kernel copy quantized along N (per-tensor and 2D tiles: the same copy).
  with jax.named_scope(SCOPE_GRADIENT):
    g_rows = grad_q.quantize(g, axis=1, rng=key_dgrad, stats=with_stats)
  kernel_n = q.get(KERNEL_T, q[KERNEL])
  dx = product(g_rows, kernel_n, (1, 1), dtype, x_dtype)
  # wgrad: contract M. Per-tensor recipes reuse the forward copies; block recipes quantize along M
  # (NVFP4 after the random Hadamard transform, applied to both operands so it cancels).
  if not recipe.has_x_t:
    g_cols, x_m = g_rows, q[X]
  else:
    with jax.named_scope(SCOPE_GRADIENT):
      g_cols = grad_q.quantize(recipe.wgrad_transform(g, 0), axis=0, rng=key_wgrad)
    x_m = q[X_T]
  dw = product(x_m, g_cols, (0, 0), dtype, w_dtype)
  if recipe.delayed:
    new_history = jnp.stack([update_history(history[0], q[X].amax), update_history(history[1], q[KERNEL].amax),
                             update_history(history[2], g_rows.amax)])
  else:
    new_history = jnp.zeros_like(history)
  health = jnp.stack([q[X].health, q[KERNEL].health, g_rows.health]) if with_stats else None
  return dx[:m, :k].astype(x_dtype), dw[:k, :n].astype(w_dtype), new_history, None, health


_qmm.defvjp(_qmm_fwd, _qmm_bwd)
