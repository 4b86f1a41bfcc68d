"""KV-cached generation: one jitted prefill of the prompts, then one jitted loop of single-token steps.

Prompts of different lengths share a batch, right-padded: each row's new tokens go at its own next
position, and the cache slot of a position is written before any query can see it (slot s is
visible to a query at position p when s <= p), so the padding is never attended to. The decoding
function is the training forward pass one step at a time (`Transformer.decode`); a test holds the
two to the same logits.

Sampling: temperature 0 is greedy (argmax); otherwise logits / temperature, cut to the smallest set
of tokens whose probability reaches `top_p` (nucleus), drawn with a key folded from the seed and
the step.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ember.errors import warn
from ember.layers.decoder import Transformer


def pick(logits_BxV: jax.Array, key: jax.Array, temperature: float, top_p: float,
         vocab: int | None = None) -> jax.Array:
  """The next token of each row (int32 [B]), below `vocab` (the tokenizer's ids; None: any row of the head): the
  head's rows past the tokenizer's, padding to a multiple of 128, are no token."""
  if vocab is not None and vocab < logits_BxV.shape[-1]:
    logits_BxV = jnp.where(jnp.arange(logits_BxV.shape[-1]) < vocab, logits_BxV, -jnp.inf)
  if temperature == 0:
    return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
  logits = logits_BxV.astype(jnp.float32) / temperature
  if top_p < 1:
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # Probability of the tokens ranked above each one.
    sorted_logits = jnp.where(before < top_p, sorted_logits, -jnp.inf)  # The top token always stays.
    logits = jnp.full_like(logits, -jnp.inf).at[jnp.arange(logits.shape[0])[:, None], order].set(sorted_logits)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "cache_len"))
def _prefill(graphdef, state, tokens_BxP, lengths_B, cache_len: int):
  model: Transformer = nnx.merge(graphdef, state)
  b, p = tokens_BxP.shape
  positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
  h_BxPxD, cache = model.decode(tokens_BxP, positions, model.init_cache(b, cache_len),
                                valid_BxT=positions < lengths_B[:, None])
  last_Bx1xD = jnp.take_along_axis(h_BxPxD, (lengths_B - 1)[:, None, None], axis=1)
  return model.head(last_Bx1xD)[:, 0], cache


@functools.partial(jax.jit, static_argnames=("graphdef", "steps", "temperature", "top_p", "vocab"))
def _decode(graphdef, state, logits_BxV, cache, lengths_B, key, steps: int, temperature: float, top_p: float,
            vocab: int | None):
  model: Transformer = nnx.merge(graphdef, state)

  def step(carry, t):
    logits, cache = carry
    token_B = pick(logits, jax.random.fold_in(key, t), temperature, top_p, vocab)
    h, cache = model.decode(token_B[:, None], (lengths_B + t)[:, None], cache)
    return (model.head(h)[:, 0], cache), token_B

  _, tokens_NxB = jax.lax.scan(step, (logits_BxV, cache), jnp.arange(steps, dtype=jnp.int32))
  return tokens_NxB.T


@functools.partial(jax.jit, static_argnames=("graphdef", "steps", "temperature", "top_p", "vocab"))
def _uncached(graphdef, state, tokens_BxN, lengths_B, key, steps: int, temperature: float, top_p: float,
              vocab: int | None):
  """`_prefill` and `_decode` without a cache: each new token from the whole forward pass over the row so far
  (the rows padded to their final length, the padding a segment of its own that no token attends to)."""
  model: Transformer = nnx.merge(graphdef, state)
  b, n = tokens_BxN.shape
  positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))

  def step(tokens, t):
    length = lengths_B + t
    segments = jnp.where(positions < length[:, None], 1, 2).astype(jnp.int32)
    h, _ = model(tokens, segments, positions)
    last = jnp.take_along_axis(h, (length - 1)[:, None, None], axis=1)
    token_B = pick(model.head(last)[:, 0], jax.random.fold_in(key, t), temperature, top_p, vocab)
    return tokens.at[jnp.arange(b), length].set(token_B, mode="drop"), token_B

  _, tokens_NxB = jax.lax.scan(step, tokens_BxN, jnp.arange(steps, dtype=jnp.int32))
  return tokens_NxB.T


def cache_bytes_per_token(model: Transformer) -> int:
  """What sampling caches per token: over every layer, K and V (MLA: its latent and RoPE key) in the compute dtype."""
  values = sum(int(np.prod(shape)) for shape in model.cache_shapes)
  layers = sum(len(segment.block_ids) * len(segment.blocks.layers) for segment in model.segments)
  return values * layers * jnp.dtype(model.kv_dtype).itemsize


def generate(model: Transformer, prompts: Sequence[np.ndarray], *, max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, batch_multiple: int = 1, cache: bool = True,
             vocab: int | None = None) -> list[np.ndarray]:
  """`max_new_tokens` new tokens after each prompt (a non-empty int sequence). `batch_multiple` pads the
  batch with copies of the first prompt to a multiple of the devices its rows are sharded over. `cache=False`
  runs the whole forward pass for every new token (the reference the cache is held to). `vocab`: the tokenizer's
  vocabulary, below which every new token is (`pick`)."""
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError("every prompt needs at least one token")
  rows = len(prompts) + (-len(prompts) % batch_multiple)
  padded = list(prompts) + [prompts[0]] * (rows - len(prompts))
  lengths = np.asarray([len(p) for p in padded], np.int32)
  tokens = np.zeros((rows, int(lengths.max())), np.int32)
  for i, p in enumerate(padded):
    tokens[i, : len(p)] = p
  if int(lengths.max()) + max_new_tokens > model.max_len:
    warn(f"prompt and new tokens reach position {int(lengths.max()) + max_new_tokens}, past the "
         f"{model.max_len} positions the model was trained on")
  graphdef, state = nnx.split(model)
  if not cache:
    whole = np.pad(tokens, ((0, 0), (0, max_new_tokens)))
    out = _uncached(graphdef, state, whole, lengths, jax.random.key(seed), steps=max_new_tokens,
                    temperature=float(temperature), top_p=float(top_p), vocab=vocab)
    return list(np.asarray(out)[: len(prompts)])
  logits, kv = _prefill(graphdef, state, tokens, lengths, cache_len=int(lengths.max()) + max_new_tokens)
  out = _decode(graphdef, state, logits, kv, lengths, jax.random.key(seed), steps=max_new_tokens,
                temperature=float(temperature), top_p=float(top_p), vocab=vocab)
  return list(np.asarray(out)[: len(prompts)])
