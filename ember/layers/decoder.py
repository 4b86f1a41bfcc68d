"""The decoder: embedding, scanned blocks of layers, final norm, LM head.

Layers are stacked (a leading `layers` axis on every parameter, created with `nnx.vmap`) and run
under `jax.lax.scan`, so XLA compiles one block body whatever the depth, or, with `model.scan_layers`
False, one block after another on its row of the stacked parameters: a program as deep as the model, in
which each layer's saved activations are buffers of their own instead of slices the scan copies into a
stacked array (and zeroes first), the faster step. `jax.checkpoint` with the remat preset's policy wraps
each block (ember/remat.py), so the backward pass keeps one block's activations alive at a time.

A *block* is the repeating unit: one layer for dense models, `moe_every` layers (dense..., MoE)
when layers are interleaved. Consecutive blocks that quantize identically form a *segment*, one
scan each: `quant.exclude` entries that name particular layers (`layers[0]`) split the stack
into segments instead of branching inside the scanned body.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.extend
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from ember import remat
from ember.layers.attention import Attention, attention_bias
from ember.layers.embed import Embed
from ember.layers import linear
from ember.layers.linear import Linear, handed, projection_key
from ember.layers.mla import LatentAttention
from ember.layers import mtp as mtp_lib
from ember.layers.mlp import MLP
from ember.layers.moe import MoE
from ember.layers.norm import RMSNorm
from ember.config.model import ModelConfig
from ember.names import (AUX_KEYS, BATCH, BLOCK, BY_LAYER, EDGE_LAYERS, EMBED, LAYERS, LENGTH, LM_HEAD,
                         MOE_EXPERT_LOADS, MOE_LAYER_COUNTS, RESIDUAL, VOCAB)
from ember.parallel import context
from ember.parallel.sharding import active_mesh, active_rules, logical_to_spec, shard
from ember.quant import dot
from ember.quant.recipe import Recipe


def zero_aux() -> dict[str, jax.Array]:
  return {k: jnp.zeros((), jnp.float32) for k in AUX_KEYS}


def traced_once(fn: Callable, *args) -> tuple[Callable, object]:
  """(a function computing fn(*args) from fn's jaxpr, the shapes of fn's outputs), fn traced once. Where a program
  needs an output's shape before it calls fn (a `cond`'s other branch), `jax.eval_shape` would trace fn a second
  time. The jaxpr's operations are bound again as they are, their names (remat names, name stacks) included."""
  closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
  tree = jax.tree.structure(shapes)
  return (lambda *args_: jax.tree.unflatten(tree, jax.extend.core.jaxpr_as_fun(closed)(*jax.tree.leaves(args_))),
          shapes)


def run_where(on, fn: Callable, x, *rest):
  """fn(x, *rest) -> (y, *outs) where `on`, else (x, zeros like outs), the work not run at all (a `cond`): a
  pipeline stage's padding row, or the segments that another stage runs (ember/trainer/pipelined.py)."""
  run, shapes = traced_once(fn, x, *rest)
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes[1:])
  return jax.lax.cond(on, run, lambda x_, *_: (x_, *zeros), x, *rest)


class DecoderLayer(nnx.Module):
  def __init__(self, model: ModelConfig, recipe: Recipe, index: int, rngs: nnx.Rngs):
    norm = dict(eps=model.norm_eps, dtype=model.dtype, param_dtype=model.param_dtype)
    self.attn_norm = RMSNorm(model.d_model, **norm)
    self.attn = (LatentAttention if model.is_mla else Attention)(model, recipe=recipe, layer=index, rngs=rngs)
    self.mlp_norm = RMSNorm(model.d_model, **norm)
    self.is_moe = model.is_moe_layer(index)
    # Whether XLA's quantizer kernels read the norms (RMSNorm.residual): a per-tensor recipe's; a block-scaled
    # one's are Pallas kernels (quant/fused.py), which no norm is fused into.
    self.norm_into_quantizer = recipe.quantized and recipe.block_size == 1
    if self.is_moe:
      self.moe = MoE(model, recipe=recipe, layer=index, rngs=rngs)
    else:
      self.mlp = MLP(model, model.dense_width, recipe=recipe, layer=index, rngs=rngs)

  def __call__(self, x_BxLxD, segment_ids_BxL, positions_BxL, key=None, bias=None, moe_plan=None, taken=None):
    """`bias`: the attention's segment bias, made once for every layer (Transformer.__call__), or None;
    `moe_plan`: what an MoE layer runs (MoE.__call__); `taken`: what the step hands the layer's projections
    (layers/linear.py's `Taken`, by path below the layer), or None."""
    x_BxLxD = checkpoint_name(shard(x_BxLxD, RESIDUAL), remat.LAYER_INPUT)
    # The attention and MLP projections take their input on the residual stream's split (a sequence-parallel
    # share of the tokens) and gather it where their GEMMs read it, after quantizing under the per-tensor recipes
    # (layers/linear.py's `_sequence_parallel_axes`); an MoE block's routing takes its tokens whole on a tensor group.
    x_rows, normed_rows = self.attn_norm.residual(_residual_rows(x_BxLxD), into_quantizer=self.norm_into_quantizer)
    a_BxLxD = self.attn(normed_rows.reshape(x_BxLxD.shape), segment_ids_BxL, positions_BxL, key, bias,
                        handed(taken, "attn"))
    h_BxLxD = shard((x_rows + a_BxLxD.reshape(x_rows.shape)).reshape(x_BxLxD.shape), RESIDUAL)
    h_BxLxD = checkpoint_name(h_BxLxD, remat.ATTENTION_RESIDUAL)
    # An MoE block's output is its combine's, not a GEMM's: no epilogue to keep from writing in place.
    h_rows, normed_rows = self.mlp_norm.residual(h_BxLxD if self.is_moe else _residual_rows(h_BxLxD),
                                                    into_quantizer=self.norm_into_quantizer)
    normed_BxLxD = normed_rows.reshape(h_BxLxD.shape)
    if self.is_moe:
      y_BxLxD, aux = self.moe(shard(normed_BxLxD, BLOCK), segment_ids_BxL, key, moe_plan, handed(taken, "moe"))
    else:
      y_BxLxD, aux = self.mlp(normed_BxLxD, key, handed(taken, "mlp")), zero_aux()
    return shard((h_rows + y_BxLxD.reshape(h_rows.shape)).reshape(h_BxLxD.shape), RESIDUAL), aux

  def decode(self, x_BxTxD, positions_BxT, cache, valid_BxT):
    """The layer on T new tokens per row with a KV cache (Attention.decode); returns (y, cache). Tokens
    not `valid` (a prompt's padding) are not routed to experts (they take no expert capacity)."""
    a_BxTxD, cache = self.attn.decode(self.attn_norm(x_BxTxD), positions_BxT, cache)
    h_BxTxD = x_BxTxD + a_BxTxD
    if self.is_moe:
      y_BxTxD, _ = self.moe(self.mlp_norm(h_BxTxD), valid_BxT.astype(jnp.int32))
    else:
      y_BxTxD = self.mlp(self.mlp_norm(h_BxTxD))
    return h_BxTxD + y_BxTxD, cache


def _residual_rows(x_BxLxD: jax.Array) -> jax.Array:
  """What the residual add and its norm read: the residual stream as [tokens, D] rows, one value behind an
  optimization barrier. Why: XLA adds the residual in the epilogue of the GEMM that makes the other summand
  (cuBLASLt's C operand). For a [B, L, D] add it first bitcasts the residual to the GEMM's 2-D shape, and that
  fresh bitcast, read once, made it write the sum over the residual in place; the residual is still read after
  (the backward pass keeps it), so XLA copied it every add: 2 x 64 MiB a layer on llama3_8b at 8,192 tokens a GPU.
  Given one 2-D value with two readers, cuBLASLt writes the sum out of place and nothing is copied (llama3_8b's
  preset at Bridge's batch on 8 H100s: predicted 9.98 -> 9.93 s; docs/performance.md). Where the residual's length
  is split (sequence or context parallel) it stays [B, L, D]: rows of several sequences would not keep that split,
  and GSPMD would gather them."""
  rules = active_rules()
  if rules is not None and logical_to_spec(RESIDUAL, rules, active_mesh())[1] is not None:
    return x_BxLxD
  return jax.lax.optimization_barrier(x_BxLxD.reshape(-1, x_BxLxD.shape[-1]))


class Block(nnx.Module):
  """`model.block_size` consecutive layers starting at `first`: the body of one scan step."""

  def __init__(self, model: ModelConfig, recipe: Recipe, first: int, rngs: nnx.Rngs):
    self.layers = nnx.List([DecoderLayer(model, recipe, first + j, rngs) for j in range(model.block_size)])
    self.num_experts = model.num_experts

  def __call__(self, x, segment_ids, positions, key=None, bias=None, moe_plan=None, taken=None):
    """(x, aux summed over the block's layers, per layer [block_size, ...]: MOE_LAYER_COUNTS and, in MoE
    models, MOE_EXPERT_LOADS (zeros for dense layers))."""
    aux, per_layer = zero_aux(), []
    for j, layer in enumerate(self.layers):
      layer_key = None if key is None else jax.random.fold_in(key, j)
      x, a = layer(x, segment_ids, positions, layer_key, bias, moe_plan, handed(taken, "layers", j))
      aux = jax.tree.map(jnp.add, aux, {k: a[k] for k in AUX_KEYS})
      per_layer.append(a)
    by_layer = {k: jnp.stack([a[k] for a in per_layer]) for k in MOE_LAYER_COUNTS}
    if self.num_experts:
      none = jnp.zeros((self.num_experts,), jnp.float32)
      by_layer[MOE_EXPERT_LOADS] = jnp.stack([a.get(MOE_EXPERT_LOADS, none) for a in per_layer])
    return x, aux, by_layer

  def decode(self, x, positions, cache, valid):
    """`cache`: (k, v) [block_size, B, S, K, H] (MLA: latent [.., B, S, C], RoPE key [.., B, S, R]), one entry
    per layer of the block."""
    ks, vs = [], []
    for j, layer in enumerate(self.layers):
      x, (k, v) = layer.decode(x, positions, (cache[0][j], cache[1][j]), valid)
      ks.append(k)
      vs.append(v)
    return x, (jnp.stack(ks), jnp.stack(vs))


def unstacked(state, n: int) -> list:
  """The rows of a stacked state tree: one tree per block. By `lax.unstack`, whose transpose stacks the blocks'
  gradients back into one array (a slice per block would add up n zero-padded copies)."""
  leaves, treedef = jax.tree.flatten(state)
  rows = [jax.lax.unstack(leaf) for leaf in leaves]
  return [jax.tree.unflatten(treedef, [r[i] for r in rows]) for i in range(n)]


def rows_cut_ahead(model: nnx.Module, taken: dict) -> dict:
  """`taken` (linear.once_a_step of `model`) with each unrolled segment's stacked rows cut apart here
  (linear.cut_rows), for a loop of micro-batches to read: cut inside it, every micro-batch sliced each layer's
  amaxes, scales and quantized kernel shards again, a small kernel each that XLA does not hoist out of the loop
  (llama3_8b, fp8_current, unrolled, 16 micro-batches on h100x8: 1,056 kernels a micro-batch)."""
  unrolled = [tuple(path) + ("blocks",) for path, m in nnx.iter_graph(model) if isinstance(m, Segment) and not m.scan]
  ahead = lambda path: any(path[:len(u)] == u for u in unrolled)
  return {path: linear.cut_rows(t) if ahead(path) else t for path, t in taken.items()}


@jax.custom_vjp
def _row_where_it_lies(stacked, row, index):
  """`row` (stacked[index]; `index` an int or a traced one) read from `stacked`, its gradient `row`'s. An unrolled
  block's checkpoint keeps its inputs behind an optimization barrier (remat.checkpoint), and an input that is a
  slice is a copy: each layer's float32 parameters, copied row by row every step. Read inside the block, the slice
  fuses into its readers, and the barrier holds `stacked`, a buffer that exists anyway. A scan over rows of a
  larger stack (Segment's `rows_at`) reads them the same way: the rows it is handed are read by no one, and the
  compiler drops their copy."""
  del row
  return jax.lax.dynamic_index_in_dim(stacked, index, keepdims=False)


def _row_fwd(stacked, row, index):
  return _row_where_it_lies(stacked, row, index), None


def _row_bwd(_, g):
  return None, g, None


_row_where_it_lies.defvjp(_row_fwd, _row_bwd)


class Segment(nnx.Module):
  """Blocks `block_ids` stacked along a leading `layers` axis, run by one scan (`model.scan_layers`) or one after
  another."""

  def __init__(self, model: ModelConfig, recipe: Recipe, block_ids: Sequence[int], rngs: nnx.Rngs,
               staged: bool = True):
    """`block_ids` past the model's blocks are a pipeline's padding rows (parallel/pipeline.py, `padded_blocks`):
    their parameters are zeros, and their aux terms and per-layer values are dropped. `staged`: the segment a
    pipeline splits into stages (its rows along `layers`), else one the first or last stage runs whole (along
    `edge_layers`; ModelConfig.staged_segment)."""
    self.block_ids = tuple(block_ids)
    self.scan = model.scan_layers
    self.real_blocks = sum(b < model.num_blocks for b in self.block_ids)
    first = self.block_ids[0] * model.block_size

    @nnx.split_rngs(splits=len(self.block_ids))
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: LAYERS if staged else EDGE_LAYERS})
    def make(rngs):
      return Block(model, recipe, first, rngs)

    self.blocks = make(rngs)
    if self.real_blocks < len(self.block_ids):
      params = nnx.state(self.blocks, nnx.Param)
      nnx.update(self.blocks, jax.tree.map(lambda a: a.at[self.real_blocks:].set(0), params))

  def __call__(self, x, segment_ids, positions, key, policy: remat.Preset, bias=None, block_ids=None, moe_plan=None,
               taken=None, rows_at=None, skip_padding: bool = False):
    """(x, aux summed over the segment's layers, the block's per-layer values for each of its layers). `bias`:
    the attention's segment bias (Transformer.__call__): an input of every checkpointed block, never recomputed.
    `block_ids`: the blocks whose rows the stacked state holds (int32 [rows]; a pipeline stage's share of them,
    ember/parallel/pipeline.py); all of the segment's by default. `moe_plan`: what its MoE layers run; `taken`:
    what the step hands the projections (layers/linear.py's `Taken`, by path below the segment, per stacked row).
    `rows_at`: (stacked, first): the segment's state is rows first, first + 1, ... of `stacked` (a state of the
    same blocks with more rows: a pipeline stage's, whose chunk this segment runs); scanned, each block reads its
    row there (`_row_where_it_lies`), so no copy of the rows is made for the scan, and its gradient goes to the
    state's row. `skip_padding`: a padding row's block is not run at all (a `cond`), where a pipeline's stage runs
    other layers in its place (parallel/pipeline.py, `staged_rows`)."""
    graphdef, state = nnx.split(self.blocks)
    ids = jnp.asarray(self.block_ids, jnp.int32) if block_ids is None else block_ids
    taken = handed(taken, "blocks") or {}
    padded, num_blocks = self.real_blocks < len(self.block_ids), self.block_ids[0] + self.real_blocks

    def body(carry, xs, index=None):
      x, aux = carry
      block_state, block_id, block_taken = xs
      if index is not None:  # Unrolled: (stacked state, this block's rows); see _row_where_it_lies.
        block_state = jax.tree.map(lambda s, r: _row_where_it_lies(s, r, index), *block_state)
      block_key = None if key is None else jax.random.fold_in(key, block_id)
      run = lambda x_, state_: nnx.merge(graphdef, state_)(x_, segment_ids, positions, block_key, bias, moe_plan,
                                                           block_taken)
      if padded and skip_padding:
        y, a, per_layer = run_where(block_id < num_blocks, run, x, block_state)
      else:
        y, a, per_layer = run(x, block_state)
      if padded:  # A padding row is the identity; its MoE losses (of routing zeros) are not the model's.
        a = jax.tree.map(lambda v: jnp.where(block_id < num_blocks, v, jnp.zeros_like(v)), a)
      return (y, jax.tree.map(jnp.add, aux, a)), per_layer

    if self.scan and rows_at is not None:
      stacked, first = rows_at

      def in_place(carry, xs):
        rows, block_id, block_taken, index = xs
        return body(carry, (jax.tree.map(lambda s, r: _row_where_it_lies(s, r, index), stacked, rows), block_id,
                           block_taken))

      xs = (state, ids, taken, first + jnp.arange(ids.shape[0]))
      # Two blocks an iteration: a pipeline tick runs the chunk inside its own loop, where XLA's loop pipelining
      # does not reach, so a block's gradient reduce-scatter and weight gathers overlap only work of the same
      # iteration (llama3_70b, the planner's 2-layer chunks on h100x64: 1,234 -> 1,316 tokens/s/GPU predicted).
      (x, aux), per_layer = jax.lax.scan(remat.checkpoint(in_place, policy), (x, zero_aux()), xs, unroll=2)
    elif self.scan:
      (x, aux), per_layer = jax.lax.scan(remat.checkpoint(body, policy), (x, zero_aux()), (state, ids, taken))
    else:  # One block after another, on its row of the stacked state (kernel casts read theirs in place).
      stacked, carry, outs = linear.stacked_kernels(self.blocks), (x, zero_aux()), []
      in_place = jax.lax.stop_gradient(state)
      for index, rows in enumerate(unstacked(state, ids.shape[0])):
        step = remat.checkpoint(functools.partial(body, index=index), policy, scanned=False)
        carry, out = step(carry, ((in_place, rows), ids[index], linear.row_taken(taken, stacked, index)))
        outs.append(out)
      (x, aux), per_layer = carry, {k: jnp.stack([out[k] for out in outs]) for k in outs[0]}
    if block_ids is None:  # The whole segment: its real rows' values (a pipeline drops its padding's itself).
      per_layer = {k: v[:self.real_blocks] for k, v in per_layer.items()}
    return x, aux, {k: v.reshape(-1, *v.shape[2:]) for k, v in per_layer.items()}

  def decode(self, x, positions, cache, valid):
    """`cache`: (k, v) [blocks, block_size, B, S, K, H], scanned along with the blocks."""
    graphdef, state = nnx.split(self.blocks)

    def body(x, xs):
      block_state, k, v = xs
      return nnx.merge(graphdef, block_state).decode(x, positions, (k, v), valid)

    return jax.lax.scan(body, x, (state, *cache))


def segments_of(model: ModelConfig, recipe: Recipe) -> list[list[int]]:
  """The blocks of each scan segment under `recipe` (ModelConfig.segments)."""
  return model.segments(recipe)


@dataclasses.dataclass(frozen=True)
class LayerSlot:
  """Layer `layer` is `segments[segment].blocks.layers[j]` at `index` of the stacked leading axis."""
  layer: int
  segment: int
  index: int
  j: int


def layer_slots(model: ModelConfig, recipe: Recipe) -> list[LayerSlot]:
  """Where each layer's parameters (and statistics) live in the tree stacked under `recipe`, in layer order."""
  slots = []
  for s, block_ids in enumerate(segments_of(model, recipe)):
    for index, block in enumerate(block_ids):
      for j in range(model.block_size):
        slots.append(LayerSlot(block * model.block_size + j, s, index, j))
  return sorted(slots, key=lambda slot: slot.layer)


def tree_leaves(tree: dict, prefix: tuple = ()):
  """(path, leaf) of a pure-dict model state (params, quant state, statistics), depth first."""
  for key, value in tree.items():
    if isinstance(value, dict):
      yield from tree_leaves(value, prefix + (key,))
    else:
      yield prefix + (key,), value


def keys_of(key_path) -> tuple:
  """A jax key path (`tree_util.tree_map_with_path`) of a pure-dict state as the keys `tree_leaves` gives."""
  return tuple(k.key for k in key_path)


def stacked_layers(model: ModelConfig, recipe: Recipe, path: tuple) -> list[int] | None:
  """For a leaf of the stacked state at `path` (segments/s/blocks/layers/j/<path within the layer>): the
  layer at each index of its leading axis. None for leaves outside the layers (embedding, final norm, head)."""
  if path[0] != "segments":
    return None
  slots = [s for s in layer_slots(model, recipe) if s.segment == path[1] and s.j == path[4]]
  return [s.layer for s in sorted(slots, key=lambda s: s.index)]


def padded_rows(a: jax.Array, rows: int) -> jax.Array:
  """The layers' rows `a` [layers, ...] with zero rows after them up to `rows`: a stacked leaf's pipeline padding
  (Segment)."""
  return jnp.pad(a, [(0, rows - a.shape[0])] + [(0, 0)] * (a.ndim - 1)) if rows > a.shape[0] else a


def zero_padding_rows(tree: dict, model: ModelConfig, recipe: Recipe) -> dict:
  """A stacked state tree with its pipeline padding rows (those past the layers `stacked_layers` gives a leaf) set
  to zero: a delayed-scaling history's gradient row takes the amax of the residual stream's gradient even in a
  padding row, whose projections then multiply it by zeros."""
  def zeroed(key_path, a):
    layers = stacked_layers(model, recipe, keys_of(key_path))
    return a if layers is None or a.shape[0] == len(layers) else a.at[len(layers):].set(0)
  return jax.tree_util.tree_map_with_path(zeroed, tree)


def within_layer(path: tuple) -> tuple:
  """The part of a stacked leaf's path below its layer (e.g. ("attn", "qkv", "kernel"))."""
  return tuple(path[5:])


def rows_by_layer(tree: dict, model: ModelConfig, recipe: Recipe) -> dict:
  """{(layer, path below the layer): that layer's array} of a stacked state tree (params, quant state; (None,
  path) for leaves outside the layers). Keyed by layer, because `quant.exclude` regroups layers into other
  scan segments from one config to the next."""
  rows = {}
  for path, leaf in tree_leaves(tree):
    if not hasattr(leaf, "shape"):  # A masked optimizer state's placeholder (optax.MaskedNode): no array.
      continue
    layers = stacked_layers(model, recipe, path)
    if layers is None:
      rows[(None, path)] = leaf
    else:
      rows.update({(layer, within_layer(path)): leaf[index] for index, layer in enumerate(layers)})
  return rows


def stacked_like(row_of, model: ModelConfig, recipe: Recipe, like: dict) -> dict:
  """A state tree of `model` stacked under `recipe`, in the structure of `like` (e.g. abstract), each layer's row (or a leaf
  outside the layers) from `row_of(key, shape and dtype)`, with `rows_by_layer`'s keys: the inverse of
  `rows_by_layer` when the state was stacked under another `quant.exclude`."""
  def take(key_path, leaf):
    path = keys_of(key_path)
    layers = stacked_layers(model, recipe, path)
    if layers is None:
      return row_of((None, path), jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
    row = jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype)
    return padded_rows(jnp.stack([row_of((layer, within_layer(path)), row) for layer in layers]), leaf.shape[0])

  return jax.tree_util.tree_map_with_path(take, like)


class Transformer(nnx.Module):
  """Decoder-only LM. `__call__` returns the final normed hidden states; `head` maps them to logits
  (the loss applies it chunk by chunk so full [batch, length, vocab] logits never exist)."""

  def __init__(self, model: ModelConfig, recipe: Recipe, rngs: nnx.Rngs, blocks: int | None = None):
    """`recipe`: the precision phase's (Settings.quant); each projection runs it with `quant.exclude` applied.
    `blocks`: the stacked layers' rows (Settings.stacked_blocks), the staged segment's (ModelConfig.staged_segment)
    padded to them."""
    self.embed = Embed(model.vocab_size, model.d_model, init_std=model.init_std, dtype=model.dtype,
                       param_dtype=model.param_dtype, rngs=rngs)
    segments, staged = model.scan_segments(recipe)
    segments[staged] = segments[staged] + list(range(model.num_blocks, blocks or model.num_blocks))
    self.segments = nnx.List([Segment(model, recipe, ids, rngs, staged=i == staged) for i, ids in enumerate(segments)])
    self.num_blocks, self.num_experts = model.num_blocks, model.num_experts
    self.mtp = nnx.List([mtp_lib.PredictionModule(model, recipe, k, rngs, make_layer=DecoderLayer)
                         for k in range(1, model.mtp_depth + 1)])
    self.final_norm = RMSNorm(model.d_model, eps=model.norm_eps, dtype=model.dtype, param_dtype=model.param_dtype)
    self.tie_embeddings = model.tie_embeddings
    self.tied_wgrad_dtype = recipe.wgrad_out(model.param_dtype)  # The tied head's weight-gradient GEMM.
    self.cache_shapes = model.cache_shapes  # Per token: (k, v), or MLA's (latent, RoPE key).
    self.kv_dtype, self.max_len = model.dtype, model.seq_len
    if not model.tie_embeddings:
      # The loss calls the head once per token chunk, and delayed scaling's history update assumes
      # one call per step, so the head's recipe keeps no amax history (`Recipe.stateless`).
      self.lm_head = Linear((model.d_model,), (model.vocab_size,), (EMBED, VOCAB), name=LM_HEAD,
                            recipe=recipe.for_projection(LM_HEAD, None, model.num_layers).stateless(),
                            init_std=model.init_std, dtype=model.dtype, param_dtype=model.param_dtype, rngs=rngs)

  def __call__(self, tokens_BxL, segment_ids_BxL, positions_BxL, key=None,
               policy: remat.Preset = remat.PRESETS["none"], moe_plan=None):
    """(final normed hidden states [B, L, D], aux). `policy`: the remat preset each scanned block runs under, the
    one place it is applied (the train step passes the config's, ember/trainer/step.py); a forward pass alone
    needs none. `moe_plan`: what the MoE layers run, as the step decided it (trainer/step.py's `moe_plan`); None:
    each plans for its own batch."""
    h_BxLxD, aux, _ = self.with_predictions(tokens_BxL, segment_ids_BxL, positions_BxL, None, key, policy, moe_plan)
    return h_BxLxD, aux

  def with_predictions(self, tokens_BxL, segment_ids_BxL, positions_BxL, targets_BxL=None, key=None,
                       policy: remat.Preset = remat.PRESETS["none"], moe_plan=None, taken=None):
    """`__call__`, and with `targets_BxL` the multi-token-prediction modules' normed hidden states too (one [B, L,
    D] per depth, ember/layers/mtp.py; none without modules): (h, aux, [h_1, ...]). Their layers' statistics
    follow the decoder's in aux's per-layer arrays (rows num_layers, ...). `taken`: what the step hands the
    projections (layers/linear.py's `Taken`, by path: `linear.once_a_step` of this model), or None."""
    balanced = bool(context.context_axes())  # Context parallelism: its balanced layout (parallel/context.py).
    rows = (BATCH, LENGTH)
    depths = len(self.mtp) if targets_BxL is not None else 0
    # Each depth's tokens, taken from the targets in the batch's own layout (a shift along the length).
    ahead = [mtp_lib.depth_inputs(targets_BxL, segment_ids_BxL, k)[0] for k in range(1, depths + 1)]
    if balanced:
      tokens_BxL, segment_ids_BxL, positions_BxL, *ahead = context.balance(
          (tokens_BxL, segment_ids_BxL, positions_BxL, *ahead), rows)
    x = self.embed(tokens_BxL)
    bias = attention_bias(segment_ids_BxL, x.dtype)  # Once for every layer of every segment.
    x, aux, counts = self.run_segments(range(len(self.segments)), x, segment_ids_BxL, positions_BxL, key, policy, bias,
                                       moe_plan, taken)
    per_layer = [counts]
    predictions = []
    if ahead:
      predictions, a, counts = self.predictions(x, [self.embed(t) for t in ahead], segment_ids_BxL, positions_BxL,
                                                key, policy, bias, moe_plan, taken)
      aux = jax.tree.map(jnp.add, aux, a)
      per_layer.append({k: counts[k] for k in per_layer[0]})
      predictions = [context.unbalance(h_k, (BATCH, LENGTH, EMBED)) for h_k in predictions] if balanced else predictions
    for k in per_layer[0]:  # Segments are consecutive runs of layers, in order (then the prediction modules').
      aux[k + BY_LAYER] = jnp.concatenate([counts[k] for counts in per_layer])
    h_BxLxD = self.final_norm(x)
    return (context.unbalance(h_BxLxD, (BATCH, LENGTH, EMBED)) if balanced else h_BxLxD), aux, predictions

  def run_segments(self, indices, x, segment_ids, positions, key, policy: remat.Preset, bias, moe_plan=None,
                   taken=None):
    """Scan segments `indices` (consecutive, in order) on `x`: (their output, their layers' MoE sums, their per-layer
    values in layer order). `taken`: the model's (by path from it)."""
    aux, per_layer = zero_aux(), []
    for i in indices:
      x, a, counts = self.segments[i](x, segment_ids, positions, key, policy, bias, moe_plan=moe_plan,
                                      taken=handed(taken, "segments", i))
      aux = jax.tree.map(jnp.add, aux, a)
      per_layer.append(counts)
    return x, aux, {k: jnp.concatenate([c[k] for c in per_layer]) for k in per_layer[0]}

  def predictions(self, hidden, embedded: list, segment_ids, positions, key, policy: remat.Preset, bias,
                  moe_plan=None, taken=None):
    """The multi-token-prediction modules in their chain from the decoder's last hidden states (before the final
    norm), depth k embedding `embedded[k - 1]` (the tokens of mtp.depth_inputs): (one normed [B, L, D] hidden state
    a depth, their layers' MoE sums, their per-layer values [depths]). `taken`: the model's (by path from it)."""
    outs, aux, per_layer = [], zero_aux(), []
    for k, embedded_k in enumerate(embedded):
      hidden, h_k, a = self._predict(k, hidden, embedded_k, segment_ids, positions, key, policy, bias, moe_plan,
                                     handed(taken, "mtp", k))
      aux = jax.tree.map(jnp.add, aux, {name: a[name] for name in AUX_KEYS})
      per_layer.append({name: a[name] for name in (*MOE_LAYER_COUNTS, MOE_EXPERT_LOADS) if name in a})
      outs.append(h_k)
    return outs, aux, {name: jnp.stack([p[name] for p in per_layer]) for name in per_layer[0]}

  def _predict(self, k: int, hidden, embedded, segment_ids, positions, key, policy: remat.Preset, bias, moe_plan,
               taken):
    """Prediction module k (0-based) under the remat policy, its layer checkpointed like a block: (its hidden
    state, it normed, its layer's aux with MOE_LAYER_COUNTS and MOE_EXPERT_LOADS)."""
    graphdef, state = nnx.split(self.mtp[k])
    module_key = None if key is None else jax.random.fold_in(key, self.num_blocks + k)

    def run(state, hidden, embedded, taken):
      x, h, aux = nnx.merge(graphdef, state)(hidden, embedded, segment_ids, positions, module_key, bias, moe_plan,
                                             taken)
      if MOE_EXPERT_LOADS not in aux and self.num_experts:
        aux = dict(aux, **{MOE_EXPERT_LOADS: jnp.zeros((self.num_experts,), jnp.float32)})
      return x, h, aux

    return remat.checkpoint(run, policy, scanned=False)(state, hidden, embedded, taken)

  def init_cache(self, batch: int, length: int) -> list:
    """An empty KV cache of `length` positions for `batch` rows: per segment (k, v) [blocks, block_size, B,
    length, K, H] (MLA: its latent [.., C] and RoPE key [.., R]) in the compute dtype."""
    cache = []
    for segment in self.segments:
      blocks, size = len(segment.block_ids), len(segment.blocks.layers)
      cache.append(tuple(jnp.zeros((blocks, size, batch, length, *shape), self.kv_dtype)
                         for shape in self.cache_shapes))
    return cache

  def decode(self, tokens_BxT, positions_BxT, cache: list, valid_BxT=None):
    """Final hidden states of T new tokens per row at consecutive positions, attending to the KV cache
    (`init_cache`) and writing theirs into it: (h [B, T, D], cache). The same function as `__call__` on
    the whole sequence (one document per row), one step at a time. `valid_BxT`: False for padding
    (default: all valid)."""
    x = self.embed(tokens_BxT)
    valid_BxT = jnp.ones(tokens_BxT.shape, bool) if valid_BxT is None else valid_BxT
    new_cache = []
    for segment, segment_cache in zip(self.segments, cache):
      x, segment_cache = segment.decode(x, positions_BxT, segment_cache, valid_BxT)
      new_cache.append(segment_cache)
    return self.final_norm(x), new_cache

  def head(self, h_BxCxD, key=None):
    """Logits (float32) for a chunk of final hidden states (inference; training applies the head chunk by
    chunk inside the loss, `head_parts`)."""
    head = self.head_parts()
    return shard(head.logits(h_BxCxD, head.weight, key), (BATCH, LENGTH, VOCAB))

  def head_parts(self) -> Head:
    """The LM head as the loss applies it, once per token chunk (ember/trainer/loss.py)."""
    if self.tie_embeddings:
      return Head(functools.partial(_tied_logits, wgrad_dtype=self.tied_wgrad_dtype), self.embed.embedding[...].T,
                  read_dtype=self.embed.dtype, reduce_dtype=self.tied_wgrad_dtype, param=TABLE,
                  transposed=True)
    head = self.lm_head
    kernel = head.kernel[...]
    return Head(functools.partial(_linear_logits, recipe=head.recipe, dtype=head.dtype), kernel,
                read_dtype=kernel.dtype if head.recipe.quantized else head.dtype,
                reduce_dtype=head.recipe.wgrad_out(kernel.dtype), param=("lm_head", "kernel"))


TABLE = ("embed", "embedding")  # The embedding table's path in the model's state (a tied head's weight).


@dataclasses.dataclass(frozen=True)
class Head:
  """The LM head as the loss applies it (ember/trainer/loss.py).

  `logits(h [B, C, D], w [D, V], key)`: float32 logits, a pure function (the loss calls it once per token chunk
  and takes its VJP); `weight`: the parameter [D, V]; `read_dtype`: the dtype its GEMMs read the weight in (the
  compute dtype of an unquantized head; the parameter's own where a recipe quantizes it from there), which the
  loss gathers it in; `reduce_dtype`: what its weight gradient is reduced across devices in (Recipe.wgrad_out);
  `param`: the parameter's path in the model's state; `transposed`: `weight` is that parameter transposed (a tied
  head reads the embedding table [V, D])."""
  logits: Callable
  weight: jax.Array
  read_dtype: jnp.dtype
  reduce_dtype: jnp.dtype
  param: tuple[str, ...] = ()
  transposed: bool = False


def _tied_logits(h_BxCxD, w_DxV, key=None, *, wgrad_dtype):
  del key  # The tied head is never quantized.
  b, c, d = h_BxCxD.shape
  return dot.head_matmul(h_BxCxD.reshape(b * c, d), w_DxV, dtype=h_BxCxD.dtype,
                         wgrad_dtype=wgrad_dtype).reshape(b, c, -1)


def _linear_logits(h_BxCxD, w_DxV, key=None, *, recipe, dtype):
  b, c, d = h_BxCxD.shape
  if recipe.quantized:
    y = dot.quantized_matmul(h_BxCxD.reshape(b * c, d), w_DxV, recipe=recipe, name=LM_HEAD,
                             key=projection_key(key, LM_HEAD), dtype=dtype)
  else:  # Logits rounded to the compute dtype, as a projection's output.
    y = dot.head_matmul(h_BxCxD.reshape(b * c, d), w_DxV, dtype=dtype, wgrad_dtype=recipe.wgrad_out(w_DxV.dtype),
                        out_dtype=dtype)
  return y.reshape(b, c, -1).astype(jnp.float32)
