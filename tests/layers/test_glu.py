"""SwiGLU as the down projection's prologue (ember/layers/glu.py, quant/unquantized.py): its backward kernel, run in
Pallas' interpret mode, against a NumPy float64 derivative worked by hand; sharded, the same as on one device; and
the GEMM with the prologue against the product handed to a plain GEMM, forward and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ember.layers import glu
from ember.layers.glu import SwiGLU
from ember.quant import dot
from ember.quant.recipe import Recipe


def _pair_and_gradient(rows, width, dtype, seed=0):
  k1, k2 = jax.random.split(jax.random.key(seed))
  pair = (3 * jax.random.normal(k1, (rows, 2, width))).astype(dtype)
  return pair, jax.random.normal(k2, (rows, width)).astype(dtype)


def _by_hand(pair, d):
  """(silu(g) u, [d u silu'(g), d silu(g)]) in float64, silu'(g) = s (1 + g (1 - s)), s = 1 / (1 + e^-g)."""
  pair, d = np.asarray(pair, np.float64), np.asarray(d, np.float64)
  g, u = pair[:, 0], pair[:, 1]
  s = 1 / (1 + np.exp(-g))
  return g * s * u, np.stack([d * u * s * (1 + g * (1 - s)), d * g * s], axis=1)


@pytest.mark.parametrize("interpret", [True, False])  # The kernel; autodiff of `forward` (off a GPU).
def test_float32_backward_equals_the_worked_derivative(interpret):
  pair, d = _pair_and_gradient(16, 384, jnp.float32)
  product, d_pair = jax.jit(lambda p, g: SwiGLU(interpret=interpret or None).backward(p, g))(pair, d)
  want_product, want_d_pair = _by_hand(pair, d)
  np.testing.assert_allclose(np.asarray(product), want_product, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(d_pair), want_d_pair, rtol=1e-5, atol=1e-5)


def test_bfloat16_kernel_rounds_once():
  """bf16 pair and gradient: the kernel computes in float32 and rounds each output once, so each is within half a
  bf16 step (2**-8 relative) of the exact value on the same inputs (float32 arithmetic adds a few 2**-24)."""
  pair, d = _pair_and_gradient(32, 256, jnp.bfloat16, seed=1)
  got = jax.jit(lambda p, g: SwiGLU(interpret=True).backward(p, g))(pair, d)
  for g, exact in zip(got, _by_hand(pair, d)):
    assert g.dtype == jnp.bfloat16
    error = np.abs(np.asarray(g, np.float64) - exact)
    assert np.all(error <= 2**-8 * np.abs(exact) * (1 + 2**-10) + 1e-30), np.max(error / np.abs(exact))


def test_sharded_rows_and_width_equal_one_device():
  pair, d = _pair_and_gradient(64, 512, jnp.float32, seed=2)
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("rows", "cols"))
  backward = jax.jit(lambda p, g: SwiGLU(interpret=True).backward(p, g))
  whole = backward(pair, d)
  sharded = backward(jax.device_put(pair, NamedSharding(mesh, P("rows", None, "cols"))),
                     jax.device_put(d, NamedSharding(mesh, P("rows", "cols"))))
  for got, want in zip(sharded, whole):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("interpret", [True, None])
def test_the_gemm_with_the_prologue_equals_the_product_handed_to_it(interpret):
  """y = silu(g) u @ w and its gradients for the pair and w, float32: the prologue inside the GEMM's VJP against
  the product made first and handed to the same GEMM."""
  pair, _ = _pair_and_gradient(32, 256, jnp.float32, seed=3)
  w = jax.random.normal(jax.random.key(4), (256, 128)) / 16
  dy = jax.random.normal(jax.random.key(5), (32, 128))
  recipe = Recipe(name="bf16")
  glu = SwiGLU(interpret=interpret)

  def inside(p, w):
    return dot.quantized_matmul(p, w, recipe=recipe, name="wo", dtype=jnp.float32, prologue=glu)

  def first(p, w):
    return dot.quantized_matmul(glu.forward(p), w, recipe=recipe, name="wo", dtype=jnp.float32)

  (y, vjp), (want_y, want_vjp) = jax.vjp(inside, pair, w), jax.vjp(first, pair, w)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(want_y))
  for got, want in zip(vjp(dy), want_vjp(dy)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_the_kernel_takes_whole_tiles_only():
  pair = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  assert glu._runs(pair(64, 2, 384))  # pylint: disable=protected-access
  assert not glu._runs(pair(60, 2, 384))  # pylint: disable=protected-access  # Rows not whole tiles of 8.
  assert not glu._runs(pair(64, 2, 200))  # pylint: disable=protected-access  # F not whole tiles of 128.
  with pytest.raises(ValueError, match=r"got \(64, 2, 200\)"):
    SwiGLU(interpret=True).backward(jnp.zeros((64, 2, 200)), jnp.zeros((64, 200)))
