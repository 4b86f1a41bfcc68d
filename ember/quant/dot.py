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

Where the hardware has no native kernel (CPU; MXFP8/NVFP4 on Hopper) the dot runs on dequantized
values, with identical numerics. For per-tensor FP8 the dequantize is `data.astype(bf16) * scale`,
the pattern XLA's GPU compiler rewrites into a cuBLASLt FP8 GEMM.

Delayed scaling: the histories [3 (x, kernel, grad), H] are an input whose "cotangent" is the
updated history (the step's amaxes rolled in). Gradient amaxes only exist in the backward pass,
so this is how all three reach the train state functionally (trainer/step.py stores them).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ember.quant import hadamard
from ember.quant.naming import name_quantized
from ember.quant.quantizers import CurrentScaling, DelayedScaling, MXFP8Scaling, NVFP4Scaling, update_history
from ember.quant.formats import E4M3, E5M2
from ember.quant.recipe import Recipe
from ember.remat import quantized_name

# Name scopes around every quantize call, so an analysis of a traced step can tell a forward
# operand's quantization (which a remat policy may recompute) from a gradient's (always in the
# backward pass) by `eqn.source_info.name_stack` (ember/tools/analysis.py).
SCOPE_ACTIVATION = "quantize_activation"
SCOPE_WEIGHT = "quantize_weight"
SCOPE_GRADIENT = "quantize_gradient"


def quantized_matmul(x_MxK: jax.Array, w_KxN: jax.Array, *, recipe: Recipe, name: str,
                     history: jax.Array | None = None, key: jax.Array | None = None, dtype=jnp.bfloat16):
  """x @ w in `recipe`'s format. `name` is the projection (names its residuals); `history` the
  delayed-scaling amax histories (fp8_delayed only); `key` seeds stochastic rounding (nvfp4)."""
  dtype = jnp.dtype(dtype)
  if not recipe.quantized:
    return jnp.dot(x_MxK.astype(dtype), w_KxN.astype(dtype), preferred_element_type=jnp.float32).astype(dtype)
  if history is None:
    history = jnp.zeros((3, 1), jnp.float32)  # Unused outside fp8_delayed; keeps one signature.
  # Static facts the backward rule needs (residuals must be arrays): unpadded K and operand dtypes.
  operand_info = (x_MxK.shape[1], jnp.dtype(x_MxK.dtype), jnp.dtype(w_KxN.dtype))
  return _qmm(x_MxK, w_KxN, history, key, recipe, name, dtype, operand_info)


def _quantizers(recipe: Recipe, history):
  """(activation, weight, gradient) quantizers of a recipe; fp8_delayed reads the histories."""
  r = recipe
  if r.name == "fp8_current":
    return CurrentScaling(E4M3), CurrentScaling(E4M3), CurrentScaling(E5M2)
  if r.name == "fp8_delayed":
    make = lambda h, fmt: DelayedScaling(h, fmt, r.margin, r.amax_compute_algo)
    return make(history[0], E4M3), make(history[1], E4M3), make(history[2], E5M2)
  if r.name == "mxfp8":
    return MXFP8Scaling(), MXFP8Scaling(), MXFP8Scaling()
  if r.name == "nvfp4":
    return (NVFP4Scaling(), NVFP4Scaling(tile_2d=r.nvfp4_2d_weights),
            NVFP4Scaling(stochastic_rounding=r.nvfp4_stochastic_rounding))
  raise ValueError(f"recipe {r.name!r} is not a quantized recipe")


def _pad_to(a: jax.Array, multiples: tuple[int, ...]) -> jax.Array:
  """Zero-pads each axis to a multiple (zeros change neither amaxes nor products)."""
  pads = [(0, -n % m) for n, m in zip(a.shape, multiples)]
  return jnp.pad(a, pads) if any(p for _, p in pads) else a


def _rht(a, axis, recipe: Recipe):
  return hadamard.random_hadamard_transform(a, axis=axis, seed=recipe.rht_seed) if recipe.nvfp4_rht else a


def _quantize_operands(x, w, history, recipe: Recipe, name: str):
  """Quantizes every operand the forward and backward GEMMs need, each named for remat."""
  act, weight, _ = _quantizers(recipe, history)
  q = {}
  with jax.named_scope(SCOPE_ACTIVATION):
    q["x"] = act.quantize(x, axis=1)
    if recipe.name == "mxfp8":
      q["x_t"] = act.quantize(x, axis=0)
    elif recipe.name == "nvfp4":
      q["x_t"] = act.quantize(_rht(x, 0, recipe), axis=0)
  with jax.named_scope(SCOPE_WEIGHT):
    q["kernel"] = weight.quantize(w, axis=0)
    if recipe.name == "mxfp8" or (recipe.name == "nvfp4" and not recipe.nvfp4_2d_weights):
      q["kernel_t"] = weight.quantize(w, axis=1)
  return {k: name_quantized(v, quantized_name(name, k)) for k, v in q.items()}


def _forward(x, w, history, recipe, name, dtype):
  m, n = x.shape[0], w.shape[1]
  b = recipe.block_size
  xp, wp = _pad_to(x, (b, b)), _pad_to(w, (b, b))
  q = _quantize_operands(xp, wp, history, recipe, name)
  y = jnp.dot(q["x"].dequantize(dtype), q["kernel"].dequantize(dtype), preferred_element_type=jnp.float32)
  return y[:m, :n].astype(dtype), q


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _qmm(x, w, history, key, recipe, name, dtype, operand_info):
  return _forward(x, w, history, recipe, name, dtype)[0]


def _qmm_fwd(x, w, history, key, recipe, name, dtype, operand_info):
  y, q = _forward(x, w, history, recipe, name, dtype)
  return y, (q, history, key)


def _qmm_bwd(recipe, name, dtype, operand_info, res, g_MxN):
  q, history, key = res
  (m, n), (k, x_dtype, w_dtype) = g_MxN.shape, operand_info
  b = recipe.block_size
  g = _pad_to(g_MxN, (b, b))
  _, _, grad_q = _quantizers(recipe, history)
  key_dgrad = key_wgrad = None
  if key is not None:
    key_dgrad, key_wgrad = jax.random.split(key)
  # dgrad: contract N. The kernel copy quantized along N (per-tensor and 2D tiles: the same copy).
  with jax.named_scope(SCOPE_GRADIENT):
    g_rows = grad_q.quantize(g, axis=1, rng=key_dgrad)
  kernel_n = q.get("kernel_t", q["kernel"])
  dx = jnp.dot(g_rows.dequantize(dtype), kernel_n.dequantize(dtype).T, preferred_element_type=jnp.float32)
  # wgrad: contract M. Per-tensor recipes reuse the forward copies; block recipes quantize along M
  # (NVFP4 after the random Hadamard transform, applied to both operands so it cancels).
  if recipe.block_size == 1:
    g_cols, x_m = g_rows, q["x"]
  else:
    with jax.named_scope(SCOPE_GRADIENT):
      g_cols = grad_q.quantize(_rht(g, 0, recipe) if recipe.name == "nvfp4" else g, axis=0, rng=key_wgrad)
    x_m = q["x_t"]
  dw = jnp.dot(x_m.dequantize(dtype).T, g_cols.dequantize(dtype), preferred_element_type=jnp.float32)
  if recipe.delayed:
    new_history = jnp.stack([update_history(history[0], q["x"].amax), update_history(history[1], q["kernel"].amax),
                             update_history(history[2], g_rows.amax)])
  else:
    new_history = jnp.zeros_like(history)
  return dx[:m, :k].astype(x_dtype), dw[:k, :n].astype(w_dtype), new_history, None


_qmm.defvjp(_qmm_fwd, _qmm_bwd)
