"""A pipelined step: the decoder's layers in stages over the mesh axis `pipeline`, the step's micro-batches
flowing through them (the schedules, their bubbles and transfers: ember/parallel/pipeline.py).

Everything runs in one `shard_map` manual over `pipeline`. Inside, each stage holds its rows of the stacked
layers (parameters, delayed-scaling histories, health-statistics inputs); the embedding, final norm and LM head
are on every stage, and stage 0 embeds each micro-batch as it enters. Two schedules:

- GPipe (`_loss`): the forward loop and the loss; the gradient is taken outside the map, so the backward pass is
  the loop's transpose (every transfer reversed). The last stage's outputs are spread over all stages after the
  loop (`from_last_stage`), so the head and the chunked loss run on 1 / S of the micro-batches each.
- 1F1B (`_one_f_one_b`): the gradients are taken inside, one micro-batch at a time, the last stage's loss in the
  tick of its forward pass.

Either way the losses, MoE sums and per-layer statistics are summed (per-layer arrays gathered) over the stages,
and the step's terms are those of the micro-batch loop (objective.step_terms): a pipelined step logs and trains as
the same step on one device does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from ember import remat
from ember.layers import linear
from ember.layers.attention import attention_bias
from ember.names import (AUX_KEYS, BATCH, BY_LAYER, EMBED, INPUTS, LENGTH, MOE_LOAD_BALANCE_LOSS, MOE_ROUTER_Z_LOSS,
                         MOE_SEQ_BALANCE_LOSS, PIPELINE, POSITIONS, SEGMENT_IDS, TARGETS)
from ember.parallel import pipeline
from ember.parallel.sharding import active_mesh, active_rules, logical_to_spec, shard, shard_map
from ember.quant import health
from ember.quant.varying import cotangent_once
from ember.trainer.loss import cross_entropy, token_count
from ember.trainer.objective import merged_model, micro_batches, step_terms

F32 = jnp.float32
ACTIVATION = (BATCH, LENGTH, EMBED)  # A micro-batch's hidden states between stages.


def stage_spec(path) -> P:
  """A state leaf's PartitionSpec over `pipeline`: the stacked layers' rows are split into the stages (the
  `layers` rule), every other leaf is on every stage."""
  return P(PIPELINE) if path[0].key == "segments" else P()


def grads(state, batch, stats, key, *, graphdef, cfg, policy: remat.Preset, mesh: Mesh, batch_shards: int):
  """(metrics, (gradients, new quant state[, health statistics])) of one step over `train.grad_accum_steps`
  micro-batches in the pipeline: what the micro-batch loop (trainer/step.py's `_accumulate`) returns, with
  micro-batch i's stochastic rounding drawn from fold_in(key, i) as there."""
  accum = cfg.train.grad_accum_steps
  count = token_count(batch[SEGMENT_IDS] > 0)
  micro = jax.tree.map(lambda a: micro_batches(a, accum, batch_shards), batch)
  keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(accum))
  specs = lambda tree: jax.tree_util.tree_map_with_path(lambda path, _: stage_spec(path), tree)
  with_stats = stats is not None
  trees = (state.params, state.quant_state) + ((stats,) if with_stats else ())
  in_specs = tuple(specs(t) for t in trees) + (P(), P(), P())
  manual = {PIPELINE} | {a for a, n in mesh.shape.items() if n == 1}

  run = _one_f_one_b if cfg.pipeline.schedule == "1f1b" else _loss

  def body(params, quant_state, *rest):
    stats_, (micro_, keys_, count_) = (rest[0] if with_stats else None), rest[-3:]
    out = run(params, quant_state, stats_, micro_, keys_, count_, graphdef=graphdef, cfg=cfg, policy=policy,
              stages=pipeline.stages(mesh))
    return out if run is _loss else (out[0], out[1:] if with_stats else out[1:3])

  if run is _one_f_one_b:  # The schedule takes the gradients itself.
    mapped = shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=(P(), in_specs[:len(trees)]),
                       axis_names=manual, check_vma=False)
    return mapped(*trees, micro, keys, count)

  def loss(*trees_):
    mapped = shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=(P(), P()), axis_names=manual,
                       check_vma=False)
    return mapped(*trees_, micro, keys, count)

  argnums = tuple(range(len(trees)))
  (_, metrics), outs = jax.value_and_grad(loss, argnums=argnums, has_aux=True)(*trees)
  return metrics, outs


def _once_per_stage(tree):
  """A tree whose non-stage leaves' "cotangents" are global values (histories, statistics): passed back once
  over the stages rather than summed (varying.cotangent_once)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, a: a if stage_spec(path) != P() else cotangent_once(a, (PIPELINE,)), tree)


def _loss(params, quant_state, stats, micro, keys, count, *, graphdef, cfg, policy: remat.Preset, stages: int):
  """Inside the map over `pipeline`: (total loss, metrics) of the step, the same on every stage."""
  m = keys.shape[0]
  t_T = jnp.arange(pipeline.loop_length(m, stages, "gpipe"))
  stage = pipeline.stage_index()
  valid_T = (t_T >= stage) & (t_T < stage + m)  # Whether stage s has a micro-batch (t - s) at iteration t.
  quant_state = _once_per_stage(quant_state)
  kernel_amaxes = linear.kernel_amaxes(merged_model(graphdef, params, quant_state, stats))  # Once a step.
  quant_T = pipeline.fan_out(quant_state, valid_T, jnp.maximum, pipeline.lowest)
  stats_T = None
  if stats is not None:
    stats_T = pipeline.fan_out(_once_per_stage(stats), valid_T, health.combine, health.combine_identity)
  model = merged_model(graphdef, params, quant_state, stats)
  segment = model.segments[0]
  per_stage = len(segment.block_ids) // stages
  block_ids = jax.lax.dynamic_slice_in_dim(jnp.asarray(segment.block_ids, jnp.int32), stage * per_stage, per_stage)
  inputs, segment_ids, positions = micro[INPUTS], micro[SEGMENT_IDS], micro[POSITIONS]

  def iteration(carry, xs):
    received, aux = carry
    t, quant, stat, valid = xs
    layers = merged_model(graphdef, params, quant, stat)
    if kernel_amaxes:
      linear.use_kernel_amaxes(layers, kernel_amaxes)
    i = jnp.clip(t - stage, 0, m - 1)
    x = jnp.where(stage == 0, layers.embed(inputs[i]), received)
    segs = jnp.where(valid, segment_ids[i], 0)  # Nothing to run: padding, which the layers map to zeros.
    y, a, per_layer = layers.segments[0](x, segs, positions[i], keys[i], policy, attention_bias(segs, x.dtype),
                                         block_ids=block_ids)
    keep = lambda v: jnp.where(valid, v, jnp.zeros_like(v))
    y = shard(keep(y), ACTIVATION)
    aux = jax.tree.map(lambda acc, v: acc + keep(v).astype(F32), aux,
                       {**a, **{k + BY_LAYER: v for k, v in per_layer.items()}})
    return (pipeline.to_next_stage(y, stages), aux), y

  x0 = jax.eval_shape(model.embed, inputs[0])
  _, a0, l0 = jax.eval_shape(lambda x: segment(x, segment_ids[0], positions[0], None, policy,
                                               attention_bias(segment_ids[0], x.dtype), block_ids=block_ids),
                             x0)
  zeros = lambda s: jnp.zeros(s.shape, F32)
  aux0 = {**jax.tree.map(zeros, a0), **{k + BY_LAYER: zeros(v) for k, v in l0.items()}}
  (_, aux), ys = jax.lax.scan(iteration, (jnp.zeros(x0.shape, x0.dtype), aux0), (t_T, quant_T, stats_T, valid_T))
  # The last stage's outputs are those of its iterations S - 1, ..., S + M - 2: micro-batches 0, ..., M - 1.
  outputs = shard(ys[stages - 1:], (None, *ACTIVATION))
  # Each device's own rows: compiled over the compiler's axes, the reduce-scatter gathered its operand whole.
  spec = logical_to_spec((None, *ACTIVATION), active_rules(), active_mesh())
  shares = shard_map(lambda a: pipeline.from_last_stage(a, stages), mesh=active_mesh(), in_specs=(spec,),
                     out_specs=spec)(outputs)
  return _head_losses(model, shares, micro, keys, count, aux, cfg)


def _head_losses(model, hidden_NxBxLxD, micro, keys, count, aux, cfg):
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
  return _terms_over_stages(losses, aux, cfg, keys.shape[0])


def _terms_over_stages(losses, aux: dict, cfg, micro_batches: int):
  """The step's (total loss, metrics) from each stage's sums: its (loss, ce, z) and its layers' aux (MoE sums summed
  over the stages, per-layer arrays gathered in layer order)."""
  total, ce, z = jax.lax.psum(losses, PIPELINE)
  by_layer = {k: jax.lax.all_gather(v, PIPELINE, axis=0, tiled=True) for k, v in aux.items() if k.endswith(BY_LAYER)}
  sums = {k: jax.lax.psum(aux[k], PIPELINE) for k in AUX_KEYS}
  return step_terms(total, ce, z, {**sums, **by_layer}, cfg, micro_batches)


def _one_f_one_b(params, quant_state, stats, micro, keys, count, *, graphdef, cfg, policy: remat.Preset,
                 stages: int):
  """Inside the map over `pipeline`, the 1F1B schedule: (metrics, parameter gradients, new quant state, health
  statistics), the gradients taken here, micro-batch by micro-batch, instead of by autodiff of a loop.

  Tick τ = 0 .. M + 2S - 3: stage s runs the forward pass of micro-batch τ - s and the backward pass of micro-batch
  τ - 2(S - 1) + s, each where it exists; the last stage takes a micro-batch's loss and its gradient in the tick of
  its forward pass. A stage keeps the residuals of the forward passes whose backward has not run (at most 2S - 1
  micro-batches: `slots`), not all M, in a ring of buffers: the residuals a remat policy saves (the stage's
  parameters themselves are not copied). Each tick hands a forward output on and a gradient back (`ppermute`)."""
  m = keys.shape[0]
  stage = pipeline.stage_index()
  last = stage == stages - 1
  slots = min(m, 2 * stages - 1)
  train = (params, quant_state, stats)
  kernel_amaxes = linear.kernel_amaxes(merged_model(graphdef, *train))
  inputs, segment_ids, positions, targets = (micro[k] for k in (INPUTS, SEGMENT_IDS, POSITIONS, TARGETS))
  segment = merged_model(graphdef, *train).segments[0]
  per_stage = len(segment.block_ids) // stages
  block_ids = jax.lax.dynamic_slice_in_dim(jnp.asarray(segment.block_ids, jnp.int32), stage * per_stage, per_stage)

  def forward(train, x_received, f):
    model = merged_model(graphdef, *train)
    if kernel_amaxes:
      linear.use_kernel_amaxes(model, kernel_amaxes)
    x = jnp.where(stage == 0, model.embed(inputs[f]), x_received)
    y, a, per_layer = model.segments[0](x, segment_ids[f], positions[f], keys[f], policy,
                                        attention_bias(segment_ids[f], x.dtype), block_ids=block_ids)
    return shard(y, ACTIVATION), {**a, **{k + BY_LAYER: v for k, v in per_layer.items()}}

  def head(train, y, f):
    model = merged_model(graphdef, *train)
    total, ce, z = cross_entropy(model.final_norm(y), targets[f], (segment_ids[f] > 0).astype(F32),
                                 model.head_parts(), key=keys[f], chunk_size=cfg.train.loss_chunk_size, count=count,
                                 z_loss_weight=cfg.train.z_loss_weight)
    return total, (ce, z)

  def run_forward(train, x, f):
    """The forward pass of micro-batch f with its VJP: (y, aux, the VJP's leaves, its structure, which leaves vary
    from one micro-batch to the next: all but the stage's own state and kernel amaxes, which are never copied)."""
    (y, aux), vjp = jax.vjp(lambda t, x_: forward(t, x_, f), train, x)
    leaves, treedef = jax.tree.flatten(vjp)
    fixed = {id(a) for a in jax.tree.leaves((train, kernel_amaxes))}
    return y, aux, leaves, treedef, [id(a) not in fixed for a in leaves]

  x_like = jax.eval_shape(lambda t: merged_model(graphdef, *t).embed(inputs[0]), train)  # In the compute dtype.
  x_zero = jnp.zeros(x_like.shape, x_like.dtype)
  def varying(t):
    _, _, leaves, _, varies = run_forward(t, x_zero, 0)
    return [a for a, v in zip(leaves, varies) if v]

  shapes = jax.eval_shape(varying, train)
  ring0 = [jnp.zeros((slots, *s.shape), s.dtype) for s in shapes]
  _, aux_like = jax.eval_shape(lambda t: forward(t, x_zero, 0), train)
  f32_zeros = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, F32), tree)
  acc0 = (f32_zeros(params), jax.tree.map(lambda a: pipeline.lowest(a.shape), quant_state),
          None if stats is None else jax.tree.map(lambda a: health.combine_identity(a.shape), stats),
          f32_zeros(aux_like), jnp.zeros((3,), F32))

  # The MoE auxiliary losses' share of the step's loss (objective.step_terms): their cotangents in every backward pass.
  routed = cfg.model.num_routed_layers * m
  weights = {MOE_LOAD_BALANCE_LOSS: cfg.model.load_balance_weight, MOE_ROUTER_Z_LOSS: cfg.model.router_z_weight,
             MOE_SEQ_BALANCE_LOSS: cfg.model.seq_load_balance_weight}
  aux_cotangent = {k: jnp.full(a.shape, weights.get(k, 0.0) / routed if routed else 0.0, a.dtype)
                   for k, a in aux_like.items()}

  def tick(carry, tau):
    received, returned, ring, (grads, quant, stat, aux, losses) = carry
    f, b = tau - stage, tau - 2 * (stages - 1) + stage  # Forward micro-batch f, backward micro-batch b.
    has_f, has_b = (f >= 0) & (f < m), (b >= 0) & (b < m)
    f, b = jnp.clip(f, 0, m - 1), jnp.clip(b, 0, m - 1)
    y, a, leaves, treedef, varies = run_forward(train, received, f)
    ring = [buf.at[f % slots].set(jnp.where(has_f, r, buf[f % slots]))
            for buf, r in zip(ring, [r for r, v in zip(leaves, varies) if v])]
    (total, parts), vjp_head = _vjp_with_aux(head, train, y, f)
    d_head, dy_last = vjp_head(jnp.ones((), F32))
    kept = iter(buf[b % slots] for buf in ring)
    vjp_b = jax.tree.unflatten(treedef, [next(kept) if v else r for r, v in zip(leaves, varies)])
    d_train, dx = vjp_b((jnp.where(last, dy_last, returned), aux_cotangent))
    at_last = has_f & last
    take = lambda on, v: jnp.where(on, v, jnp.zeros_like(v))
    grads = jax.tree.map(lambda g, d, h: g + take(has_b, d).astype(F32) + take(at_last, h).astype(F32), grads,
                         d_train[0], d_head[0])
    # Histories and statistics: a stage's rows from its backward passes, the others' (the head's) from the loss.
    by_stage = lambda path, acc, d, h, combine: (jnp.where(has_b, combine(acc, d.astype(F32)), acc)
                                                  if stage_spec(path) != P() else
                                                  jnp.where(at_last, combine(acc, h.astype(F32)), acc))
    quant = jax.tree_util.tree_map_with_path(lambda p_, q, d, h: by_stage(p_, q, d, h, jnp.maximum), quant,
                                             d_train[1], d_head[1])
    if stat is not None:
      stat = jax.tree_util.tree_map_with_path(lambda p_, s_, d, h: by_stage(p_, s_, d, h, health.combine), stat,
                                              d_train[2], d_head[2])
    aux = jax.tree.map(lambda acc, v: acc + take(has_f, v).astype(F32), aux, a)
    losses = losses + take(at_last, jnp.stack([total, *parts]).astype(F32))
    sent = (pipeline.to_next_stage(take(has_f, y), stages), pipeline.to_previous_stage(take(has_b, dx), stages))
    return (*sent, ring, (grads, quant, stat, aux, losses)), None

  init = (x_zero, x_zero, ring0, acc0)
  (_, _, _, (grads, quant, stat, aux, losses)), _ = jax.lax.scan(tick, init, jnp.arange(pipeline.loop_length(m, stages, "1f1b")))
  return _gathered(params, quant_state, stats, grads, quant, stat, aux, losses, cfg, m, stages)


def _vjp_with_aux(fn, train, y, f):
  out, vjp, aux = jax.vjp(lambda t, y_: fn(t, y_, f), train, y, has_aux=True)
  return (out, aux), vjp


def _gathered(params, quant_state, stats, grads, quant, stat, aux, losses, cfg, m: int, stages: int):
  """The 1F1B loop's sums over the stages: each stage's rows of the stacked layers stay its own; the leaves on every
  stage (embedding, final norm, head) sum their gradients over the stages and take the stage's statistics that
  ran them. (metrics, gradients, quant state, statistics)."""
  def over_stages(path, g, like, combine):
    return g.astype(like.dtype) if stage_spec(path) != P() else combine(g).astype(like.dtype)
  grads = jax.tree_util.tree_map_with_path(
      lambda path, g, p: over_stages(path, g, p, lambda v: jax.lax.psum(v, PIPELINE)), grads, params)
  unused = lambda new, old: jnp.where(jnp.isfinite(new), new, old.astype(new.dtype))  # No micro-batch used it.
  quant = jax.tree_util.tree_map_with_path(
      lambda path, q, old: over_stages(path, unused(q, old), old, lambda v: jax.lax.pmax(v, PIPELINE)), quant,
      quant_state)
  if stat is not None:
    last = pipeline.stage_index() == stages - 1
    stat = jax.tree_util.tree_map_with_path(
        lambda path, s_, old: over_stages(path, s_, old, lambda v: jax.lax.psum(jnp.where(last, v, 0), PIPELINE)),
        stat, stats)
  _, metrics = _terms_over_stages(losses, aux, cfg, m)
  return metrics, grads, quant, stat
