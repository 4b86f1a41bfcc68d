"""What a step minimises: the next-token loss, the multi-token-prediction and MoE auxiliary losses, and the
metrics a step logs with them (`forward_loss` for one batch or micro-batch; `step_terms`, shared with a pipelined
step, ember/trainer/pipelined.py)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ember import remat
from ember.config import Settings
from ember.layers.mtp import depth_inputs as mtp_inputs
from ember.names import (BATCH, BY_LAYER, INPUTS, LENGTH, MOE_DROPPED_TOKENS, MOE_EXPERT_LOADS,
                         MOE_LAYER_COUNTS, MOE_LOAD_BALANCE_LOSS, MOE_OVERFLOW_TOKENS, MOE_ROUTED_TOKENS,
                         MOE_ROUTER_Z_LOSS, MOE_SEQ_BALANCE_LOSS, POSITIONS, SEGMENT_IDS, TARGETS)
from ember.parallel import sharding
from ember.parallel.sharding import active_mesh, active_rules, logical_to_spec, shard, shard_map
from ember.quant.varying import first_along, shard_axes
from ember.trainer.loss import HeadOnce, cross_entropy, token_count

MTP_KEY = 1 << 20  # Multi-token prediction depth k's head draws its rounding noise from fold_in(key, MTP_KEY + k).


def _batch_views(batch):
  rows = (BATCH, LENGTH)
  return (shard(batch[INPUTS], rows), shard(batch[SEGMENT_IDS], rows), shard(batch[POSITIONS], rows), batch[TARGETS])


def merged_model(graphdef, params, quant_state, stats=None):
  """The model of a step: its parameters, quant state and (when statistics are on) health-statistics inputs."""
  return nnx.merge(graphdef, params, quant_state, *([stats] if stats else []))


def forward_loss(params, quant_state, batch, stats=None, *, graphdef, cfg: Settings, key,
                 policy: remat.Preset = remat.PRESETS["none"], count=None, micro_batches: int = 1,
                 taken: dict | None = None, moe_plan=None, head_once: HeadOnce | None = None):
  """(total loss, metrics) for one batch: next-token CE + z-loss (+ the MoE auxiliary losses of MoE models).
  `stats`: the health-statistics inputs (state.stats_inputs) when log.quant_stats_every > 0; `policy`: the
  remat preset the layers run under. `count`, `micro_batches`: the batch is one of `micro_batches` of a step
  whose weighted tokens number `count`; its CE and z-loss are divided by the step's tokens and its MoE
  auxiliary losses by `micro_batches`, so the step's losses, metrics and gradients are sums over its
  micro-batches (`train_step`). `taken`: what the step made once for the projections (`linear.once_a_step`
  of this model), or None; `moe_plan`: what the MoE layers run (trainer/step.py's `moe_plan`); `head_once`: the LM
  head as the step read it for all its micro-batches (loss.py's `read_once`), or None."""
  model = merged_model(graphdef, params, quant_state, stats)
  inputs, segment_ids, positions, targets = _batch_views(batch)
  hidden, aux, predictions = model.with_predictions(inputs, segment_ids, positions, targets, key=key, policy=policy,
                                                    moe_plan=moe_plan, taken=taken)
  weights = (segment_ids > 0).astype(jnp.float32)
  head = model.head_parts()
  total, ce, z = cross_entropy(hidden, targets, weights, head, key=key, chunk_size=cfg.train.loss_chunk_size,
                               count=count, z_loss_weight=cfg.train.z_loss_weight, once=head_once)
  mtp_loss = None
  if predictions:  # Multi-token prediction (layers/mtp.py): each depth's NLL over the main loss's token count.
    count = token_count(weights) if count is None else count
    depth_losses = []
    for k, h_k in enumerate(predictions, start=1):
      _, targets_k, weights_k = mtp_inputs(targets, segment_ids, k)
      loss_k, _, _ = cross_entropy(h_k, targets_k, weights_k, head, key=None if key is None else
                                   jax.random.fold_in(key, MTP_KEY + k), chunk_size=cfg.train.loss_chunk_size,
                                   count=count, once=head_once)
      depth_losses.append(loss_k)
    mtp_loss = sum(depth_losses) / len(depth_losses)
  return step_terms(total, ce, z, aux, cfg, micro_batches, mtp_loss)


def step_terms(total, ce, z, aux: dict, cfg: Settings, micro_batches: int = 1, mtp_loss=None, *,
               replicas_summed_after: bool = True):
  """(total loss, metrics) from the next-token loss (`cross_entropy`'s total, ce, z), the decoder's aux (its MoE
  sums and per-layer arrays) and the multi-token-prediction loss (or None): the terms a step adds to the loss and
  logs, for one micro-batch of `micro_batches` (`forward_loss`) or a pipelined step's whole batch.
  `replicas_summed_after`: the caller sums the replicas' terms (the micro-batch loop's replicas map), so the MoE
  statistics, each a total over every replica's tokens already, count on the first replica alone
  (`replica_part`); False where every replica holds the step's whole terms (a pipelined step)."""
  metrics = {"loss": ce}
  if cfg.train.z_loss_weight:  # Logged where it is in effect (a weight of 0 trains nothing toward it).
    metrics["z_loss"] = z
  if mtp_loss is not None:
    total = total + cfg.model.mtp_loss_weight * mtp_loss
    metrics["mtp_loss"] = jax.lax.stop_gradient(mtp_loss)
  num_moe = cfg.model.num_routed_layers
  if num_moe:  # Dense models log no MoE keys (they would always be zero).
    if replicas_summed_after:
      aux = jax.tree.map(replica_part, aux)
    lb, rz = aux[MOE_LOAD_BALANCE_LOSS] / (num_moe * micro_batches), aux[MOE_ROUTER_Z_LOSS] / (num_moe * micro_batches)
    total = total + cfg.model.load_balance_weight * lb + cfg.model.router_z_weight * rz
    if cfg.model.seq_load_balance_weight:  # DeepSeek-V3's sequence-wise balance loss, where it is on.
      seq = aux[MOE_SEQ_BALANCE_LOSS] / (num_moe * micro_batches)
      total = total + cfg.model.seq_load_balance_weight * seq
      metrics[MOE_SEQ_BALANCE_LOSS] = seq
    metrics.update({MOE_LOAD_BALANCE_LOSS: lb, MOE_ROUTER_Z_LOSS: rz, MOE_DROPPED_TOKENS: aux[MOE_DROPPED_TOKENS],
                    MOE_ROUTED_TOKENS: aux[MOE_ROUTED_TOKENS], MOE_OVERFLOW_TOKENS: aux[MOE_OVERFLOW_TOKENS]})
    metrics.update({k + BY_LAYER: aux[k + BY_LAYER] for k in (*MOE_LAYER_COUNTS, MOE_EXPERT_LOADS)})
  if cfg.train.z_loss_weight or num_moe or mtp_loss is not None:  # Else it is `loss`.
    metrics["total_loss"] = total
  return total, metrics



def micro_batches(a, accum: int, batch_shards: int):
  """[B, ...] -> [accum, B / accum, ...]: micro-batch i takes rows [i * m, (i + 1) * m) of every device's B /
  batch_shards rows (m = B / batch_shards / accum), so each micro-batch is sharded as the batch is and no
  row moves between devices."""
  b = a.shape[0]
  m = b // batch_shards // accum
  split = a.reshape(batch_shards, accum, m, *a.shape[1:]).swapaxes(0, 1).reshape(accum, b // accum, *a.shape[1:])
  return shard(split, (None, BATCH, LENGTH) + (None,) * (a.ndim - 2))


def replica_part(a: jax.Array) -> jax.Array:
  """`a` from the first replica alone (zeros from the others) inside `_over_replicas`' shard_map, `a` elsewhere:
  there a value already reduced over the replicas (the MoE layers' statistics) is on every replica, and the step
  sums the replicas' metrics. Its gradient still reaches every replica's tokens: the reduction's transpose sums
  the cotangents over the replicas."""
  replicas = tuple(sorted(shard_axes()))
  if not replicas:
    return a
  return jnp.where(first_along(replicas), a, jnp.zeros_like(a))


def replicas_first(a, mesh: Mesh, batch: tuple[str, ...], lead: tuple[str, ...]):
  """Micro-batches [accum, rows, ...] whose rows are split over the mesh axes `batch` in that order, reordered
  so that they are split over `lead` first and then the others: the order in which a shard_map over `lead`
  splits rows. A permutation of the devices' blocks in which every row stays on its device."""
  order = lead + tuple(x for x in batch if x not in lead)
  if order == batch:
    return a
  n, b = a.shape[:2]
  sizes = [mesh.shape[x] for x in batch]
  blocks = a.reshape(n, *sizes, b // math.prod(sizes), *a.shape[2:])
  moved = jnp.moveaxis(blocks, [1 + batch.index(x) for x in order], list(range(1, 1 + len(order))))
  spec = logical_to_spec((None, BATCH, LENGTH) + (None,) * (a.ndim - 3), active_rules(), mesh)
  return jax.lax.with_sharding_constraint(moved.reshape(a.shape), NamedSharding(mesh, P(None, order, *spec[2:])))


def summed_over_replicas(grads, replicas: tuple[str, ...], param_specs, reduce_dtype, splits=None):
  """Inside a shard_map manual over the replica axes: each gradient summed over the `replicas` its parameter is
  not split over (`param_specs`: an expert weight split over `expert` keeps its split), in `reduce_dtype`
  (train.grad_reduce_dtype); reduce-scattered where its `splits` leaf is not None (ZeRO-1: the optimizer state is
  split there, trainer/state.py's `replica_splits`), so each replica keeps its piece. Once a step, by the
  micro-batch loop (trainer/step.py) and the pipeline (trainer/pipelined.py)."""
  def reduce(g, spec, split=None):
    over = sharding.not_splitting(spec, replicas)
    if not over:
      return g
    if split is None:
      return jax.lax.psum(g.astype(reduce_dtype), over).astype(g.dtype)
    # Manual over every axis: the compiler would gather a gradient split over an axis it places (fsdp) whole
    # before scattering it over the replicas.
    scatter = lambda x: jax.lax.psum_scatter(x, over, scatter_dimension=split.dim, tiled=True)
    mapped = shard_map(scatter, mesh=active_mesh(), in_specs=(split.spec,), out_specs=split.spec)
    return mapped(g.astype(reduce_dtype)).astype(g.dtype)
  if not replicas:
    return grads
  if splits is None:
    return jax.tree.map(reduce, grads, param_specs)
  return jax.tree.map(reduce, grads, param_specs, splits)
