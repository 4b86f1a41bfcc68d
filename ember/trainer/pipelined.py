"""A pipelined step: the decoder's layers in stages over the mesh axis `pipeline`, the step's micro-batches
flowing through them (the schedules, their bubbles and transfers: ember/parallel/pipeline.py).

Everything runs in one `shard_map` manual over `pipeline`. Inside, each stage holds its rows of the stacked
layers of the staged scan segment (parameters, delayed-scaling histories, health-statistics inputs); the
embedding, final norm and LM head are on every stage, and stage 0 embeds each micro-batch as it enters. A decoder of
several scan segments (ModelConfig.staged_segment: `first_k_dense` layers, a layer-specific `quant.exclude`)
splits its longest into the stages; the segments before it run on stage 0 ahead of its first chunk, those after it
on the last stage after its last, each from parameters on every stage (`_run_stage`). Two schedules:

- GPipe (`_loss`): the forward loop and the loss; the gradient is taken outside the map, so the backward pass is
  the loop's transpose (every transfer reversed). The last stage's outputs are spread over all stages after the
  loop (`from_last_stage`), so the head and the chunked loss run on 1 / S of the micro-batches each.
- 1F1B (`_one_f_one_b`): the gradients are taken inside, one micro-batch at a time, the last stage's loss in the
  tick of its forward pass, with the multi-token-prediction modules' where a model has them (`predict_ahead`).

Under context parallelism the micro-batches enter the balanced layout once, before the loop, and stay in it: the
stages hand each other balanced hidden states, and the head's losses and the embedding's gradient are sums over
tokens in any order (ember/parallel/context.py).

Either way the losses, MoE sums and per-layer statistics are summed (per-layer arrays gathered) over the stages,
and the step's terms are those of the micro-batch loop (objective.step_terms): a pipelined step logs and trains as
the same step on one device does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from ember import remat
from ember.config import Settings
from ember.layers import linear
from ember.layers.attention import attention_bias
from ember.layers.decoder import TABLE, keys_of, run_where
from ember.layers.embed import add_token_gradients
from ember.layers.mtp import depth_inputs as mtp_inputs
from ember.names import (AUX_KEYS, BACKWARD_SCOPE, BATCH, BY_LAYER, EMBED, INPUTS, LENGTH, MOE_LOAD_BALANCE_LOSS,
                         MOE_ROUTER_Z_LOSS, MOE_SEQ_BALANCE_LOSS, PIPELINE, POSITIONS, RUNS_OF_SCOPE, SEGMENT_IDS,
                         TARGETS, VOCAB)
from ember.parallel import context, pipeline, sharding
from ember.parallel.sharding import active_mesh, active_rules, logical_to_spec, shard, shard_map
from ember.quant import health
from ember.quant.varying import cotangent_once, shard_axes
from ember.trainer.loss import HeadOnce, cross_entropy, read_once, token_count, with_head_gradient
from ember.trainer.objective import (MTP_KEY, merged_model, micro_batches, replica_part, replicas_first, step_terms,
                                    summed_over_replicas)
from ember.trainer.state import split_over_replicas

F32 = jnp.float32
ACTIVATION = (BATCH, LENGTH, EMBED)  # A micro-batch's hidden states between stages.


# Prefixes of the per-layer values (`BY_LAYER`) of the segments before and after the staged one (`_run_stage`),
# and of the multi-token-prediction modules' layers (`_prediction_share`).
FRONT, BACK, AHEAD = "front:", "back:", "ahead:"


def stage_spec(path, staged: int) -> P:
  """A state leaf's PartitionSpec over `pipeline`: the rows of the staged segment's stacked layers
  (ModelConfig.staged_segment) are split into the stages (the `layers` rule), every other leaf is on every stage."""
  return P(PIPELINE) if _in_layers(path) and path[1].key == staged else P()


def _in_layers(path) -> bool:
  """Whether a state leaf belongs to the decoder's stacked layers (any scan segment's)."""
  return path[0].key == "segments"


def _rolled_ids(block_ids, cfg: Settings) -> jax.Array:
  """The staged segment's block ids in the order the stages run its rows: rolled forward past the blocks stage 0 runs
  ahead of them (pipeline.staged_rows), padding rows' first."""
  return jnp.asarray(np.roll(np.asarray(block_ids), cfg.model.pipeline_blocks(cfg.quant)[0]), jnp.int32)


def _staged_rows(key: str) -> bool:
  """Whether aux value `key` holds the staged segment's per-layer values (rows split into the stages)."""
  return key.endswith(BY_LAYER) and not key.startswith((FRONT, BACK, AHEAD))


def _run_stage(model, staged: int, x, segment_ids, positions, key, policy: remat.Preset, bias, *, first, last,
               runs: tuple[int, int], moe_plan=None, taken=None, **rows):
  """A stage's pass over a micro-batch: the segments before the staged one where `first` (stage 0's first chunk),
  the stage's rows of the staged segment (`rows`: Segment's `block_ids` and `rows_at`), the segments after it
  where `last` (the last stage's last chunk). (y, aux: the MoE sums and the per-layer values, the staged rows' under
  `BY_LAYER` keys and the others' under FRONT and BACK ones, zeros where they did not run.) The segments off the
  stages run under a `cond`: a stage that has none of them skips their work, and the stage that has them runs them
  in `runs` = (R, of N) of its passes (1F1B: on a micro-batch's ticks only), which the `cond`'s name scope tells
  the compile report (RUNS_OF_SCOPE)."""
  def edge(indices, on, x_, prefix):
    if not indices:
      return x_, {}
    with jax.named_scope(RUNS_OF_SCOPE.format(*runs)):
      x_, a, per_layer = run_where(on, lambda h: model.run_segments(indices, h, segment_ids, positions, key, policy,
                                                                    bias, moe_plan, taken), x_)
    return x_, {**a, **{prefix + k + BY_LAYER: v for k, v in per_layer.items()}}

  x, front = edge(range(staged), first, x, FRONT)
  # Where segments run off the stages, their stages skip the padding rows that stand in for them.
  y, a, per_layer = model.segments[staged](x, segment_ids, positions, key, policy, bias, moe_plan=moe_plan,
                                           taken=linear.handed(taken, "segments", staged),
                                           skip_padding=len(model.segments) > 1, **rows)
  y, back = edge(range(staged + 1, len(model.segments)), last, y, BACK)
  sums = {k: sum(part[k] for part in (a, front, back) if k in part) for k in AUX_KEYS}
  return y, {**sums, **{k + BY_LAYER: v for k, v in per_layer.items()},
             **{k: v for part in (front, back) for k, v in part.items() if k not in AUX_KEYS}}


def grads(state, batch, stats, key, *, graphdef, cfg: Settings, policy: remat.Preset, mesh: Mesh, batch_shards: int,
          replicas: tuple[str, ...] = (), param_specs=None, splits=None, moe_plan=None):
  """(metrics, (gradients, new quant state[, health statistics])) of one step over `train.grad_accum_steps`
  micro-batches in the pipeline: what the micro-batch loop (trainer/step.py's `_accumulate`) returns, with
  micro-batch i's stochastic rounding drawn from fold_in(key, i) as there.

  Over data- or expert-parallel `replicas` (state.replica_axes) the map is manual too: each replica runs the
  pipeline on its own rows (its keys folded with its index, as step.py's `_over_replicas`) and the gradients
  are reduced across the replicas once a step, in train.grad_reduce_dtype, not in every tick. `param_specs`:
  each parameter's spec over the replicas (an expert weight split over `expert` stays split); `splits`: where
  1F1B's schedules scatter a gradient over the replicas (trainer/state.py's `replica_splits`; GPipe's transpose
  sums it whole); `moe_plan`: what the MoE layers run (trainer/step.py's `moe_plan`)."""
  accum = cfg.train.grad_accum_steps
  count = token_count(batch[SEGMENT_IDS] > 0)
  micro = jax.tree.map(lambda a: micro_batches(a, accum, batch_shards), batch)
  if context.context_axes():  # Context parallelism: every micro-batch in the balanced layout, end to end (below).
    micro = dict(zip(micro, context.balance(tuple(micro.values()), (None, BATCH, LENGTH))))
  keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(accum))
  staged = cfg.model.staged_segment(cfg.quant)
  specs = lambda tree: jax.tree_util.tree_map_with_path(lambda path, _: stage_spec(path, staged), tree)
  with_stats = stats is not None
  trees = (state.params, state.quant_state) + ((stats,) if with_stats else ())
  param_in = specs(state.params)
  if replicas:
    micro = jax.tree.map(lambda a: replicas_first(a, mesh, sharding.batch_axes(active_rules(), mesh), replicas), micro)
    param_in = jax.tree.map(lambda stage, rep: P(stage[0] if stage else None, *rep[1:]) if stage else rep,
                            param_in, param_specs, is_leaf=lambda x: isinstance(x, P))
  in_specs = (param_in,) + tuple(specs(t) for t in trees[1:]) + (P(None, replicas) if replicas else P(), P(), P())
  manual = {PIPELINE, *replicas} | {a for a, n in mesh.shape.items() if n == 1}
  once = (PIPELINE, *replicas)  # Where a history's or statistic's "cotangent" is passed back once.
  reduce_dtype = jnp.dtype(cfg.quant.wgrad_dtype)

  run = _loss if cfg.pipeline.schedule == "gpipe" else _one_f_one_b
  stages, virtual = pipeline.stages(mesh), cfg.pipeline.virtual_stages
  front = cfg.model.pipeline_blocks(cfg.quant)[0]
  # The staged segment's rows rolled forward past the blocks stage 0 runs ahead of them (pipeline.staged_rows).
  rolled = lambda inverse: lambda tree: _map_stage_rows(
      lambda a: pipeline.roll_rows(a, front, stages, inverse=inverse), tree, staged)

  def body(params, quant_state, *rest):
    stats_, (micro_, keys_, count_) = (rest[0] if with_stats else None), rest[-3:]
    if replicas:
      keys_ = jax.vmap(lambda k: jax.random.fold_in(k, jax.lax.axis_index(replicas)))(keys_)
    params, quant_state, stats_ = map(rolled(False), (params, quant_state, stats_))
    if run is _loss:  # Autodiff rolls the gradients back.
      return _loss(params, quant_state, stats_, micro_, keys_, count_, graphdef=graphdef, cfg=cfg, policy=policy,
                   stages=stages, once=once, moe_plan=moe_plan)
    # Interleaved chunks: each stage's chunks moved to it for the schedule, the results moved back.
    chunks = lambda inverse: lambda tree: _map_stage_rows(
        lambda a: pipeline.to_chunks(a, stages, virtual, inverse=inverse), tree, staged)
    params, quant_state, stats_ = map(chunks(False), (params, quant_state, stats_))
    metrics, *outs = _one_f_one_b(params, quant_state, stats_, micro_, keys_, count_, graphdef=graphdef, cfg=cfg,
                                  policy=policy, stages=stages, virtual=virtual, moe_plan=moe_plan)
    outs = tuple(map(lambda tree: rolled(True)(chunks(True)(tree)), outs))
    outs = (summed_over_replicas(outs[0], replicas, param_specs, reduce_dtype, splits), *outs[1:])
    return metrics, outs if with_stats else outs[:2]

  if run is _one_f_one_b:  # The schedule takes the gradients itself.
    grad_out = param_in if splits is None else jax.tree.map(
        lambda p, spec, split: split_over_replicas(spec, p.ndim, split), state.params, param_in, splits)
    mapped = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=(P(), (grad_out, *in_specs[1:len(trees)])),
                           axis_names=manual, check_vma=False)
    return mapped(*trees, micro, keys, count)

  def loss(*trees_):  # Its transpose sums each parameter's gradient over the replicas, once.
    mapped = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=(P(), P()), axis_names=manual,
                           check_vma=False)
    return mapped(*trees_, micro, keys, count)

  argnums = tuple(range(len(trees)))
  (_, metrics), outs = jax.value_and_grad(loss, argnums=argnums, has_aux=True)(*trees)
  return metrics, outs


def _once_per_stage(tree, once: tuple[str, ...]):
  """A tree whose leaves' "cotangents" are global values (histories, statistics): passed back once over the
  replicas and, for the leaves outside the layers (on every stage, each stage's the same), the stages (`once`:
  pipeline first) rather than summed (varying.cotangent_once). A layer's is summed over the stages: its own
  stage's, or for a segment off the stages the one stage's that ran it, the others' zeros."""
  def one(path, a):
    over = once[1:] if _in_layers(path) else once
    return cotangent_once(a, over) if over else a
  return jax.tree_util.tree_map_with_path(one, tree)


def _loss(params, quant_state, stats, micro, keys, count, *, graphdef, cfg: Settings, policy: remat.Preset, stages: int,
          once: tuple[str, ...] = (PIPELINE,), moe_plan=None):
  """Inside the map over `pipeline`: (total loss, metrics) of the step, the same on every stage."""
  m = keys.shape[0]
  t_T = jnp.arange(pipeline.loop_length(m, stages, "gpipe"))
  stage = pipeline.stage_index()
  valid_T = (t_T >= stage) & (t_T < stage + m)  # Whether stage s has a micro-batch (t - s) at iteration t.
  quant_state = _once_per_stage(quant_state, once)
  taken_once = linear.once_a_step(merged_model(graphdef, params, quant_state, stats), policy.remat)  # Once a step.
  quant_T = pipeline.fan_out(quant_state, valid_T, jnp.maximum, pipeline.lowest)
  stats_T = None
  if stats is not None:
    stats_T = pipeline.fan_out(_once_per_stage(stats, once), valid_T, health.combine, health.combine_identity)
  model = merged_model(graphdef, params, quant_state, stats)
  staged = cfg.model.staged_segment(cfg.quant)
  segment = model.segments[staged]
  per_stage = len(segment.block_ids) // stages
  block_ids = jax.lax.dynamic_slice_in_dim(_rolled_ids(segment.block_ids, cfg), stage * per_stage, per_stage)
  inputs, segment_ids, positions = micro[INPUTS], micro[SEGMENT_IDS], micro[POSITIONS]

  def run(layers, x, segs, i, key):
    # The segments off the stages run in every iteration of their stage, a micro-batch's or not (its result is
    # dropped after): a predicate that varied by iteration made this program slower and 2 GiB larger.
    return _run_stage(layers, staged, x, segs, positions[i], key, policy, attention_bias(segs, x.dtype),
                      first=stage == 0, last=stage == stages - 1, runs=(len(t_T), len(t_T)), moe_plan=moe_plan,
                      taken=taken_once, block_ids=block_ids)

  def iteration(carry, xs):
    received, aux = carry
    t, quant, stat, valid = xs
    layers = merged_model(graphdef, params, quant, stat)
    i = jnp.clip(t - stage, 0, m - 1)
    x = jnp.where(stage == 0, layers.embed(inputs[i]), received)
    segs = jnp.where(valid, segment_ids[i], 0)  # Nothing to run: padding, which the layers map to zeros.
    y, a = run(layers, x, segs, i, keys[i])
    keep = lambda v: jnp.where(valid, v, jnp.zeros_like(v))
    y = shard(keep(y), ACTIVATION)
    aux = jax.tree.map(lambda acc, v: acc + keep(v).astype(F32), aux, a)
    return (pipeline.to_next_stage(y, stages), aux), y

  x0 = jax.eval_shape(model.embed, inputs[0])
  _, a0 = jax.eval_shape(lambda x: run(model, x, segment_ids[0], 0, None), x0)
  aux0 = jax.tree.map(lambda s: jnp.zeros(s.shape, F32), a0)
  (_, aux), ys = jax.lax.scan(iteration, (jnp.zeros(x0.shape, x0.dtype), aux0), (t_T, quant_T, stats_T, valid_T))
  # The last stage's outputs are those of its iterations S - 1, ..., S + M - 2: micro-batches 0, ..., M - 1.
  outputs = shard(ys[stages - 1:], (None, *ACTIVATION))
  # Each device's own rows: compiled over the compiler's axes, the reduce-scatter gathered its operand whole.
  spec = logical_to_spec((None, *ACTIVATION), active_rules(), active_mesh())
  shares = shard_map(lambda a: pipeline.from_last_stage(a, stages), mesh=active_mesh(), in_specs=(spec,),
                     out_specs=spec)(outputs)
  return _head_losses(model, shares, micro, keys, count, aux, cfg, stages)


def _head_losses(model, hidden_NxBxLxD, micro, keys, count, aux, cfg: Settings, stages: int):
  """The losses of this stage's share of the micro-batches (`from_last_stage`), summed over the stages with the
  layers' aux, as the step's terms."""
  share = hidden_NxBxLxD.shape[0]
  first = pipeline.stage_index() * share
  mine = lambda a: jax.lax.dynamic_slice_in_dim(a, first, share)
  head = model.head_parts()

  def one(total, xs):
    h, targets, segs, key = xs
    out = cross_entropy(model.final_norm(h), targets, (segs > 0).astype(F32), head, key=key,
                        chunk_size=cfg.train.loss_chunk_size, count=count, z_loss_weight=cfg.train.z_loss_weight)
    return jax.tree.map(jnp.add, total, out), None

  zero = jnp.zeros((), F32)
  losses, _ = jax.lax.scan(one, (zero, zero, zero),
                           (hidden_NxBxLxD, mine(micro[TARGETS]), mine(micro[SEGMENT_IDS]), mine(keys)))
  return _terms_over_stages(losses, aux, cfg, keys.shape[0], stages)


def _terms_over_stages(losses, aux: dict, cfg: Settings, micro_batches: int, stages: int, virtual: int = 1):
  """The step's (total loss, metrics) from each stage's sums: its (loss, ce, z) summed over the stages and the
  replicas, and its layers' aux: MoE sums summed over the stages, per-layer arrays in layer order (the staged
  segment's gathered from the stages, its padding rows' dropped, between those of the segments before and after it,
  which one stage ran). Each MoE statistic is a total over every token shard already, the replicas' included
  (layers/moe.py `aux_losses`): summed over the replicas again it would count each of their tokens R times."""
  total, ce, z, *ahead = jax.lax.psum(losses, (PIPELINE, *sorted(shard_axes())))  # `ahead`: [mtp_loss] or [].
  m = cfg.model
  front, staged, _ = m.pipeline_blocks(cfg.quant)
  edge = lambda prefix, k: [jax.lax.psum(aux[prefix + k], PIPELINE)] if prefix + k in aux else []
  rows = lambda v: jnp.roll(pipeline.from_pipeline_order(jax.lax.all_gather(v, PIPELINE, axis=0, tiled=True), stages,
                                                         virtual), -front * m.block_size, axis=0)
  by_layer = {k: jnp.concatenate(edge(FRONT, k) + [rows(v)[:staged * m.block_size]] + edge(BACK, k) + edge(AHEAD, k))
              for k, v in aux.items() if _staged_rows(k)}
  sums = {k: jax.lax.psum(aux[k], PIPELINE) for k in AUX_KEYS}
  return step_terms(total, ce, z, {**sums, **by_layer}, cfg, micro_batches, *ahead, replicas_summed_after=False)


def _one_f_one_b(params, quant_state, stats, micro, keys, count, *, graphdef, cfg: Settings, policy: remat.Preset,
                 stages: int, virtual: int, moe_plan=None):
  """Inside the map over `pipeline`, the 1F1B schedules (V = `virtual` chunks a stage: interleaved 1F1B where V > 1):
  (metrics, parameter gradients, new quant state, health statistics), the gradients taken here, one micro-batch's
  chunk at a time, instead of by autodiff of a loop.

  At each tick a stage runs the forward pass of one (micro-batch, chunk) and the backward pass of another
  (`pipeline.forward_unit` / `backward_unit`), each where it exists, and hands an output on and a gradient back
  (`ppermute`). The ticks before the first backward pass anywhere and after the last forward pass are traced
  without the pass they lack (`pipeline.phases`), so the idle share is the schedule's own, (S - 1) / (MV + S - 1).
  A stage keeps the residuals of the forward passes whose backward has not run (`pipeline.in_flight`) in a ring of
  buffers (`pipeline.ring_slots`, each forward pass's slot from `pipeline.ring_table`): the residuals a remat policy
  saves, on the device, or in host memory where it offloads them; the stage's parameters and what the step made
  once for its projections (kernel amaxes and quantized copies) are recognised among them and never copied, and the attention's segment bias is made again in the backward tick from
  the micro-batch's segment ids rather than kept ([B, 1, L, L]: 128 MiB a sequence of 8,192 tokens, in each of the
  ring's slots).
  The LM head runs where the last stage's last chunk ends a micro-batch: each stage takes 1/S of its tokens
  (`_head_share`), so every stage runs the same share of the head."""
  m = keys.shape[0]
  ring_order = virtual > 1
  stage = pipeline.stage_index()
  last = stage == stages - 1
  slots = pipeline.in_flight(m, stages, cfg.pipeline.schedule, virtual)
  slot_of = jnp.asarray(pipeline.ring_table(m, stages, virtual), jnp.int32)  # By position in the forward order.
  train = (params, quant_state, stats)
  whole = merged_model(graphdef, *train)
  taken_once = linear.once_a_step(whole, policy.remat)
  staged = cfg.model.staged_segment(cfg.quant)
  rows = len(whole.segments[staged].block_ids) // (stages * virtual)  # Layers per chunk.
  all_block_ids = _rolled_ids(whole.segments[staged].block_ids, cfg)
  # The stage's stacked blocks, whose rows each chunk's layers read where they lie (Segment's `rows_at`).
  stage_blocks = nnx.split(whole.segments[staged].blocks)[1]
  inputs, segment_ids, positions = micro[INPUTS], micro[SEGMENT_IDS], micro[POSITIONS]
  unit = lambda fn, tau: fn(tau, stage, m, stages, virtual)
  # Stage 0's and the last stage's own work runs in M of each pass's MV + S - 1 ticks: the share the compile report
  # is told for the `cond`s around it (RUNS_OF_SCOPE).
  edge_share = (m, pipeline.iterations(m * virtual, stages))

  def chunk(v):
    """Chunk v's (train state, what the step made once for its projections: `linear.once_a_step`): the stage's rows
    v * rows .. (v + 1) * rows of the stacked layers."""
    cut = lambda a: jax.lax.dynamic_slice_in_dim(a, v * rows, rows)
    state = tuple(_map_stage_rows(cut, t, staged) for t in train)
    return state, {p: jax.tree.map(cut, t) if p[:2] == ("segments", staged) else t for p, t in taken_once.items()}

  def forward(state, amaxes, x, f, v, has, bias):
    model = merged_model(graphdef, *state)
    block_ids = jax.lax.dynamic_slice_in_dim(all_block_ids, (v * stages + stage) * rows, rows)
    first, last_ = (has & e for e in edge_runs(v))
    y, a = _run_stage(model, staged, x, segment_ids[f], positions[f], keys[f], policy, bias, first=first,
                      last=last_, runs=edge_share, moe_plan=moe_plan, taken=amaxes, block_ids=block_ids,
                      rows_at=(stage_blocks, v * rows))
    return shard(y, ACTIVATION), a

  def edge_runs(v):
    """Whether chunk v of this stage runs the segments before the staged one, and those after it."""
    return (stage == 0) & (v == 0), last & (v == virtual - 1)

  def run_forward(x, f, v, has):
    """The forward pass of micro-batch f through chunk v (`has`: whether the tick has one): (y, aux, the VJP's
    leaves kept in the ring). The VJP's structure and, for each of its leaves, the index of the chunk's state or
    kernel amax it is (None: kept) go to `structure`, the same at every tick (a backward-only tick has no forward
    pass to read them from)."""
    state, amaxes = chunk(v)
    # Stage 0's first chunk starts from the embedding, looked up outside the VJP: its gradient is the input's,
    # added into the table's rows where the chunk's backward pass ends (`_with_embedding_gradient`). Looked up on
    # the micro-batches' ticks alone, under a `cond` (the other stages and ticks skip the lookup and its exchange).
    with jax.named_scope(RUNS_OF_SCOPE.format(*edge_share)):
      x = jax.lax.cond(has & (stage == 0) & (v == 0), lambda _: lookup(inputs[f]), lambda x_: x_, x)
    bias = attention_bias(segment_ids[f], x.dtype)
    # Differentiated: the chunk's rows and the segments off the stages, not the leaves outside the layers.
    rows_only = tuple(map(_layer_leaves, state))
    (y, aux), vjp = jax.vjp(lambda t, x_: forward(_filled(t, state), amaxes, x_, f, v, has, bias), rows_only, x)
    leaves, treedef = jax.tree.flatten(vjp)
    sources = {}
    for i, a in enumerate(jax.tree.leaves((state, amaxes, stage_blocks, bias))):
      sources.setdefault(id(a), i)
    structure.update(treedef=treedef, fixed=[sources.get(id(a)) for a in leaves])
    kept = [a for a, i in zip(leaves, structure["fixed"]) if i is None]
    structure["spaces"] = [jax.typeof(a).memory_space for a in kept]  # Host: a policy's offloaded residuals.
    return y, aux, kept

  lookup = merged_model(graphdef, *train).embed  # A model of its own: its table is replaced below.
  # The table cast and gathered along `embed` once a step, as each tick's lookup reads it (layers/embed.py), not in
  # every tick (the barrier keeps XLA from sinking the cast and the gather into the loop).
  table = shard(lookup.embedding[...].astype(lookup.dtype), (VOCAB, None))
  lookup.embedding.set_value(jax.lax.optimization_barrier(table))
  # The LM head read once a step too (loss.py's `read_once`), its weight gathered over the axes that split a stage's
  # tokens and each device's share of its gradient summed over the head ticks and reduced once, after the loop:
  # read in each head tick, the weight was gathered and its [D, V] float32 gradient reduce-scattered once a
  # micro-batch, the step's largest collectives after the layers' own, issued where nothing was left to hide them.
  head_parts = whole.head_parts()
  once = read_once(head_parts)
  if once is not None:
    once = HeadOnce(jax.lax.optimization_barrier(once.weight), once.partial)
  x_like = jax.eval_shape(lookup, inputs[0])  # In the compute dtype.
  x_zero = jnp.zeros(x_like.shape, x_like.dtype)
  structure = {}
  index = jax.ShapeDtypeStruct((), jnp.int32)
  _, aux_like, shapes = jax.eval_shape(run_forward, x_zero, index, index, jax.ShapeDtypeStruct((), jnp.bool_))
  # Offloaded residuals' slots lie in host memory, as the policy put them.
  ring0 = [_ring(pipeline.ring_slots(m, stages, virtual), s, space) for s, space in zip(shapes, structure["spaces"])]
  stage_rows = lambda k, a: (virtual * a.shape[0], *a.shape[1:]) if _staged_rows(k) else a.shape
  f32_zeros = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, F32), tree)
  acc0 = (f32_zeros(params), jax.tree.map(lambda a: pipeline.lowest(a.shape), quant_state),
          None if stats is None else jax.tree.map(lambda a: health.combine_identity(a.shape), stats),
          {k: jnp.zeros(stage_rows(k, a), F32) for k, a in aux_like.items()},
          jnp.zeros((4 if cfg.model.mtp_depth else 3,), F32),
          None if once is None else jnp.zeros_like(once.partial))

  # The MoE auxiliary losses' share of the step's loss (objective.step_terms): their cotangents in every backward pass.
  routed = cfg.model.num_routed_layers * m
  weights = {MOE_LOAD_BALANCE_LOSS: cfg.model.load_balance_weight, MOE_ROUTER_Z_LOSS: cfg.model.router_z_weight,
             MOE_SEQ_BALANCE_LOSS: cfg.model.seq_load_balance_weight}
  # Fed on the first replica alone (`replica_part`): each statistic is reduced over the replicas' tokens inside the
  # layer, whose transpose sums the replicas' cotangents.
  aux_cotangent = {k: replica_part(jnp.full(a.shape, weights.get(k, 0.0) / routed if routed else 0.0, a.dtype))
                   for k, a in aux_like.items()}
  take = lambda on, v: jnp.where(on, v, jnp.zeros_like(v))
  # Where a backward pass's input gradient is sent. Sent as it is made, at the end of a tick, the transfer overlaps
  # nothing (the loop's next iteration needs it first); sent at the top of the next tick, it overlaps that tick's
  # forward pass, but holds the one stream XLA runs collectives on while the forward pass's tensor-parallel
  # collectives wait for it. So at the top where `tensor` splits nothing (docs/parallelism.md, "Schedules and their
  # bubbles": llama3_70b's planner layout +1.2% predicted, Bridge's tensor 4 layout -3% had it been sent there).
  send_next_tick = active_mesh().shape["tensor"] == 1
  depths = cfg.model.mtp_depth

  def predict_ahead(state, y, f, on):
    """Multi-token prediction (layers/mtp.py) on micro-batch f's last hidden states `y` (the last stage's; the
    others run the modules on padding, which routes nothing, in the same time): ([mtp_loss] of this stage's share
    of the heads' tokens, the modules' aux, each depth's head's cotangents for `state`'s leaves (`_head_share`),
    the modules', the gradient of `y`, the head's weight-gradient shares (`once`), [(tokens, gradient) of each
    depth's embedding]). Its modules and LM heads run where the main head does, each depth's head on every stage's
    share of its tokens."""
    segs = jnp.where(last & on, segment_ids[f], 0)
    tokens = [mtp_inputs(micro[TARGETS][f], segs, k)[0] for k in range(1, depths + 1)]
    embedded = [lookup(t) for t in tokens]  # Looked up outside the VJP, as stage 0's (`_with_embedding_gradient`).
    bias = attention_bias(segs, y.dtype)

    def modules(leaves, y_, embedded_):
      model = merged_model(graphdef, *_filled(leaves, state))
      hs, sums, per_layer = model.predictions(y_, embedded_, segs, positions[f], keys[f], policy, bias, moe_plan,
                                              taken_once)
      return hs, {**sums, **{AHEAD + k + BY_LAYER: v for k, v in per_layer.items()}}

    (hs, a), vjp = jax.vjp(modules, tuple(map(_prediction_leaves, state)), y, embedded)
    losses, d_heads, d_hs, d_shares = [], [], [], 0.0
    for k, h_k in enumerate(hs, start=1):
      (loss_k, _), d_head_k, dh_k, shares_k = _head_share(
          state, h_k, f, graphdef=graphdef, micro=micro, keys=keys, count=count, cfg=cfg, stages=stages, once=once,
          head_param=head_parts.param, on=on, ahead=k, seed=cfg.model.mtp_loss_weight / depths)
      losses.append(loss_k)
      d_heads.append(d_head_k)
      d_hs.append(dh_k)
      if once is not None:
        d_shares = d_shares + shares_k
    d_leaves, dy, d_embedded = vjp((d_hs, {k: aux_cotangent.get(k, jnp.zeros_like(v)) for k, v in a.items()}))
    return [sum(losses) / depths], a, d_heads, d_leaves, dy, d_shares, list(zip(tokens, d_embedded))

  if depths:  # The modules' per-layer values, summed over the head ticks as the chunks' are over theirs.
    ahead_like = jax.eval_shape(lambda: predict_ahead(chunk(0)[0], x_zero, 0, jnp.bool_(True))[1])
    acc0 = (*acc0[:3], {**acc0[3], **{k: jnp.zeros(a.shape, F32) for k, a in ahead_like.items() if k not in acc0[3]}},
            *acc0[4:])

  def tick(carry, tau, *, forwards: bool, backwards: bool, head: bool):
    received, returned, ring, (grads, quant, stat, aux, losses, shares) = carry
    dy_head = None
    if backwards and send_next_tick:  # `returned` came unsent from the last tick.
      returned = pipeline.to_previous_stage(returned, stages, ring=ring_order)
    if forwards:
      f, v_f, has_f = unit(pipeline.forward_unit, tau)
      y, a, kept = run_forward(received, f, v_f, has_f)
      slot = jnp.where(has_f, slot_of[pipeline.forward_index(f, v_f, stages, virtual)], slots)  # The spare: slots.
      # A dynamic update, not `.at[slot].set`: a scatter drops an out-of-range update, which XLA lowers as a
      # select that reads the slot back (a third of the write's traffic again); `slot` is always in range.
      ring = [jax.lax.dynamic_update_index_in_dim(buf, r, slot, 0) for buf, r in zip(ring, kept)]
      aux = {k: acc if k not in a else _add_rows(acc, take(has_f, a[k]).astype(F32), v_f) if _staged_rows(k)
             else acc + take(has_f, a[k]).astype(F32) for k, acc in aux.items()}
      received = pipeline.to_next_stage(take(has_f, y), stages, ring=ring_order)
    if head:  # The LM head of the micro-batch the last stage's last chunk ends, where one does.
      f_last, v_last, has_last = pipeline.forward_unit(tau, stages - 1, m, stages, virtual)
      at_head = has_last & (v_last == virtual - 1)
      (total, parts), d_head, dy_head, d_shares = _head_share(
          chunk(v_f)[0], y, f_last, graphdef=graphdef, micro=micro, keys=keys, count=count, cfg=cfg, stages=stages,
          once=once, head_param=head_parts.param, on=at_head)
      if once is not None:
        shares = shares + d_shares  # Zero where no micro-batch ends (`on`).
      grads = _combine_shared(grads, d_head[0], at_head, jnp.add)
      quant = _combine_shared(quant, d_head[1], at_head, jnp.maximum)
      if stat is not None:
        stat = _combine_shared(stat, d_head[2], at_head, health.combine)
      ahead = []
      if depths:  # Multi-token prediction on the micro-batch's last hidden states, its gradient added to theirs.
        ahead, a, d_heads, d_ahead, dy_ahead, d_shares, embedded = predict_ahead(chunk(v_f)[0], y, f_last, at_head)
        dy_head = dy_head + dy_ahead
        if once is not None:
          shares = shares + d_shares
        for d in d_heads:  # Each depth's head, on every stage's share of its tokens.
          grads = _combine_shared(grads, d[0], at_head, jnp.add)
          quant = _combine_shared(quant, d[1], at_head, jnp.maximum)
          if stat is not None:
            stat = _combine_shared(stat, d[2], at_head, health.combine)
        on_last = at_head & last  # The stage whose hidden states the modules ran on.
        grads = _combine_shared(grads, d_ahead[0], on_last, jnp.add)
        for tokens_k, d_k in embedded:  # The modules' embeddings' gradients, into the table's rows.
          grads = _with_embedding_gradient(grads, tokens_k, d_k, on_last)
        quant = _combine_shared(quant, d_ahead[1], on_last, jnp.maximum)
        if stat is not None:
          stat = _combine_shared(stat, d_ahead[2], on_last, health.combine)
        aux = {k: acc + take(on_last, a[k]).astype(F32) if k in a else acc for k, acc in aux.items()}
      losses = losses + take(at_head, jnp.stack([total, *parts, *ahead]).astype(F32))
    if backwards:
      # Outside the VJP too (the cotangents' accumulation), named as the backward pass's for the compile report.
      with jax.named_scope(BACKWARD_SCOPE):
        b, v_b, has_b = unit(pipeline.backward_unit, tau)
        slot = slot_of[pipeline.forward_index(b, v_b, stages, virtual)]
        sources = jax.tree.leaves((*chunk(v_b), stage_blocks, attention_bias(segment_ids[b], x_zero.dtype)))
        kept = iter(buf[slot] for buf in ring)
        vjp = jax.tree.unflatten(structure["treedef"], [next(kept) if i is None else sources[i]
                                                         for i in structure["fixed"]])
        dy = returned if dy_head is None else jnp.where(last & (v_b == virtual - 1), dy_head, returned)
        d_state, dx = vjp((dy, aux_cotangent))
        ran = (has_b, *(has_b & e for e in edge_runs(v_b)))  # The chunk's rows; the segments before and after them.
        grads = _add_stage_rows(grads, d_state[0], v_b, ran, lambda acc, d: acc + d.astype(F32), staged)
        quant = _add_stage_rows(quant, d_state[1], v_b, ran, lambda acc, d: jnp.maximum(acc, d.astype(F32)), staged)
        if stat is not None:
          stat = _add_stage_rows(stat, d_state[2], v_b, ran, lambda acc, d: health.combine(acc, d.astype(F32)), staged)
        first = has_b & (stage == 0) & (v_b == 0)  # dx: the gradient of micro-batch b's embedding.
        grads = _with_embedding_gradient(grads, inputs[b], dx, first)
        returned = take(has_b, dx)
        if not send_next_tick:
          returned = pipeline.to_previous_stage(returned, stages, ring=ring_order)
    return (received, returned, ring, (grads, quant, stat, aux, losses, shares)), None

  def ticks(carry, start, length, **passes):
    return jax.lax.scan(functools.partial(tick, **passes), carry, start + jnp.arange(length))[0]

  def steady(carry, start, runs):  # Runs of ticks with and without the LM head, one after another.
    for length, head in runs:
      carry, start = ticks(carry, start, length, forwards=True, backwards=True, head=head), start + length
    return carry

  warm, steady_ticks, cool = pipeline.phases(m, stages, virtual)
  carry = ticks((x_zero, x_zero, ring0, acc0), 0, warm, forwards=True, backwards=False, head=False)
  # Under interleaved 1F1B the steady phase repeats a period of S ticks with the head and S (V - 1) without:
  # one loop over the periods, so the program holds each kind of tick once.
  runs = pipeline.steady_runs(m, stages, virtual)
  period, repeats = pipeline.periods(runs)
  span = sum(length for length, _ in period)
  start = warm
  if repeats > 1:
    carry, _ = jax.lax.scan(lambda c, t: (steady(c, t, period), None), carry, start + span * jnp.arange(repeats))
    runs, start = runs[len(period) * repeats:], start + span * repeats
  carry = steady(carry, start, runs)
  carry = ticks(carry, warm + steady_ticks, cool, forwards=False, backwards=True, head=False)
  grads, quant, stat, aux, losses, shares = carry[-1]
  if once is not None:
    grads = with_head_gradient(grads, head_parts, shares)
  return _gathered(params, quant_state, stats, grads, quant, stat, aux, losses, cfg, m, stages, virtual)


def _ring(slots: int, like, space):
  """A stage's ring of `slots` zero buffers like `like`, in memory space `space`: the device's, or the host's for a
  policy's offloaded residuals. (Zeroed on the device and moved over: a transient the ring's size, once a step.)"""
  zeros = jnp.zeros((slots, *like.shape), like.dtype)
  return zeros if space == jax.memory.Space.Device else jax.device_put(zeros, space)


def _map_stage_rows(fn, tree, staged: int):
  """`fn` on a tree's leaves split into the stages (the staged segment's stacked layers), the others as they are."""
  return jax.tree_util.tree_map_with_path(lambda path, a: fn(a) if stage_spec(path, staged) != P() else a, tree)


def _add_rows(acc, d, v):
  """acc [V * rows, ...] with d [rows, ...] added to chunk v's rows."""
  n = d.shape[0]
  return jax.lax.dynamic_update_slice_in_dim(acc, jax.lax.dynamic_slice_in_dim(acc, v * n, n) + d, v * n, 0)


def _add_stage_rows(acc_tree, d_tree, v, ran, combine, staged: int):
  """A backward pass's chunk-v cotangents (`_layer_leaves`') combined into the stage's accumulators: the staged
  segment's into chunk v's rows where `ran[0]`, a segment's before it whole where `ran[1]` and after it where
  `ran[2]` (the passes that ran them, `_run_stage`)."""
  def one(path, acc, d):
    if d is None:
      return acc
    if stage_spec(path, staged) == P():
      return jnp.where(ran[1 if path[1].key < staged else 2], combine(acc, d), acc)
    n = d.shape[0]
    cur = jax.lax.dynamic_slice_in_dim(acc, v * n, n)
    return jax.lax.dynamic_update_slice_in_dim(acc, jnp.where(ran[0], combine(cur, d), cur), v * n, 0)
  return jax.tree_util.tree_map_with_path(one, acc_tree, d_tree, is_leaf=lambda x: x is None)


def _prediction_leaves(tree):
  """`tree` with only the multi-token-prediction modules' leaves (on every stage), the others None."""
  return jax.tree_util.tree_map_with_path(lambda path, a: a if path[0].key == "mtp" else None, tree)


def _layer_leaves(tree):
  """`tree` with only the decoder's stacked-layer leaves (the stage's own rows of the staged segment, and the
  segments off the stages), the others None."""
  return jax.tree_util.tree_map_with_path(lambda path, a: a if _in_layers(path) else None, tree)


def _filled(part, whole):
  """`part` (a tree with None leaves) with its None leaves taken from `whole`."""
  return jax.tree.map(lambda a, p: a if p is None else p, whole, part)


def _with_embedding_gradient(grads, tokens_BxL, dx_BxLxD, on):
  """`grads` with the gradient of one micro-batch's embedding lookup added to the table's, where `on` (stage 0, as
  the backward pass of a micro-batch's first chunk ends): each token's gradient into its row, in the table's own
  layout and in float32 (layers/embed.py's `add_token_gradients`). Kept instead for a transpose after the loop, the
  step's input gradients were [M, B, L, D] on every stage (4 GiB a device on llama3_70b's planner layout). Masked,
  not under a `cond` as the lookup is: a `cond` in the backward tick kept XLA from overlapping the tick's
  collectives across it (Bridge's llama3_70b layout, docs/parallelism.md: 0.4 s a step later predicted)."""
  def add(path, g):
    if keys_of(path) != TABLE:
      return g
    return add_token_gradients(g, tokens_BxL, dx_BxLxD, on)
  return jax.tree_util.tree_map_with_path(add, grads)


def _shared_leaves(tree):
  """`tree` with its stacked-layer and multi-token-prediction leaves as None: the leaves the LM head reads, on every
  stage (embedding, final norm, head)."""
  return jax.tree_util.tree_map_with_path(lambda path, a: None if _in_layers(path) or path[0].key == "mtp" else a,
                                          tree)


def _combine_shared(acc_tree, d_tree, on, combine):
  """The head's cotangents (`_shared_leaves`' gradients, histories, statistics) combined into the leaves on every
  stage where `on` (None cotangents leave theirs as they are)."""
  def one(path, acc, d):
    if _in_layers(path) or d is None:
      return acc
    return jnp.where(on, combine(acc, d.astype(F32)), acc)
  return jax.tree_util.tree_map_with_path(one, acc_tree, d_tree, is_leaf=lambda x: x is None)


def _head_share(state, y, f, *, graphdef, micro, keys, count, cfg: Settings, stages: int, once: HeadOnce | None,
                head_param: tuple[str, ...], on, ahead: int = 0, seed: float = 1.0):
  """The LM head and loss of 1/S of the tokens of micro-batch f, whose hidden states `y` the last stage holds,
  on each stage: ((loss, (ce, z)) of the share, their cotangents for `state`'s leaves on every stage
  (`_shared_leaves`; None for the stacked layers', which the head does not read), the gradient of the whole `y` on
  every stage, and each device's share of the head's weight gradient where the step reads the head `once` (the
  weight's own cotangent, at `head_param`, then None), else None). The last stage's `y` is reduce-scattered over
  the stages along its length and the share's gradient all-gathered back: two transfers of an activation's size
  instead of S - 1 stages idling in the head. Where not `on` (no micro-batch ends here) every token weighs zero,
  so the shares' gradient is zero and adds to the step's as it is. `ahead` > 0: `y` is multi-token prediction's
  depth `ahead` (normed already; its targets, weights and rounding key as objective.forward_loss takes them), its
  loss's cotangent `seed` (its weight in the step's loss)."""
  spec = logical_to_spec(ACTIVATION, active_rules(), active_mesh())
  token_spec = P(*spec[:2])
  on_stages = lambda fn, specs, out: shard_map(fn, mesh=active_mesh(), in_specs=specs, out_specs=out)

  def share(a):  # This stage's contiguous 1/S of each device's positions.
    n = a.shape[1] // stages
    return jax.lax.dynamic_slice_in_dim(a, pipeline.stage_index() * n, n, axis=1)

  y_share = on_stages(lambda a: pipeline.from_last_stage(a, stages, axis=1), (spec,), spec)(y)
  targets, weights, key = micro[TARGETS][f], (micro[SEGMENT_IDS][f] > 0).astype(F32), keys[f]
  if ahead:
    _, targets, weights = mtp_inputs(targets, micro[SEGMENT_IDS][f], ahead)
    key = jax.random.fold_in(key, MTP_KEY + ahead)
  t_share, w_share = on_stages(lambda t, w: (share(t), share(w)), (token_spec, token_spec),
                               (token_spec, token_spec))(targets, weights)
  w_share = jnp.where(on, w_share, 0.0)

  def head(shared, h, partial):
    model = merged_model(graphdef, *_filled(shared, state))
    total, ce, z = cross_entropy(h if ahead else model.final_norm(h), t_share, w_share, model.head_parts(), key=key,
                                 chunk_size=cfg.train.loss_chunk_size, count=count,
                                 z_loss_weight=0.0 if ahead else cfg.train.z_loss_weight,
                                 once=None if once is None else HeadOnce(once.weight, partial))
    return total, (ce, z)

  total, vjp, parts = jax.vjp(head, tuple(map(_shared_leaves, state)), y_share,
                              None if once is None else once.partial, has_aux=True)
  d_state, dy_share, d_shares = vjp(jnp.full((), seed, F32))
  if once is not None:  # The weight's gradient is in the shares; its own cotangent is zeros.
    d_state = tuple(jax.tree_util.tree_map_with_path(lambda path, d: None if keys_of(path) == head_param else d,
                                                     tree, is_leaf=lambda x: x is None) for tree in d_state)
  dy = on_stages(lambda a: jax.lax.all_gather(a, PIPELINE, axis=1, tiled=True), (spec,), spec)(dy_share)
  return (total, parts), d_state, dy, d_shares


def _gathered(params, quant_state, stats, grads, quant, stat, aux, losses, cfg: Settings, m: int, stages: int,
              virtual: int):
  """The 1F1B loop's sums over the stages: each stage's rows of the staged segment stay its own; the leaves on every
  stage (embedding, final norm, head, the segments off the stages) sum their gradients over the stages and combine
  the statistics of the stages that ran them. (metrics, gradients, quant state, statistics)."""
  staged = cfg.model.staged_segment(cfg.quant)

  def over_stages(path, g, like, combine):
    return g.astype(like.dtype) if stage_spec(path, staged) != P() else combine(g).astype(like.dtype)
  grads = jax.tree_util.tree_map_with_path(
      lambda path, g, p: over_stages(path, g, p, lambda v: jax.lax.psum(v, PIPELINE)), grads, params)
  unused = lambda new, old: jnp.where(jnp.isfinite(new), new, old.astype(new.dtype))  # No micro-batch used it.
  quant = jax.tree_util.tree_map_with_path(
      lambda path, q, old: unused(over_stages(path, q, old, lambda v: jax.lax.pmax(v, PIPELINE)), old), quant,
      quant_state)
  if stat is not None:
    def combined(v):
      every = jax.lax.all_gather(v, PIPELINE)
      return functools.reduce(health.combine, [every[i] for i in range(stages)])
    stat = jax.tree_util.tree_map_with_path(lambda path, s_, old: over_stages(path, s_, old, combined), stat, stats)
  _, metrics = _terms_over_stages(losses, aux, cfg, m, stages, virtual)
  return metrics, grads, quant, stat
