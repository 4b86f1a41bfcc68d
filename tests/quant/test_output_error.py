"""The forward-error input of the quantized GEMM (the precision probe's): its "gradient" is (sum of (y - y_ref)^2,
sum of y_ref^2), y the GEMM's own output and y_ref the float32 product of the same operands, computed here in
NumPy; the other gradients are those of the GEMM without it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ember.quant import batched, dot, grouped
from ember.quant.recipe import Recipe

F32 = jnp.float32
GROUPS = (5, 0, 19, 1)  # An empty expert; 7 rows past the last group.
M, K, N, E = 32, 64, 48, len(GROUPS)


def _expected(y, x, w):
  y, ref = np.asarray(y, np.float64), np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  return np.array([np.sum((y - ref) ** 2), np.sum(ref ** 2)])


def _operands(shape_w):
  kx, kw = jax.random.split(jax.random.key(0))
  x = (jax.random.normal(kx, (M, K), F32) * jnp.linspace(0.5, 3.0, K)).astype(jnp.bfloat16)
  return x, jax.random.normal(kw, shape_w, F32)


@pytest.mark.parametrize("name", ["fp8_current", "mxfp8", "nvfp4"])
@pytest.mark.variants
def test_dense(name):
  recipe = Recipe(name)
  x, w = _operands((K, N))
  call = lambda x, w, e: dot.quantized_matmul(x, w, recipe=recipe, name="wi", dtype=jnp.bfloat16, error=e)
  y = call(x, w, jnp.zeros((2,), F32))
  (dx, dw, de) = jax.grad(lambda *a: jnp.sum(call(*a).astype(F32)), argnums=(0, 1, 2))(x, w, jnp.zeros((2,), F32))
  np.testing.assert_allclose(de, _expected(y, x, w), rtol=1e-4)
  plain = lambda x, w: jnp.sum(dot.quantized_matmul(x, w, recipe=recipe, name="wi", dtype=jnp.bfloat16).astype(F32))
  want_dx, want_dw = jax.grad(plain, argnums=(0, 1))(x, w)
  assert (dx == want_dx).all() and (dw == want_dw).all()
  assert np.asarray(y == dot.quantized_matmul(x, w, recipe=recipe, name="wi", dtype=jnp.bfloat16)).all()


@pytest.mark.parametrize("name", ["fp8_current", pytest.param("nvfp4", marks=pytest.mark.extended)])
def test_grouped_and_capacity(name):
  recipe = Recipe(name, nvfp4_stochastic_rounding=False)
  x, w = _operands((E, K, N))
  sizes = jnp.array(GROUPS, jnp.int32)
  y = grouped.grouped_matmul(x, w, sizes, recipe=recipe, name="moe_wi")
  de = jax.grad(lambda e: jnp.sum(grouped.grouped_matmul(x, w, sizes, recipe=recipe, name="moe_wi",
                                                         error=e).astype(F32)))(jnp.zeros((2,), F32))
  starts = np.cumsum((0,) + GROUPS)
  want = sum(_expected(y[a:b], x[a:b], w[e]) for e, (a, b) in enumerate(zip(starts[:-1], starts[1:])))
  want += _expected(y[starts[-1]:], np.zeros_like(x[starts[-1]:]), w[0])  # Rows past the groups: zero.
  np.testing.assert_allclose(de, want, rtol=1e-4)

  x_ExCxK = x[:E * 8].reshape(E, 8, K)  # The capacity layout: 8 slots per expert.
  y = batched.batched_matmul(x_ExCxK, w, recipe=recipe, name="moe_wi")
  de = jax.grad(lambda e: jnp.sum(batched.batched_matmul(x_ExCxK, w, recipe=recipe, name="moe_wi",
                                                         error=e).astype(F32)))(jnp.zeros((2,), F32))
  np.testing.assert_allclose(de, sum(_expected(y[e], x_ExCxK[e], w[e]) for e in range(E)), rtol=1e-4)
