"""The train and eval steps: pure functions of (state, batch), jitted by the loop."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from ember import remat
from ember.config import num_moe_layers
from ember.layers.decoder import AUX_KEYS
from jax.sharding import Mesh, NamedSharding

from ember.parallel.sharding import logical_to_spec, rules_dict, shard
from ember.trainer.loss import cross_entropy
from ember.trainer.state import TrainState, step_key


def _batch_views(batch):
  inputs = shard(batch["inputs"], ("batch", "length"))
  segment_ids = shard(batch["segment_ids"], ("batch", "length"))
  return inputs, segment_ids, shard(batch["positions"], ("batch", "length")), batch["targets"]


def forward_loss(params, quant_state, batch, *, graphdef, cfg, key, policy: remat.Preset | None = None):
  """(total loss, metrics) for one batch: next-token CE + z-loss + MoE auxiliary losses."""
  model = nnx.merge(graphdef, params, quant_state)
  inputs, segment_ids, positions, targets = _batch_views(batch)
  hidden, aux = model(inputs, segment_ids, positions, key=key, policy=policy)
  weights = (segment_ids > 0).astype(jnp.float32)
  ce, z = cross_entropy(hidden, targets, weights, lambda h: model.head(h, key), chunk_size=cfg.train.loss_chunk_size)
  m = cfg.model
  num_moe = max(num_moe_layers(m), 1)
  lb, rz = aux["moe_load_balance_loss"] / num_moe, aux["moe_router_z_loss"] / num_moe
  total = ce + cfg.train.z_loss_weight * z + m.load_balance_weight * lb + m.router_z_weight * rz
  metrics = {"loss": ce, "z_loss": z, "total_loss": total, "moe_load_balance_loss": lb, "moe_router_z_loss": rz,
             "moe_dropped_tokens": aux["moe_dropped_tokens"], "moe_routed_tokens": aux["moe_routed_tokens"]}
  return total, metrics


def train_step(state: TrainState, batch, *, graphdef, cfg, tx, schedule, policy: remat.Preset | None = None):
  """One optimizer step. Delayed-scaling histories come back as the quant state's "gradient"."""
  key = step_key(cfg.seed, state.step)
  loss_fn = functools.partial(forward_loss, graphdef=graphdef, cfg=cfg, key=key, policy=policy)
  grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)
  (_, metrics), (grads, new_quant_state) = grad_fn(state.params, state.quant_state, batch)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = dict(metrics, grad_norm=optax.tree.norm(grads), lr=schedule(state.step))
  new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state, quant_state=new_quant_state)
  return new_state, metrics


def batch_sharding(cfg, mesh: Mesh) -> NamedSharding:
  """Where a global batch [batch, length] lives: the `batch` logical axis over its mesh axes."""
  return NamedSharding(mesh, logical_to_spec(("batch", "length"), rules_dict(cfg.mesh.rules), mesh))


def jit_train_step(cfg, mesh: Mesh, graphdef, tx, schedule, shardings, *, policy: remat.Preset | None = None,
                   donate: bool = True):
  """`train_step` jitted the one way the loop, the tools and the tests run it: state in and out on
  its shardings, the batch on `batch_sharding`, the old state donated."""
  step = functools.partial(train_step, graphdef=graphdef, cfg=cfg, tx=tx, schedule=schedule, policy=policy)
  return jax.jit(step, in_shardings=(shardings, batch_sharding(cfg, mesh)), out_shardings=(shardings, None),
                 donate_argnums=0 if donate else ())


def eval_step(state: TrainState, batch, *, graphdef, cfg):
  """Mean next-token loss on a batch, with no quantization noise (no stochastic-rounding key)."""
  _, metrics = forward_loss(state.params, state.quant_state, batch, graphdef=graphdef, cfg=cfg, key=None,
                            policy=remat.PRESETS["none"])
  return metrics["loss"]


__all__ = ["train_step", "eval_step", "forward_loss", "AUX_KEYS"]
