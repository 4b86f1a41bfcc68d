"""Token embedding; the decoder reuses its table as a tied LM head."""

import jax
import jax.numpy as jnp
from flax import nnx

from ember.names import BATCH, EMBED, LENGTH, VOCAB
from ember.parallel import context
from ember.parallel.sharding import active_mesh, shard
from ember.quant.varying import manual_axes


class Embed(nnx.Module):
  def __init__(self, vocab_size: int, dim: int, *, init_std: float, dtype, param_dtype, rngs: nnx.Rngs):
    table = jax.random.normal(rngs.params(), (vocab_size, dim), param_dtype) * init_std
    self.embedding = nnx.Param(table, out_sharding=(VOCAB, EMBED))
    self.dtype = dtype

  def __call__(self, tokens_BxL: jax.Array) -> jax.Array:
    table_VxD = self.embedding[...].astype(self.dtype)
    if context.context_axes() or _partitioner_aborts():
      # Looked up in a table sharded along `embed`, the rows come out split along `embed`, and XLA cannot move
      # them onto batch x length when both are split (it would replicate them): gather the table first. Inside a
      # map manual over some axes (a pipeline's stages, a step's replicas) XLA's partitioner aborts on that
      # lookup when two other axes are split (`_partitioner_aborts`): gathered, it does not.
      table_VxD = shard(table_VxD, (VOCAB, None))
    x_BxLxD = jnp.take(table_VxD, tokens_BxL, axis=0)
    return shard(x_BxLxD, (BATCH, LENGTH, EMBED))


def _partitioner_aborts() -> bool:
  """Whether XLA's partitioner would abort on the lookup (a check failure in spmd_partitioner_util.cc): inside a
  map manual over some mesh axes, with two or more of the others split."""
  mesh, manual = active_mesh(), manual_axes()
  if mesh is None or not manual:
    return False
  return sum(1 for a, n in mesh.shape.items() if n > 1 and a not in manual) >= 2
