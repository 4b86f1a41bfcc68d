"""The vocab-sliced cross-entropy equals the full-logits one, in value and gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ember.trainer.loss import cross_entropy, num_slices


def _matmul_logits(h, w, key=None):
  return jnp.einsum("bld,dv->blv", h, w)


def _reference(h, w, targets, weights, z_weight):
  """Full [B, L, V] logits, autodiffed: the definition the sliced loss must reproduce."""
  logits = jnp.einsum("bld,dv->blv", h, w)
  lse = jax.nn.logsumexp(logits, axis=-1)
  nll = lse - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  count = jnp.sum(weights)
  return jnp.sum(nll * weights) / count + z_weight * jnp.sum(lse * lse * weights) / count


@pytest.mark.parametrize("chunk_size", [0, 10, 8, 6])  # 1, 4, 5 and 7 slices of a 50-word vocab (7: padded).
def test_sliced_matches_full_logits_value_and_gradient(chunk_size):
  kh, kw, kt = jax.random.split(jax.random.key(0), 3)
  hidden = jax.random.normal(kh, (2, 40, 16))
  w = jax.random.normal(kw, (16, 50)) * 0.3
  targets = jax.random.randint(kt, (2, 40), 0, 50).at[0, :3].set(jnp.array([0, 49, 48]))  # Both ends of the vocab.
  weights = jnp.ones((2, 40)).at[1, 30:].set(0.0)  # Padding is masked.

  def loss(h, w):
    ce, z = cross_entropy(h, targets, weights, w, _matmul_logits, chunk_size=chunk_size)
    return ce + 0.1 * z

  ref, ref_grads = jax.value_and_grad(_reference, argnums=(0, 1))(hidden, w, targets, weights, 0.1)
  val, grads = jax.value_and_grad(loss, argnums=(0, 1))(hidden, w)
  np.testing.assert_allclose(val, ref, rtol=1e-6)
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
  assert np.abs(grads[0][1, 30:]).max() == 0  # Masked tokens get no gradient.


def test_slices_follow_the_chunk_budget():
  assert num_slices(8192, 128256, 1024) == 8  # A slice holds as many logits as 1024 tokens' full vocab.
  assert num_slices(8192, 128256, 0) == num_slices(1024, 128256, 1024) == 1
  assert num_slices(40, 50, 6) == 7
  assert num_slices(40, 3, 1) == 3  # Never more slices than words.


def test_loss_is_mean_nll_over_unmasked_tokens():
  logits = jnp.log(jnp.array([[0.5, 0.5], [0.9, 0.1]]))
  targets = jnp.array([[0, 1]])
  weights = jnp.array([[1.0, 0.0]])
  ce, _ = cross_entropy(jnp.eye(2)[None].astype(jnp.float32), targets, weights, logits, _matmul_logits)
  np.testing.assert_allclose(ce, np.log(2.0), rtol=1e-6)


def test_sliced_loss_never_holds_full_logits():
  """The compiled sliced loss's temporaries stay well under one [B, L, V] float32 logits block."""
  b, length, d, v = 2, 512, 32, 4096
  hidden = jnp.zeros((b, length, d))
  w = jnp.zeros((d, v))
  targets = jnp.zeros((b, length), jnp.int32)
  weights = jnp.ones((b, length))
  grad = jax.jit(jax.grad(lambda h, w: cross_entropy(h, targets, weights, w, _matmul_logits, chunk_size=64)[0],
                          argnums=(0, 1)))
  temp = grad.lower(hidden, w).compile().memory_analysis().temp_size_in_bytes
  assert temp < b * length * v * 4 / 2, temp
