"""The train and eval steps: pure functions of (state, batch), jitted by the loop."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from ember import remat
from ember.model_config import ModelConfig
from ember.names import (BATCH, BY_LAYER, INPUTS, LENGTH, MOE_DROPPED_TOKENS, MOE_LAYER_COUNTS, MOE_LOAD_BALANCE_LOSS,
                         MOE_OVERFLOW_TOKENS, MOE_ROUTED_TOKENS, MOE_ROUTER_Z_LOSS, POSITIONS, SEGMENT_IDS, TARGETS)
from ember.parallel.sharding import logical_to_spec, rules_dict, shard
from ember.trainer.loss import cross_entropy
from ember.trainer.state import TrainState, stats_inputs, step_key


def _batch_views(batch):
  rows = (BATCH, LENGTH)
  return (shard(batch[INPUTS], rows), shard(batch[SEGMENT_IDS], rows), shard(batch[POSITIONS], rows), batch[TARGETS])


def forward_loss(params, quant_state, batch, stats=None, *, graphdef, cfg, key,
                 policy: remat.Preset = remat.PRESETS["none"]):
  """(total loss, metrics) for one batch: next-token CE + z-loss (+ the MoE auxiliary losses of MoE models).
  `stats`: the health-statistics inputs (state.stats_inputs) when log.quant_stats_every > 0; `policy`: the
  remat preset the layers run under."""
  model = nnx.merge(graphdef, params, quant_state, *([stats] if stats else []))
  inputs, segment_ids, positions, targets = _batch_views(batch)
  hidden, aux = model(inputs, segment_ids, positions, key=key, policy=policy)
  weights = (segment_ids > 0).astype(jnp.float32)
  w_head, logits = model.head_parts()
  ce, z = cross_entropy(hidden, targets, weights, w_head, logits, key=key, chunk_size=cfg.train.loss_chunk_size)
  total = ce + cfg.train.z_loss_weight * z
  metrics = {"loss": ce, "z_loss": z}
  num_moe = ModelConfig.from_config(cfg).num_moe_layers
  if num_moe:  # Dense models log no MoE keys (they would always be zero).
    lb, rz = aux[MOE_LOAD_BALANCE_LOSS] / num_moe, aux[MOE_ROUTER_Z_LOSS] / num_moe
    total = total + cfg.model.load_balance_weight * lb + cfg.model.router_z_weight * rz
    metrics.update({MOE_LOAD_BALANCE_LOSS: lb, MOE_ROUTER_Z_LOSS: rz, MOE_DROPPED_TOKENS: aux[MOE_DROPPED_TOKENS],
                    MOE_ROUTED_TOKENS: aux[MOE_ROUTED_TOKENS], MOE_OVERFLOW_TOKENS: aux[MOE_OVERFLOW_TOKENS]})
    metrics.update({k + BY_LAYER: aux[k + BY_LAYER] for k in MOE_LAYER_COUNTS})
  metrics["total_loss"] = total
  return total, metrics


def train_step(state: TrainState, batch, *, graphdef, cfg, tx, schedule, policy: remat.Preset):
  """One optimizer step. Delayed-scaling histories come back as the quant state's "gradient", and with
  log.quant_stats_every > 0 the projections' health statistics as the stats inputs' (metrics["quant_stats"])."""
  key = step_key(cfg.seed, state.step)
  loss_fn = functools.partial(forward_loss, graphdef=graphdef, cfg=cfg, key=key, policy=policy)
  if cfg.log.quant_stats_every:
    grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1, 3), has_aux=True)
    stats = stats_inputs(cfg)
    (_, metrics), (grads, new_quant_state, health) = grad_fn(state.params, state.quant_state, batch, stats)
    metrics = dict(metrics, quant_stats=health)
  else:
    grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)
    (_, metrics), (grads, new_quant_state) = grad_fn(state.params, state.quant_state, batch)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = dict(metrics, grad_norm=optax.tree.norm(grads), lr=schedule(state.step))
  new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state, quant_state=new_quant_state)
  return new_state, metrics


def batch_sharding(cfg, mesh: Mesh) -> NamedSharding:
  """Where a global batch [batch, length] lives: the `batch` logical axis over its mesh axes."""
  return NamedSharding(mesh, logical_to_spec((BATCH, LENGTH), rules_dict(cfg.mesh.rules), mesh))


def jit_train_step(cfg, mesh: Mesh, graphdef, tx, schedule, shardings, *, policy: remat.Preset | None = None,
                   donate: bool = True):
  """`train_step` jitted the one way the loop, the tools and the tests run it: state in and out on
  its shardings, the batch on `batch_sharding`, the old state donated. The remat preset is chosen here:
  `policy`, or the config's (`remat.policy`, resolved; the plan tools pass each preset they compare)."""
  policy = remat.preset(cfg.remat) if policy is None else policy
  step = functools.partial(train_step, graphdef=graphdef, cfg=cfg, tx=tx, schedule=schedule, policy=policy)
  return jax.jit(step, in_shardings=(shardings, batch_sharding(cfg, mesh)), out_shardings=(shardings, None),
                 donate_argnums=0 if donate else ())


def eval_step(state: TrainState, batch, *, graphdef, cfg):
  """Mean next-token loss on a batch, with no quantization noise (no stochastic-rounding key)."""
  stats = stats_inputs(cfg) if cfg.log.quant_stats_every else None
  _, metrics = forward_loss(state.params, state.quant_state, batch, stats, graphdef=graphdef, cfg=cfg, key=None)
  return metrics["loss"]

