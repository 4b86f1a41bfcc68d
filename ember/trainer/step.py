"""The train and eval steps: pure functions of (state, batch), jitted by the loop."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, PartitionSpec as P

from ember import remat
from ember.config import Settings
from ember.layers import linear, moe_dispatch
from ember.layers.decoder import keys_of, padded_rows, rows_cut_ahead, stacked_layers, zero_padding_rows
from ember.layers.moe import ROUTER_BIAS
from ember.names import BY_LAYER, MOE_EXPERT_LOADS, MOE_LOAD_MAX_OVER_MEAN, SEGMENT_IDS
from ember.parallel import mesh as mesh_lib
from ember.parallel import pipeline, sharding
from ember.parallel.sharding import active_mesh, active_rules
from ember.platform import knows_compile_option, target_platform
from ember.quant import health
from ember.trainer import pipelined
from ember.trainer.loss import HeadOnce, read_once, token_count, with_head_gradient
from ember.trainer.objective import (forward_loss, merged_model, micro_batches, replica_part,  # noqa: F401
                                     replicas_first, summed_over_replicas)
from ember.trainer.optimizer import learning_rate_schedule
from ember.trainer.state import (TrainState, replica_axes, replica_specs, replica_splits, split_over_replicas,
                                 stats_inputs, step_key)
from ember.xla_flags import loop_pipelining_off, step_defaults

F32 = jnp.float32


def train_step(state: TrainState, batch, *, graphdef, cfg: Settings, tx, schedule, policy: remat.Preset,
               batch_shards: int = 1, moe_plan: moe_dispatch.Plan | None = None):
  """One optimizer step. Delayed-scaling histories come back as the quant state's "gradient", and with
  log.quant_stats_every > 0 the projections' health statistics as the stats inputs' (metrics["quant_stats"]).
  With train.grad_accum_steps > 1 the batch runs as that many micro-batches (`_accumulate`); `batch_shards`:
  the devices the batch's rows are sharded over; `moe_plan`: what the MoE layers run (`moe_plan`)."""
  key = step_key(cfg.seed, state.step)
  with_stats = bool(cfg.log.quant_stats_every)
  loss_fn = functools.partial(forward_loss, graphdef=graphdef, cfg=cfg, policy=policy, moe_plan=moe_plan)
  grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1, 3) if with_stats else (0, 1), has_aux=True)
  stats = stats_inputs(cfg) if with_stats else None
  accum = cfg.train.grad_accum_steps
  mesh = active_mesh()
  if pipeline.stages(mesh) > 1:  # The micro-batches flow through the stages (trainer/pipelined.py).
    replicas = replica_axes(cfg, mesh, target_platform())
    metrics, outs = pipelined.grads(state, batch, stats, key, graphdef=graphdef, cfg=cfg, policy=policy, mesh=mesh,
                                    batch_shards=batch_shards, replicas=replicas,
                                    param_specs=replica_specs(cfg, mesh, replicas),
                                    splits=replica_splits(cfg, mesh, replicas), moe_plan=moe_plan)
  elif accum == 1 and not (cfg.train.shard_optimizer_state and replica_axes(cfg, mesh, target_platform())):
    taken = linear.once_a_step(merged_model(graphdef, state.params, state.quant_state, stats), policy.remat,
                               loop=False)
    (_, metrics), outs = grad_fn(state.params, state.quant_state, batch, stats, key=key, taken=taken)
  else:  # Micro-batches, or one over replicas whose optimizer state is split: its gradients are reduce-scattered
    # onto the split (`_over_replicas`); reduced whole by the compiler, the step would all-reduce them and gather
    # every updated parameter after.
    metrics, outs = _accumulate(loss_fn, state, batch, stats, key, accum, batch_shards, graphdef, cfg, policy.remat)
  grads, new_quant_state = outs[0], outs[1]
  if with_stats:
    metrics = dict(metrics, quant_stats=outs[2])
  if cfg.model.num_moe_layers:
    loads_LxE = metrics.pop(MOE_EXPERT_LOADS + BY_LAYER)  # The step's, over its micro-batches and data shards.
    metrics[MOE_LOAD_MAX_OVER_MEAN] = load_max_over_mean(loads_LxE, cfg.model)
    if cfg.model.router_bias_update_rate:
      new_quant_state = update_router_biases(state.quant_state, new_quant_state, loads_LxE, cfg.model, cfg.quant)
  if cfg.stacked_blocks > cfg.model.num_blocks:  # A pipeline's padding rows stay zeros (pipeline.padded_blocks).
    new_quant_state = zero_padding_rows(new_quant_state, cfg.model, cfg.quant)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  grad_norm = optax.tree.norm(grads)
  metrics = dict(metrics, grad_norm=grad_norm, lr=schedule(state.step))
  if cfg.train.optimizer == "muon":  # `lr` is AdamW's (embeddings, norms, the head); the matrices run Muon's.
    metrics["lr_muon"] = learning_rate_schedule(cfg.train, cfg.train.muon_learning_rate)(state.step)
  new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state, quant_state=new_quant_state)
  return unless_non_finite(state, new_state, metrics, grad_norm)


def unless_non_finite(state: TrainState, new_state: TrainState, metrics: dict, grad_norm: jax.Array):
  """(the state after the step, metrics with `skipped`): `new_state`, or `state` itself, untouched, when the step's
  loss or gradient norm is not finite, or its new quantization state is not (an Inf in a delayed-scaling operand:
  the cast saturates it and the step's outputs stay finite, but the history would hold the Inf, and scale by it,
  for as many steps as it is long). A skipped step applies no update: parameters, optimizer state (and so its
  learning-rate count), amax histories and `step` (updates applied) stay as they were; the loop counts its batch
  (ember/trainer/loop.py). The choice is an elementwise select that XLA fuses into the update's own kernels,
  which read both states already: no extra pass over the state."""
  finite = jnp.isfinite(grad_norm) & jnp.isfinite(metrics.get("total_loss", metrics["loss"]))  # What was derived.
  quant = jax.tree.leaves(new_state.quant_state)  # Histories [H] and router biases [E]: small; one check, one kernel.
  if quant:
    finite &= jnp.all(jnp.isfinite(jnp.concatenate([jnp.ravel(a).astype(jnp.float32) for a in quant])))
  kept = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_state, state)
  return kept, dict(metrics, skipped=(~finite).astype(jnp.int32))


def load_max_over_mean(loads_LxE, model) -> jax.Array:
  """The largest expert load over the mean load, averaged over the MoE layers (1 = balanced)."""
  moe = jnp.asarray([i for i in range(model.stat_layers) if model.is_moe_layer(i)])
  loads = loads_LxE[moe]
  return jnp.mean(jnp.max(loads, axis=-1) / jnp.maximum(jnp.mean(loads, axis=-1), 1e-9))


def update_router_biases(old_quant_state, new_quant_state, loads_LxE, model, recipe):
  """`new_quant_state` with each MoE layer's router bias moved by the DeepSeek-V3 rule from its value before the
  step: bias += rate * sign(mean load - load), per layer, from the step's per-expert loads [layers, experts]."""
  rate = model.router_bias_update_rate

  def update(path, old, new):
    keys = keys_of(path)
    if keys[-1] != ROUTER_BIAS:
      return new
    if keys[0] == "mtp":  # A multi-token-prediction module's layer: its row follows the decoder's.
      loads = loads_LxE[model.num_layers + keys[1]]  # [experts].
    else:
      loads = loads_LxE[jnp.asarray(stacked_layers(model, recipe, keys))]  # [the leaf's layers, experts].
      loads = padded_rows(loads, old.shape[0])  # A pipeline's padding rows: zero loads, their bias kept at zero.
    return old + rate * jnp.sign(jnp.mean(loads, axis=-1, keepdims=True) - loads)

  return jax.tree_util.tree_map_with_path(update, old_quant_state, new_quant_state)


def _accumulate(loss_fn, state: TrainState, batch, stats, key, accum: int, batch_shards: int, graphdef, cfg: Settings,
                rematted: bool = True):
  """(metrics, (grads, quant state[, health])) of a step run as `accum` micro-batches in a scan, one
  micro-batch's activations alive at a time. Each micro-batch's losses are its share of the step's
  (`forward_loss`), so losses, counts and gradients add up; gradients are summed in float32. Delayed-scaling
  histories combine by max (every micro-batch rolls its amax into the same start-of-step history, so the
  step rolls in the largest) and health statistics by `health.combine`. Micro-batch i's stochastic rounding
  draws from `fold_in(key, i)` (folded again with a replica's index: `_over_replicas`). The kernels' amaxes
  (per-tensor recipes) and their quantized copies are made once, before the scan (`linear.once_a_step`): every
  micro-batch would make the same ones, and XLA does not hoist those passes over the float32 weights out of the
  loop (the amaxes alone: 114 GB a step for llama3_8b fp8_current at 16 micro-batches on 8 GPUs). Where the
  tokens are split across nodes, so is the LM head (`_reads_head_once`). Over data- and expert-parallel replicas
  each runs the scan on its own rows and their sums are reduced once a step (`_over_replicas`, over
  `replica_axes`). `loss_fn`: `forward_loss` with the step's settings bound; `rematted`: its layers run under a
  remat policy (`once_a_step`)."""
  count = token_count(batch[SEGMENT_IDS] > 0)
  keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(accum))
  xs = (jax.tree.map(lambda a: micro_batches(a, accum, batch_shards), batch), keys)

  def run(params, micro, micro_key, once: HeadOnce | None = None, taken: dict | None = None):
    """((loss, metrics), (gradients, quant state[, health statistics][, the head's shares])) of a micro-batch."""
    def loss(params_, quant_state, stats_, partial):
      return loss_fn(params_, quant_state, micro, stats_, key=micro_key, count=count, micro_batches=accum,
                     taken=taken, head_once=None if once is None else HeadOnce(once.weight, partial))
    argnums = (0, 1) + ((2,) if stats is not None else ()) + ((3,) if once is not None else ())
    return jax.value_and_grad(loss, argnums, has_aux=True)(params, state.quant_state, stats,
                                                           None if once is None else once.partial)

  # The scan's carry is shaped like a micro-batch's outputs: its metrics from the forward alone (tracing the
  # backward too, once more than the scan traces it, took 30-40% of a step's lowering), its gradients like what
  # they are taken of (JAX gives a real input's gradient the input's shape and dtype).
  def forward(params, micro, micro_key):
    taken = linear.once_a_step(merged_model(graphdef, params, state.quant_state, stats), rematted, loop=accum > 1)
    return loss_fn(params, state.quant_state, micro, stats, key=micro_key, count=count, micro_batches=accum,
                   taken=taken)

  _, metrics_shape = jax.eval_shape(forward, state.params, *jax.tree.map(lambda a: a[0], xs))
  outs_shape = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                            (state.params, state.quant_state) + (() if stats is None else (stats,)))
  f32_zeros = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, F32), tree)
  init = (f32_zeros(metrics_shape), f32_zeros(outs_shape[0]), f32_zeros(outs_shape[1]))
  if stats is not None:
    init += (jax.tree.map(lambda a: health.combine_identity(a.shape), outs_shape[2]),)

  mesh = active_mesh()
  replicas = () if mesh is None else replica_axes(cfg, mesh, target_platform())

  def scan(init, xs, params):
    model = merged_model(graphdef, params, state.quant_state, stats)
    # One micro-batch (over replicas whose optimizer state is split) is no loop: an unquantized kernel is cast where
    # its GEMMs read it, as in the step without micro-batches (quant/dot.py's `takes_kernel_copies`).
    loop = accum > 1
    head, taken = model.head_parts(), linear.once_a_step(model, rematted, loop=loop)
    taken = rows_cut_ahead(model, taken) if loop else taken
    once = read_once(head) if _reads_head_once(cfg, mesh, replicas) else None

    def body(carry, x):
      sums, shares = carry
      (_, metrics), outs = run(params, *x, once=once, taken=taken)
      add = lambda acc, a: acc + a.astype(F32)
      new = (jax.tree.map(add, sums[0], metrics), jax.tree.map(add, sums[1], outs[0]),
             jax.tree.map(jnp.maximum, sums[2], outs[1]))
      if stats is not None:
        new += (jax.tree.map(health.combine, sums[3], outs[2]),)
      return (new, None if once is None else shares + outs[-1]), None

    sums, shares = jax.lax.scan(body, (init, None if once is None else jnp.zeros_like(once.partial)), xs)[0]
    if once is None:
      return sums
    return (sums[0], with_head_gradient(sums[1], head, shares), *sums[2:])

  if replicas:
    total = _over_replicas(scan, init, xs, state.params, mesh, replicas, replica_specs(cfg, mesh, replicas),
                           replica_splits(cfg, mesh, replicas), jnp.dtype(cfg.quant.wgrad_dtype))
  else:  # One program over the whole mesh: the compiler reduces every micro-batch's gradient across replicas.
    total = scan(init, xs, state.params)
  like = lambda tree, shapes: jax.tree.map(lambda a, s: a.astype(s.dtype), tree, shapes)
  metrics = like(total[0], metrics_shape)
  outs = (like(total[1], outs_shape[0]), like(total[2], outs_shape[1])) + tuple(total[3:])
  return metrics, outs


def _reads_head_once(cfg: Settings, mesh: Mesh | None, replicas: tuple[str, ...]) -> bool:
  """Whether a step of micro-batches reads the LM head once (loss.py's `read_once`): where the tokens are split
  across hosts (mesh.py's `axes_across_hosts`) over an axis that is not one of the step's `replicas` (whose sums
  are reduced once a step anyway). Each micro-batch would reduce the head's [D, V] float32 gradient over the
  network (Qwen3-235B on 256 GPUs: 8 x 2.3 GiB a step); inside a node that reduction hides behind the layers'
  work, and holding the gathered weight and the float32 shares for the step (1.5x the head's float32 size) buys
  nothing."""
  if mesh is None:
    return False
  across = mesh_lib.axes_across_hosts(mesh.devices, mesh.axis_names)
  return any(a in across for a in sharding.token_axes(cfg.mesh.rules_dict) if a not in replicas)


def _over_replicas(scan, init, xs, params, mesh: Mesh, axes: tuple[str, ...], param_specs, splits, reduce_dtype):
  """`scan(init, xs, params)`, the micro-batch loop (its carry: the sums of the step's metrics and gradients, the
  delayed-scaling histories[, the health statistics]), run by each replica (a device group along the mesh
  `axes`: `replica_axes`) on its own rows in a `shard_map`, then summed over the replicas: each gradient is
  reduced across them once a step, in `reduce_dtype` (train.grad_reduce_dtype), and scattered over them where
  the optimizer state is split (`splits`: ZeRO-1, trainer/state.py's `replica_splits`). Run as one program over
  the whole mesh instead, the compiler reduces every micro-batch's gradient across them. Inside, each replica's
  activations and gradients are its own: the quantizers reduce their amaxes over the replicas (quant/dot.py),
  the MoE layers their statistics (taken from the first replica alone: `replica_part`) and exchange tokens
  over the expert axis as ever. The parameters enter as their `param_specs` say (an expert weight split over
  `expert` stays split, its gradient reduced over the other axes alone). What is the same on every replica
  after the loop, the histories and health statistics, is taken as it is. A replica's stochastic rounding
  draws from its micro-batch's key folded with the replica's index: its noise is its own."""
  def per_replica(init, xs, params):
    rows, keys = xs
    keys = jax.vmap(lambda k: jax.random.fold_in(k, jax.lax.axis_index(axes)))(keys)
    metrics, grads, *same = scan(init, (rows, keys), params)

    grads = summed_over_replicas(grads, axes, param_specs, reduce_dtype, splits)
    return (jax.lax.psum(metrics, axes), grads, *same)

  batch = sharding.batch_axes(active_rules(), mesh)
  rows = jax.tree.map(lambda a: replicas_first(a, mesh, batch, axes), xs[0])
  specs = lambda grads: (P(), grads, *(P(),) * (len(init) - 2))
  grad_specs = jax.tree.map(lambda p, spec, split: split_over_replicas(spec, p.ndim, split), params, param_specs,
                            splits)
  # check_vma=False: the model's scans start from constants (unvarying) and would each need a cast.
  # Manual over the mesh's axes of one device too, which split nothing: where no other axis is left, every axis is
  # manual and no kernel is handed to the partitioner for a group of one device (which JAX cannot read).
  manual = set(axes) | {a for a, n in mesh.shape.items() if n == 1}
  return jax.shard_map(per_replica, mesh=mesh, in_specs=(specs(param_specs), (P(None, axes), P()), param_specs),
                       out_specs=specs(grad_specs), axis_names=manual, check_vma=False)(init, (rows, xs[1]), params)


def moe_plan(cfg: Settings, mesh: Mesh, batch_size: int) -> moe_dispatch.Plan | None:
  """What the config's MoE layers run on `mesh` for batches of `batch_size` sequences (None for a dense
  model): decided here, once per jitted step, and read by the layers, the run's log line and the compile
  report alike."""
  if not cfg.model.num_experts:
    return None
  return moe_dispatch.plan(cfg.model, mesh, cfg.mesh.rules_dict, batch=(batch_size, cfg.model.seq_len),
                           platform=target_platform())


def jit_train_step(cfg: Settings, mesh: Mesh, graphdef, tx, schedule, shardings, *, policy: remat.Preset | None = None,
                   donate: bool = True, plan: moe_dispatch.Plan | None = None):
  """`train_step` jitted the one way the loop, the tools and the tests run it: state in and out on
  its shardings, the batch on `batch_sharding`, the old state donated. The remat preset is chosen here:
  `policy`, or the config's (`remat.policy`, resolved; the plan tools pass each preset they compare); and
  the MoE plan of one micro-batch: `plan`, where the caller decided it to log or report it too, or `moe_plan`. It
  compiles with `step_compiler_options`."""
  policy = cfg.remat.preset if policy is None else policy
  plan = moe_plan(cfg, mesh, cfg.train.micro_batch_size) if plan is None else plan
  rows = sharding.batch_sharding(cfg.mesh.rules_dict, mesh)
  step = functools.partial(train_step, graphdef=graphdef, cfg=cfg, tx=tx, schedule=schedule, policy=policy,
                           batch_shards=batch_shards(cfg, mesh), moe_plan=plan)
  return jax.jit(step, in_shardings=(shardings, rows), out_shardings=(shardings, None),
                 donate_argnums=0 if donate else (), compiler_options=step_compiler_options(cfg, mesh) or None)


def step_compiler_options(cfg: Settings, mesh: Mesh) -> dict[str, bool]:
  """The XLA options `jit_train_step` compiles the step of `cfg` on `mesh` with: on GPUs, ember's defaults that
  XLA_FLAGS leaves unset (xla_flags.step_defaults) and the loop-pipelining flags that cost this step switched off
  (xla_flags.loop_pipelining_off); none elsewhere."""
  if target_platform() != "gpu":
    return {}
  defaults = {option: value for option, value in step_defaults(os.environ.get("XLA_FLAGS", "")).items()
              if knows_compile_option(option, value)}  # An older XLA than the option's: left out.
  return defaults | loop_pipelining_off(cfg.model.scan_layers, pipeline.stages(mesh))


def eval_step(state: TrainState, batch, *, graphdef, cfg: Settings, batch_shards: int,
              moe_plan: moe_dispatch.Plan | None = None):
  """Mean next-token loss on a batch, with no quantization noise (no stochastic-rounding key), run as the train
  step runs it: `train.grad_accum_steps` micro-batches in a scan, one micro-batch's activations alive at a time
  (a whole batch at once would hold grad_accum_steps times the activations the step was sized for), each
  micro-batch's loss its share of the batch's tokens. `moe_plan`: that of one micro-batch, as the step's.

  On a pipelined mesh the batch goes through the stages as the train step's does (its gradients dropped): run
  whole, every stage would gather every stage's layers, a model's worth of parameters on each device. The
  backward pass's rounding keys touch no forward value, so the loss is the one a forward pass gives."""
  stats = stats_inputs(cfg) if cfg.log.quant_stats_every else None
  mesh = active_mesh()
  if pipeline.stages(mesh) > 1:
    replicas = replica_axes(cfg, mesh, target_platform())
    metrics, _ = pipelined.grads(state, batch, stats, step_key(cfg.seed, state.step), graphdef=graphdef, cfg=cfg,
                                 policy=cfg.remat.preset, mesh=mesh, batch_shards=batch_shards, replicas=replicas,
                                 param_specs=replica_specs(cfg, mesh, replicas),
                                 splits=replica_splits(cfg, mesh, replicas), moe_plan=moe_plan)
    return metrics["loss"].astype(jnp.float32)
  accum, count = cfg.train.grad_accum_steps, token_count(batch[SEGMENT_IDS] > 0)

  def body(total, micro):
    _, metrics = forward_loss(state.params, state.quant_state, micro, stats, graphdef=graphdef, cfg=cfg, key=None,
                              moe_plan=moe_plan, count=count, micro_batches=accum)
    return total + metrics["loss"].astype(jnp.float32), None

  micro = jax.tree.map(lambda a: micro_batches(a, accum, batch_shards), batch)
  return jax.lax.scan(body, jnp.zeros((), jnp.float32), micro)[0]


def jit_eval_step(cfg: Settings, mesh: Mesh, graphdef, shardings, plan: moe_dispatch.Plan | None = None):
  """`eval_step` jitted the one way the loop and the tests run it: on the step's micro-batches and MoE plan."""
  plan = moe_plan(cfg, mesh, cfg.train.micro_batch_size) if plan is None else plan
  step = functools.partial(eval_step, graphdef=graphdef, cfg=cfg, batch_shards=batch_shards(cfg, mesh), moe_plan=plan)
  return jax.jit(step, in_shardings=(shardings, sharding.batch_sharding(cfg.mesh.rules_dict, mesh)))


def batch_shards(cfg: Settings, mesh: Mesh) -> int:
  """How many blocks of rows the batch is split into over the devices (its sharding's)."""
  rows = sharding.batch_sharding(cfg.mesh.rules_dict, mesh)
  return cfg.train.batch_size // rows.shard_shape((cfg.train.batch_size, cfg.model.seq_len))[0]

