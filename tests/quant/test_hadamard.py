"""The 16x16 random Hadamard transform: orthogonal, invertible, product-preserving."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ember.quant import (inverse_random_hadamard_transform,
                         random_hadamard_transform)
from ember.quant.hadamard import hadamard_matrix, random_signs, rht_matrix


def test_matrix_is_orthogonal_signed_hadamard():
  h = hadamard_matrix(16)
  assert set(np.unique(np.abs(h))) == {0.25}
  np.testing.assert_array_equal(h @ h.T, np.eye(16))
  m = rht_matrix(seed=3)
  np.testing.assert_array_equal(m @ m.T, np.eye(16))  # Exact in float32.
  s = random_signs(3)
  assert set(np.unique(s)) == {-1.0, 1.0}
  np.testing.assert_array_equal(m, s[:, None] * h)


def test_signs_depend_only_on_seed():
  np.testing.assert_array_equal(random_signs(7), random_signs(7))
  assert not np.array_equal(random_signs(0), random_signs(1))
  x = jax.random.normal(jax.random.key(0), (4, 32))
  assert not jnp.allclose(random_hadamard_transform(x, seed=0),
                          random_hadamard_transform(x, seed=1))


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_inverse_and_norm(axis):
  x = jax.random.normal(jax.random.key(1), (32, 48, 16))
  y = jax.jit(random_hadamard_transform, static_argnames=("axis", "seed"))(x, axis=axis, seed=5)
  np.testing.assert_allclose(inverse_random_hadamard_transform(y, axis, 5), x, atol=1e-6)
  # Orthogonal: norms of every 16-block along `axis` are kept.
  np.testing.assert_allclose(jnp.sum(y * y), jnp.sum(x * x), rtol=1e-5)
  assert y.dtype == x.dtype and y.shape == x.shape


def test_blocks_are_independent():
  """Changing one block of 16 changes only that block of the output."""
  x = jax.random.normal(jax.random.key(2), (3, 64))
  x2 = x.at[1, 20].add(5.0)
  d = random_hadamard_transform(x2) - random_hadamard_transform(x)
  changed = np.argwhere(np.abs(np.asarray(d)) > 0)
  assert set(changed[:, 0]) == {1} and set(changed[:, 1] // 16) == {1}
  assert len(changed) == 16  # A Hadamard row has no zeros.


def test_product_preserved_along_contraction_axis():
  a = jax.random.normal(jax.random.key(3), (8, 64))   # [m, k]
  b = jax.random.normal(jax.random.key(4), (64, 24))  # [k, n]
  ta = random_hadamard_transform(a, axis=1, seed=11)
  tb = random_hadamard_transform(b, axis=0, seed=11)
  hi = jax.lax.Precision.HIGHEST
  exact = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
  np.testing.assert_allclose(jnp.dot(ta, tb, precision=hi), exact, atol=1e-4)
  # A different seed on one side breaks it: the signs must match.
  wrong = random_hadamard_transform(b, axis=0, seed=12)
  assert np.abs(jnp.dot(ta, wrong, precision=hi) - exact).max() > 1.0


def test_bf16_and_errors():
  x = jnp.ones((2, 32), jnp.bfloat16)
  assert random_hadamard_transform(x).dtype == jnp.bfloat16
  with pytest.raises(ValueError, match="multiple of 16"):
    random_hadamard_transform(jnp.ones((2, 24)))
  with pytest.raises(ValueError, match="power of two"):
    hadamard_matrix(12)
