"""Token embedding; the decoder reuses its table as a tied LM head."""

import jax
import jax.numpy as jnp
from flax import nnx

from ember.names import BATCH, EMBED, LENGTH, VOCAB
from ember.parallel.sharding import shard


class Embed(nnx.Module):
  def __init__(self, vocab_size: int, dim: int, *, init_std: float, dtype, param_dtype, rngs: nnx.Rngs):
    table = jax.random.normal(rngs.params(), (vocab_size, dim), param_dtype) * init_std
    self.embedding = nnx.Param(table, out_sharding=(VOCAB, EMBED))
    self.dtype = dtype

  def __call__(self, tokens_BxL: jax.Array) -> jax.Array:
    x_BxLxD = jnp.take(self.embedding[...].astype(self.dtype), tokens_BxL, axis=0)
    return shard(x_BxLxD, (BATCH, LENGTH, EMBED))
