"""Chunked cross-entropy equals the unchunked one, in value and gradient."""

import jax
import jax.numpy as jnp
import numpy as np

from ember.trainer.loss import cross_entropy


def test_chunked_matches_unchunked_value_and_gradient():
  kh, kw, kt = jax.random.split(jax.random.key(0), 3)
  hidden = jax.random.normal(kh, (2, 40, 16))
  w = jax.random.normal(kw, (16, 50)) * 0.3
  targets = jax.random.randint(kt, (2, 40), 0, 50)
  weights = jnp.ones((2, 40)).at[1, 30:].set(0.0)  # Padding is masked.

  def loss(h, w, chunk):
    ce, z = cross_entropy(h, targets, weights, lambda x: x @ w, chunk_size=chunk)
    return ce + 0.1 * z

  ref, ref_grads = jax.value_and_grad(loss, argnums=(0, 1))(hidden, w, 0)
  for chunk in (8, 16, 7):  # 7 does not divide 40: the tail is padded.
    val, grads = jax.value_and_grad(loss, argnums=(0, 1))(hidden, w, chunk)
    np.testing.assert_allclose(val, ref, rtol=1e-6)
    for g, r in zip(grads, ref_grads):
      np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)


def test_loss_is_mean_nll_over_unmasked_tokens():
  logits = jnp.log(jnp.array([[[0.5, 0.5], [0.9, 0.1]]]))
  targets = jnp.array([[0, 1]])
  weights = jnp.array([[1.0, 0.0]])
  ce, _ = cross_entropy(jnp.eye(2)[None].astype(jnp.float32), targets, weights, lambda h: h @ logits[0],
                        chunk_size=0)
  np.testing.assert_allclose(ce, np.log(2.0), rtol=1e-6)


def test_chunked_loss_never_holds_full_logits():
  """The compiled chunked loss's temporaries stay well under one [B, L, V] float32 logits block."""
  b, length, d, v = 2, 512, 32, 4096
  hidden = jnp.zeros((b, length, d))
  w = jnp.zeros((d, v))
  targets = jnp.zeros((b, length), jnp.int32)
  weights = jnp.ones((b, length))
  grad = jax.jit(jax.grad(lambda h, w: cross_entropy(h, targets, weights, lambda x: x @ w, chunk_size=64)[0],
                          argnums=(0, 1)))
  temp = grad.lower(hidden, w).compile().memory_analysis().temp_size_in_bytes
  assert temp < b * length * v * 4 / 2, temp
