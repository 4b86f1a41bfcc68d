"""Next-token cross-entropy, chunked along the sequence so [batch, length, vocab] logits never exist.

Each chunk's logits are computed, reduced to per-token losses and dropped; `jax.checkpoint`
around the chunk body makes the backward pass recompute them chunk by chunk too, so the peak holds
one [batch, chunk, vocab] float32 block at a time.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def _chunk_losses(h_BxCxD, targets_BxC, head: Callable):
  logits_BxCxV = head(h_BxCxD).astype(jnp.float32)
  lse_BxC = jax.nn.logsumexp(logits_BxCxV, axis=-1)
  target_BxC = jnp.take_along_axis(logits_BxCxV, targets_BxC[..., None], axis=-1)[..., 0]
  return lse_BxC - target_BxC, lse_BxC


def cross_entropy(hidden_BxLxD, targets_BxL, weights_BxL, head: Callable, *, chunk_size: int = 0):
  """Returns (mean next-token NLL, mean log(Z)^2) over tokens with weight > 0.

  `head` maps hidden states [B, C, D] to logits [B, C, V]. `chunk_size` tokens along the sequence
  are processed at a time (0 or >= length: one chunk); the length is padded to a multiple.
  """
  b, length, d = hidden_BxLxD.shape
  weights_BxL = weights_BxL.astype(jnp.float32)
  if not chunk_size or chunk_size >= length:
    nll, lse = _chunk_losses(hidden_BxLxD, targets_BxL, head)
    nll_sum, z_sum = jnp.sum(nll * weights_BxL), jnp.sum(lse * lse * weights_BxL)
  else:
    n = -(-length // chunk_size)
    pad = n * chunk_size - length
    if pad:
      hidden_BxLxD = jnp.pad(hidden_BxLxD, ((0, 0), (0, pad), (0, 0)))
      targets_BxL = jnp.pad(targets_BxL, ((0, 0), (0, pad)))
      weights_BxL = jnp.pad(weights_BxL, ((0, 0), (0, pad)))
    chunks = lambda a: jnp.moveaxis(a.reshape(b, n, chunk_size, *a.shape[2:]), 1, 0)

    @jax.checkpoint
    def body(carry, xs):
      h, t, w = xs
      nll, lse = _chunk_losses(h, t, head)
      return (carry[0] + jnp.sum(nll * w), carry[1] + jnp.sum(lse * lse * w)), None

    zero = jnp.zeros((), jnp.float32)
    (nll_sum, z_sum), _ = jax.lax.scan(body, (zero, zero),
                                       (chunks(hidden_BxLxD), chunks(targets_BxL), chunks(weights_BxL)))
  count = jnp.maximum(jnp.sum(weights_BxL), 1.0)
  return nll_sum / count, z_sum / count
