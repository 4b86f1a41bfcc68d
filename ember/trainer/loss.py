"""Next-token cross-entropy over vocab slices, so [batch, length, vocab] logits never exist.

The LM head's weight [D, V] is cut into `n` vocab slices (slice c holds columns c, c + n, c + 2n, ...:
strided, so a vocab axis sharded over `tensor` stays sharded inside every slice). The forward pass
runs the head one slice at a time and folds each [batch, length, V/n] block into a running
log-sum-exp; the backward pass (a custom VJP) recomputes each slice's logits, forms its softmax
gradient from the saved log-sum-exp, and runs the head's own backward on it.

Why slices of the vocab rather than chunks of the sequence: every sequence chunk contributes to the
whole head gradient, so chunking the sequence accumulates (and, under data parallelism, reduces) the
f32 [D, V] gradient once per chunk. A vocab slice's gradient is complete after its one backward
step, so the head's gradient is computed, and reduce-scattered, exactly once a step; what is summed
over slices is the hidden state's gradient, [batch, length, D] in float32.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from ember.names import BATCH, EMBED, LENGTH, LM_HEAD, VOCAB
from ember.parallel.sharding import shard

F32 = jnp.float32


def num_slices(length: int, vocab: int, chunk_size: int) -> int:
  """Vocab slices for a `chunk_size` budget: one slice's logits hold as many values as `chunk_size`
  tokens' full-vocab logits (0 or >= length: one slice)."""
  if not chunk_size or chunk_size >= length:
    return 1
  return min(-(-length // chunk_size), vocab)


def cross_entropy(hidden_BxLxD, targets_BxL, weights_BxL, w_DxV, logits: Callable, *, key=None,
                  chunk_size: int = 0, count=None):
  """Returns (mean next-token NLL, mean log(Z)^2) over tokens with weight > 0.

  `logits(h [B, L, D], w [D, C], key)` is the LM head applied to a vocab slice `w` of its weight
  `w_DxV` (float32 logits [B, L, C]); it must be a pure function of its arguments (it is called in
  both passes). `chunk_size` bounds the live logits (see `num_slices`). `count`: the denominator, when
  these tokens are one micro-batch of a larger step (its weighted tokens); default these tokens' own.
  """
  vocab = w_DxV.shape[1]
  w_NxDxC = vocab_slices(w_DxV, hidden_BxLxD.shape[1], chunk_size)
  weights_BxL = weights_BxL.astype(F32)
  nll_sum, z_sum = _sliced_sums(logits, vocab, hidden_BxLxD, w_NxDxC, targets_BxL, weights_BxL, key)
  count = token_count(weights_BxL) if count is None else count
  return nll_sum / count, z_sum / count


def vocab_slices(w_DxV, length: int, chunk_size: int):
  """The head's weight as its `num_slices` strided vocab slices [n, D, V/n] (zero columns pad the last)."""
  d, vocab = w_DxV.shape
  n = num_slices(length, vocab, chunk_size)
  pad = -vocab % n
  w_DxV = jnp.pad(w_DxV, ((0, 0), (0, pad))) if pad else w_DxV
  return shard(jnp.moveaxis(w_DxV.reshape(d, (vocab + pad) // n, n), 2, 0), (None, EMBED, VOCAB))


def token_count(weights_BxL):
  """The loss's denominator: the tokens with weight > 0 (at least 1)."""
  return jnp.maximum(jnp.sum(weights_BxL.astype(F32)), 1.0)


def _slice_logits(logits: Callable, vocab: int, n: int, h, w_DxC, c, key):
  """Float32 logits of slice `c` (vocab columns c + n * j); padding columns are -inf. Scoped `lm_head`, so
  the compiled step's ops of the head (its GEMMs, gathers and gradient reductions) are found by name."""
  with jax.named_scope(LM_HEAD):
    out_BxLxC = shard(logits(h, w_DxC, key).astype(F32), (BATCH, LENGTH, VOCAB))
  if vocab % n:
    column = c + n * jax.lax.broadcasted_iota(jnp.int32, out_BxLxC.shape, 2)
    out_BxLxC = jnp.where(column < vocab, out_BxLxC, -jnp.inf)
  return out_BxLxC


def _target_in_slice(targets_BxL, c, n, size: int):
  """[B, L, C] one-hot of each token's target within slice `c` (all False where it lies in another)."""
  position = jax.lax.broadcasted_iota(jnp.int32, (*targets_BxL.shape, size), 2)
  return ((targets_BxL % n == c)[..., None]) & (position == (targets_BxL // n)[..., None])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _sliced_sums(logits, vocab, h_BxLxD, w_NxDxC, targets_BxL, weights_BxL, key):
  """(sum of weighted NLL, sum of weighted log(Z)^2)."""
  return _sliced_sums_fwd(logits, vocab, h_BxLxD, w_NxDxC, targets_BxL, weights_BxL, key)[0]


def _sliced_sums_fwd(logits, vocab, h_BxLxD, w_NxDxC, targets_BxL, weights_BxL, key):
  n, _, size = w_NxDxC.shape
  rows = lambda x: shard(x, (BATCH, LENGTH))

  def body(carry, xs):
    running_max, scaled_sum, target_logit = carry
    c, w_DxC = xs
    out = _slice_logits(logits, vocab, n, h_BxLxD, w_DxC, c, key)
    new_max = jnp.maximum(running_max, jnp.max(out, axis=-1))
    scaled_sum = scaled_sum * jnp.exp(running_max - new_max) + jnp.sum(jnp.exp(out - new_max[..., None]), axis=-1)
    hit = _target_in_slice(targets_BxL, c, n, size)
    target_logit = target_logit + jnp.sum(jnp.where(hit, out, 0.0), axis=-1)
    return (rows(new_max), rows(scaled_sum), rows(target_logit)), None

  zeros = rows(jnp.zeros(targets_BxL.shape, F32))
  init = (rows(jnp.full(targets_BxL.shape, -jnp.inf, F32)), zeros, zeros)
  (running_max, scaled_sum, target_logit), _ = jax.lax.scan(body, init, (jnp.arange(n), w_NxDxC))
  lse_BxL = running_max + jnp.log(scaled_sum)
  sums = (jnp.sum((lse_BxL - target_logit) * weights_BxL), jnp.sum(lse_BxL * lse_BxL * weights_BxL))
  return sums, (h_BxLxD, w_NxDxC, targets_BxL, weights_BxL, key, lse_BxL)


def _sliced_sums_bwd(logits, vocab, residuals, g):
  h_BxLxD, w_NxDxC, targets_BxL, weights_BxL, key, lse_BxL = residuals
  n, _, size = w_NxDxC.shape
  g_nll, g_z = g
  # d/dlogits of w * (lse - target) and of w * lse^2: (w * (g_nll + 2 g_z lse)) * softmax - w * g_nll * onehot.
  softmax_coeff = (weights_BxL * (g_nll + 2.0 * g_z * lse_BxL))[..., None]
  target_coeff = (weights_BxL * g_nll)[..., None]

  def body(dh_BxLxD, xs):
    c, w_DxC = xs
    out, head_vjp = jax.vjp(lambda h, w: _slice_logits(logits, vocab, n, h, w, c, key), h_BxLxD, w_DxC)
    hit = _target_in_slice(targets_BxL, c, n, size)
    d_out = softmax_coeff * jnp.exp(out - lse_BxL[..., None]) - jnp.where(hit, target_coeff, 0.0)
    dh, dw_DxC = head_vjp(d_out)
    return shard(dh_BxLxD + dh.astype(F32), (BATCH, LENGTH, EMBED)), dw_DxC

  dh0 = shard(jnp.zeros(h_BxLxD.shape, F32), (BATCH, LENGTH, EMBED))
  dh_BxLxD, dw_NxDxC = jax.lax.scan(body, dh0, (jnp.arange(n), w_NxDxC))
  return dh_BxLxD.astype(h_BxLxD.dtype), dw_NxDxC, None, None, None


_sliced_sums.defvjp(_sliced_sums_fwd, _sliced_sums_bwd)
