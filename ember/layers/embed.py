"""Token embedding; the decoder reuses its table as a tied LM head."""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from ember.names import BATCH, EMBED, LENGTH, RESIDUAL, VOCAB
from ember.parallel import context
from ember.parallel.sharding import active_mesh, active_rules, logical_to_spec, shard, shard_map
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
      # them onto batch x length when both are split (it would replicate them); inside a map manual over some axes
      # (a pipeline's stages, a step's replicas) XLA's partitioner aborts on that lookup when two other axes are
      # split (`_partitioner_aborts`). Each device looks its own tokens up instead (`_lookup_on_each_device`).
      x_BxLxD = _lookup_on_each_device(table_VxD, tokens_BxL)
    else:
      x_BxLxD = jnp.take(table_VxD, tokens_BxL, axis=0)
    return shard(x_BxLxD, RESIDUAL)


def _partitioner_aborts() -> bool:
  """Whether XLA's partitioner would abort on the lookup (a check failure in spmd_partitioner_util.cc): inside a
  map manual over some mesh axes, with two or more of the others split."""
  mesh, manual = active_mesh(), manual_axes()
  if mesh is None or not manual:
    return False
  return sum(1 for a, n in mesh.shape.items() if n > 1 and a not in manual) >= 2


def _lookup_on_each_device(table_VxD, tokens_BxL):
  """The lookup on each device's own tokens, in its rows of the table gathered along `embed` (vocabulary-parallel
  where `vocab` is split: each device takes the tokens in its rows, zeros for the others, summed over the vocab
  axes). Why: left to XLA, the backward pass's scatter-add gathered every device's token gradients whole
  ([tokens of all batch devices, d_model], 16 GiB a micro-batch on llama3_405b over 1,024 GPUs) onto each table
  shard; here each device adds its own tokens' gradients into its rows, and the map's transpose sums those partial
  tables over the batch devices."""
  spec, vocab_axes = _specs_and_vocab_axes()

  def lookup(table, tokens):
    rows = table.shape[0]
    local, inside = _rows_here(tokens, rows, vocab_axes)
    x = jnp.where(inside[..., None], jnp.take(table, jnp.clip(local, 0, rows - 1), axis=0), 0)
    return jax.lax.psum(x, vocab_axes) if vocab_axes else x

  return shard_map(lookup, mesh=active_mesh(), in_specs=(spec((VOCAB, None)), spec((BATCH, LENGTH))),
                   out_specs=spec((BATCH, LENGTH, None)))(table_VxD, tokens_BxL)


def add_token_gradients(grad_VxD, tokens_BxL, dx_BxLxD, on):
  """`grad_VxD`, a gradient laid out as the table (`vocab` x `embed`), with each token's gradient `dx` added to its
  row where `on` (a boolean scalar): the lookup's transpose for one batch, accumulated in place. Each device takes
  every token of the batch in its own columns (dx moved from split by token to split by column: an exchange of the
  batch's activations' size) and adds those that fall in its rows, so nothing of the table's size is made or moved
  (a pipeline's stage 0 adds each micro-batch's as its backward pass ends, trainer/pipelined.py). Where not `on` every
  add is dropped: no branch, which would copy the gradient (and a collective in a branch that some devices skip
  would wait for them forever)."""
  spec, vocab_axes = _specs_and_vocab_axes()

  def add(acc, tokens, dx, on):
    rows = acc.shape[0]
    local, inside = _rows_here(tokens, rows, vocab_axes)
    return acc.at[jnp.where(inside & on, local, rows)].add(dx.astype(acc.dtype), mode="drop")

  return shard_map(add, mesh=active_mesh(), in_specs=(spec((VOCAB, EMBED)), P(), spec((None, None, EMBED)), P()),
                   out_specs=spec((VOCAB, EMBED)))(grad_VxD, tokens_BxL, dx_BxLxD, on)


def _specs_and_vocab_axes():
  """(logical names -> PartitionSpec on the active mesh, the mesh axes not manual here that split `vocab`)."""
  mesh, rules = active_mesh(), active_rules()
  spec = lambda names: logical_to_spec(names, rules, mesh)
  return spec, tuple(a for a in jax.tree.leaves(tuple(spec((VOCAB,)))) if a not in manual_axes())


def _rows_here(tokens, rows: int, vocab_axes: tuple[str, ...]):
  """(each token's index among this device's `rows` of a table split along `vocab_axes`, whether it lies in them)."""
  local = tokens - rows * (jax.lax.axis_index(vocab_axes) if vocab_axes else 0)
  return local, (local >= 0) & (local < rows)
