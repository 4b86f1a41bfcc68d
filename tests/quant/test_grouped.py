"""The grouped quantized matmul against per-expert loops of dense GEMMs, for every recipe."""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from ember import remat
from ember.quant import dot, grouped
from ember.quant.formats import E4M3, E5M2
from ember.quant.hadamard import random_hadamard_transform
from ember.quant.quantizers import CurrentScaling, DelayedScaling, MXFP8Scaling, NVFP4Scaling
from ember.quant.recipe import Recipe, pad_to

# Ragged groups: an empty expert, sizes that are not multiples of any block, 7 unused trailing rows.
GROUPS = (5, 0, 19, 1)
M, K, N, E = 32, 40, 24, len(GROUPS)
F32 = jnp.float32
RECIPES = {
    "fp8_current": Recipe("fp8_current"),
    "fp8_delayed": Recipe("fp8_delayed", amax_history_len=4),
    "mxfp8": Recipe("mxfp8"),
    # Stochastic rounding draws noise over the whole tensor, which a per-expert loop cannot
    # reproduce; it is tested on its own below.
    "nvfp4": Recipe("nvfp4", nvfp4_stochastic_rounding=False),
    "nvfp4_1d_weights": Recipe("nvfp4", nvfp4_stochastic_rounding=False, nvfp4_2d_weights=False),
}


def _operands(seed=0):
  kx, kw, kg, kh = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(kx, (M, K), F32) * jnp.linspace(0.5, 3.0, K)  # Columns of different scale.
  w = jax.random.normal(kw, (E, K, N), F32) * jnp.array([1.0, 2.0, 0.25, 4.0])[:, None, None]
  g = jax.random.normal(kg, (M, N), F32)
  h = jax.random.uniform(kh, (E + 2, 4), F32, 0.5, 8.0)  # Delayed-scaling histories (x, kernels, grad).
  return x, w, g, (h[0], h[1:E + 1], h[E + 1])


@functools.partial(jax.jit, static_argnames=("recipe", "group_sizes"))
def _run(recipe, x, w, g, history, group_sizes=GROUPS, key=None):
  """(y, dx, dw, new history) of the grouped matmul, float32 compute."""
  gs = jnp.asarray(group_sizes, jnp.int32)
  fn = lambda x, w, h: grouped.grouped_matmul(x, w, gs, recipe=recipe, name="moe_wi", history=h, key=key, dtype=F32)
  y, vjp = jax.vjp(fn, x, w, history)
  return (y,) + vjp(g)


def _quantizers(recipe, history):
  """(activation, weight of expert e, gradient), built by hand from the formats (not the recipe table)."""
  if recipe.delayed:
    make = lambda h, fmt: DelayedScaling(h, fmt, recipe.margin, recipe.amax_compute_algo)
    return make(history[0], E4M3), lambda e: make(history[1][e], E4M3), make(history[2], E5M2)
  if recipe.name == "fp8_current":
    return CurrentScaling(E4M3), lambda e: CurrentScaling(E4M3), CurrentScaling(E5M2)
  if recipe.name == "mxfp8":
    return MXFP8Scaling(), lambda e: MXFP8Scaling(), MXFP8Scaling()
  weight = NVFP4Scaling(tile_2d=recipe.nvfp4_2d_weights)
  return NVFP4Scaling(), lambda e: weight, NVFP4Scaling(stochastic_rounding=recipe.nvfp4_stochastic_rounding)


def _columns(chunks, quantizer, recipe):
  """Each expert's rows quantized along the rows on their own (padded to whole blocks), sharing one
  per-tensor amax: a block holding the global amax is appended, then dropped."""
  b = recipe.block_size
  padded = [pad_to(c, (b, 1)) for c in chunks]
  if recipe.name == "nvfp4":
    padded = [random_hadamard_transform(c, axis=0, seed=recipe.rht_seed) for c in padded]
  amax = jnp.max(jnp.abs(jnp.concatenate(padded)))
  out = []
  for c, chunk in zip(padded, chunks):
    extra = jnp.zeros((b, c.shape[1]), F32).at[0, 0].set(amax)
    q = quantizer.quantize(jnp.concatenate([c, extra]), axis=0).dequantize(F32)
    out.append(q[:c.shape[0]])
  return out


@functools.partial(jax.jit, static_argnames=("recipe", "group_sizes"))
def _reference(recipe, x, w, g, history, group_sizes=GROUPS):
  """y, dx, dw from a Python loop over experts of dense GEMMs on operands quantized per expert."""
  b = recipe.block_size
  total = sum(group_sizes)
  x, g = x.at[total:].set(0.0), g.at[total:].set(0.0)
  xp, gp, wp = pad_to(x, (1, b)), pad_to(g, (1, b)), pad_to(w, (1, b, b))
  act, weight, grad = _quantizers(recipe, history)
  xq = act.quantize(xp, axis=1).dequantize(F32)
  gq = grad.quantize(gp, axis=1).dequantize(F32)
  starts = np.cumsum((0,) + group_sizes)
  rows = [slice(int(s), int(s + n)) for s, n in zip(starts, group_sizes)]
  if b > 1:
    x_cols, g_cols = _columns([xp[r] for r in rows], act, recipe), _columns([gp[r] for r in rows], grad, recipe)
  y, dx, dw = jnp.zeros((M, N), F32), jnp.zeros((M, K), F32), []
  for e, r in enumerate(rows):
    w_e = weight(e).quantize(wp[e], axis=0).dequantize(F32)
    two_copies = recipe.name == "mxfp8" or (recipe.name == "nvfp4" and not recipe.nvfp4_2d_weights)
    w_n = weight(e).quantize(wp[e], axis=1).dequantize(F32) if two_copies else w_e
    y = y.at[r].set((xq[r] @ w_e)[:, :N])
    dx = dx.at[r].set((gq[r] @ w_n.T)[:, :K])
    dw_e = xq[r].T @ gq[r] if b == 1 else x_cols[e].T @ g_cols[e]
    dw.append(dw_e[:K, :N])
  return y, dx, jnp.stack(dw)


def _close(actual, expected):
  scale = float(jnp.max(jnp.abs(expected))) or 1.0
  np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=1e-5, atol=1e-6 * scale)


def test_bf16_equals_a_loop_of_dense_matmuls():
  x, w, g, _ = _operands()
  y, dx, dw, _ = _run(Recipe("bf16"), x, w, g, None)

  def loop(x, w):
    starts = np.cumsum((0,) + GROUPS)
    parts = [x[s:s + n] @ w[e] for e, (s, n) in enumerate(zip(starts, GROUPS))]
    return jnp.concatenate(parts + [jnp.zeros((M - sum(GROUPS), N), F32)])

  y_ref, vjp = jax.vjp(loop, x, w)
  dx_ref, dw_ref = vjp(g)
  _close(y, y_ref)
  _close(dx, dx_ref)
  _close(dw, dw_ref)
  assert not np.any(dw[1]) and not np.any(dx[sum(GROUPS):])  # The empty expert, the unused rows.


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.variants
def test_quantized_equals_a_per_expert_loop(name):
  recipe = RECIPES[name]
  x, w, g, history = _operands()
  y, dx, dw, new_history = _run(recipe, x, w, g, history)
  y_ref, dx_ref, dw_ref = _reference(recipe, x, w, g, history)
  _close(y, y_ref)
  _close(dx, dx_ref)
  _close(dw, dw_ref)
  assert not np.any(dw[1])
  # Quantization is real: the result is near, not at, the float32 product.
  exact = x[:5] @ w[0]
  assert 0 < float(jnp.max(jnp.abs(y[:5] - exact))) < 0.25 * float(jnp.max(jnp.abs(exact)))
  if recipe.delayed:
    total = sum(GROUPS)
    amax_x, amax_g = jnp.max(jnp.abs(x[:total])), jnp.max(jnp.abs(g[:total]))
    amax_w = jnp.max(jnp.abs(w), axis=(1, 2))  # One per expert.
    np.testing.assert_array_equal(new_history[0], jnp.concatenate([amax_x[None], history[0][:-1]]))
    np.testing.assert_array_equal(new_history[1], jnp.concatenate([amax_w[:, None], history[1][:, :-1]], 1))
    np.testing.assert_array_equal(new_history[2], jnp.concatenate([amax_g[None], history[2][:-1]]))


@pytest.mark.parametrize("name", ["fp8_current", "mxfp8", "nvfp4"])
@pytest.mark.variants
def test_one_busy_expert_equals_the_dense_quantized_matmul(name):
  """All rows on one expert, the others empty: exactly the dense layer's quantized matmul."""
  recipe = RECIPES[name]
  x, w, g, _ = _operands(seed=1)
  y, dx, dw, _ = _run(recipe, x, w, g, None, group_sizes=(0, M, 0, 0))

  @jax.jit
  def dense(x, w, g):
    y, vjp = jax.vjp(lambda x, w: dot.quantized_matmul(x, w, recipe=recipe, name="wi", dtype=F32), x, w)
    return (y,) + vjp(g)

  y_ref, dx_ref, dw_ref = dense(x, w[1], g)
  _close(y, y_ref)
  _close(dx, dx_ref)
  _close(dw[1], dw_ref)
  assert not np.any(dw[0]) and not np.any(dw[2]) and not np.any(dw[3])


def test_nvfp4_stochastic_rounding_follows_the_key():
  recipe = Recipe("nvfp4")
  x, w, g, _ = _operands()
  _, dx_a, dw_a, _ = _run(recipe, x, w, g, None, key=jax.random.key(1))
  _, dx_b, dw_b, _ = _run(recipe, x, w, g, None, key=jax.random.key(1))
  _, dx_c, dw_c, _ = _run(recipe, x, w, g, None, key=jax.random.key(2))
  _, dx_n, dw_n, _ = _run(recipe, x, w, g, None)  # No key: round to nearest.
  np.testing.assert_array_equal(dw_a, dw_b)
  np.testing.assert_array_equal(dx_a, dx_b)
  assert not np.array_equal(dw_a, dw_c) and not np.array_equal(dx_a, dx_c)
  scale = float(jnp.max(jnp.abs(dw_n)))
  np.testing.assert_allclose(dw_a, dw_n, atol=0.5 * scale)


def _names(jaxpr):
  out = set()
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "name":
      out.add(eqn.params["name"])
    for v in eqn.params.values():
      for sub in v if isinstance(v, (tuple, list)) else (v,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          out |= _names(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          out |= _names(sub)
  return out


# Current scaling also names its amaxes (remat.TENSOR_AMAX, kept by every policy).
@pytest.mark.parametrize("name,operands,amax", [("fp8_current", ("x", "kernel"), {remat.TENSOR_AMAX}),
                                                ("mxfp8", ("x", "kernel", "x_t", "kernel_t"), set()),
                                                ("nvfp4", ("x", "kernel", "x_t"), set())])
def test_every_quantized_operand_is_named_in_primal_and_forward_rule(name, operands, amax):
  recipe = RECIPES[name]
  x, w, _, _ = _operands()
  gs = jnp.asarray(GROUPS, jnp.int32)
  fn = lambda x, w: grouped.grouped_matmul(x, w, gs, recipe=recipe, name="moe_wo", dtype=F32)
  expected = {remat.quantized_name("moe_wo", o) for o in operands} | amax
  assert _names(jax.make_jaxpr(fn)(x, w).jaxpr) == expected  # Primal (what a remat recompute runs).
  assert _names(jax.make_jaxpr(lambda x, w: jax.vjp(fn, x, w)[0])(x, w).jaxpr) == expected  # Forward rule.
  assert expected - amax <= set(remat.QUANTIZED_NAMES)


def test_block_layout_starts_every_group_on_a_block():
  gs = jnp.asarray(GROUPS, jnp.int32)
  dest, padded, length = grouped.block_layout(gs, M, 16)
  np.testing.assert_array_equal(padded, [16, 0, 32, 16])
  expected = list(range(5)) + list(range(16, 35)) + [48] + [length] * (M - sum(GROUPS))
  np.testing.assert_array_equal(dest, expected)
  assert length % 16 == 0 and length >= 64
