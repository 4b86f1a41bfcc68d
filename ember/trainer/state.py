"""The train state and its creation, sharded from the start.

Parameters and quantization state are plain nested dicts of arrays (`nnx.to_pure_dict(state)`),
so Optax, Orbax and the sharding rules see ordinary pytrees; the module structure lives in the
NNX graphdef, and `nnx.merge(graphdef, params, quant_state)` rebuilds the model inside the step.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ember.config import Settings
from ember.layers.decoder import Transformer
from ember.layers.linear import QuantState, QuantStats
from ember.names import KV_HEADS
from ember.parallel import sharding
from ember.platform import on_device, target_platform


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
  step: jax.Array  # int32 scalar: optimizer steps taken.
  params: Any  # Nested dict of float arrays (param_dtype).
  opt_state: Any  # Optax state mirroring params.
  quant_state: Any  # Nested dict of delayed-scaling amax histories ({} for other recipes).


def build_model(cfg: Settings, key: jax.Array) -> Transformer:
  with nnx.use_eager_sharding(False):
    return Transformer(cfg.model, cfg.quant, nnx.Rngs(params=key), blocks=cfg.stacked_blocks)


def split_model(model: Transformer):
  """(graphdef, params, quant state, health-statistics inputs); the last is empty unless
  log.quant_stats_every > 0, and is never train state (see `stats_inputs`)."""
  return nnx.split(model, nnx.Param, QuantState, QuantStats)


def stats_inputs(cfg: Settings) -> dict:
  """The zeros the projections' QuantStats take in a step (their "gradients" are the step's health
  statistics, ember/trainer/quant_stats.py); {} when statistics are off."""
  abstract = nnx.eval_shape(lambda: build_model(cfg, jax.random.key(0)))
  stats = nnx.to_pure_dict(split_model(abstract)[3])
  return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), stats)


@functools.lru_cache(maxsize=16)
def logical_axes(cfg: Settings):
  """(graphdef, logical-axis PartitionSpecs of params, of quant state), without allocating anything. Traced once per
  settings (a model's trace takes a quarter of a second at deepseek_v3's size, and a step's shardings ask several
  times): each call returns the same objects, to be read, not changed."""
  abstract = nnx.eval_shape(lambda: build_model(cfg, jax.random.key(0)))
  graphdef, params, quant_state, _ = split_model(abstract)
  specs = lambda state: nnx.to_pure_dict(nnx.get_partition_spec(state))
  return graphdef, _kv_heads_held_whole(cfg, specs(params)), specs(quant_state)


def _kv_heads_held_whole(cfg: Settings, specs):
  """The parameters' logical specs with the kv heads held whole where they are fewer than the ranks the rules
  split them over (`ModelConfig.kv_copies` > 1): each rank's attention then reads copies of its group's key and
  value weights (layers/attention.py `kv_view`)."""
  ranks = sharding.shards(cfg.mesh.rules_dict.get(KV_HEADS, ()), cfg.mesh.sizes())
  if cfg.model.kv_copies(ranks) == 1:
    return specs
  return jax.tree.map(lambda spec: P(*(None if name == KV_HEADS else name for name in spec)), specs,
                      is_leaf=lambda x: isinstance(x, P))


def _match_opt_shardings(abstract_opt, param_shardings, mesh: Mesh):
  """Optimizer-state leaves take the sharding of the parameter whose path they end with."""
  by_path = {tuple(p): s for p, s in jax.tree_util.tree_flatten_with_path(param_shardings)[0]}
  replicated = NamedSharding(mesh, P())

  def pick(path, leaf):
    for start in range(len(path)):
      hit = by_path.get(tuple(path[start:]))
      if hit is not None and len(hit.spec) <= leaf.ndim:
        return hit
    return replicated

  return jax.tree_util.tree_map_with_path(pick, abstract_opt)


def replica_axes(cfg: Settings, mesh: Mesh, platform: str) -> tuple[str, ...]:
  """The mesh axes whose devices run a step's micro-batches as replicas, each on its own rows, and reduce their
  gradients across one another once a step (trainer/step.py's `_over_replicas`) rather than per micro-batch:
  parallel/sharding.py's `replica_axes` for this config's parameters. The step, the optimizer state's split and the
  planner's estimate all ask.

  None for a recipe whose kernels partition themselves (`Recipe.custom_partitioned`: MXFP8 and NVFP4 on a GPU)
  where the compiler would still split a projection's features (an axis of more than one device that the batch
  is not split over: tensor, context). Inside the replicas' shard_map their partition rules cannot sum a split
  contraction (quant/partitioning.py): a row-parallel GEMM would gather its operands instead."""
  parameters = jax.tree.leaves(logical_axes(cfg)[1], is_leaf=lambda x: isinstance(x, P))
  return sharding.replica_axes(cfg.mesh.rules_dict, mesh, parameters,
                           features_split_apart=not cfg.quant.custom_partitioned(platform))


def replica_specs(cfg: Settings, mesh: Mesh, replicas: tuple[str, ...]):
  """Each parameter's PartitionSpec over the `replicas` alone: where an expert weight is split over them."""
  shardings = sharding.tree_shardings(logical_axes(cfg)[1], mesh, cfg.mesh.rules)
  return jax.tree.map(lambda s: sharding.only_axes(s.spec, replicas), shardings)


@dataclasses.dataclass(frozen=True)
class ReplicaSplit:
  """Where a parameter's optimizer state, and its gradient reduced once a step, is split over the replicas that
  hold the parameter whole (ZeRO-1): along `dim`, over the replica axes `over`, the parameter itself laid out as
  `spec` over the whole mesh."""
  dim: int
  spec: P
  over: tuple[str, ...]


def replica_splits(cfg: Settings, mesh: Mesh, replicas: tuple[str, ...]):
  """Each parameter's `ReplicaSplit` (train.shard_optimizer_state; the dimension: parallel/sharding.py's
  `replica_split`), or None. All None with the key off or no replicas: each replica then holds the whole state."""
  shardings = sharding.tree_shardings(logical_axes(cfg)[1], mesh, cfg.mesh.rules)
  abstract = abstract_init(cfg)[0]
  if not (cfg.train.shard_optimizer_state and replicas):
    return jax.tree.map(lambda _: None, abstract)

  def split(a, s):
    over = sharding.not_splitting(s.spec, replicas)
    dim = sharding.replica_split(a.shape, s.spec, over, mesh)
    return None if dim is None else ReplicaSplit(dim, s.spec, over)
  return jax.tree.map(split, abstract, shardings)


def split_over_replicas(spec: P, ndim: int, split: ReplicaSplit | None) -> P:
  """`spec` with its `split`'s replica axes added to the split's dimension (unchanged for None)."""
  return spec if split is None else sharding.with_split(spec, ndim, split.dim, split.over)


def update_shardings(cfg: Settings, mesh: Mesh, platform: str | None = None):
  """Where each parameter's update is computed: its NamedSharding, split over the step's replicas too where
  `replica_splits` says (its optimizer state lies so, and its gradient is reduced onto it); `platform`: the one the
  step compiles for (default: the one the step traces for on `mesh`'s devices, as parallel/sharding.py's
  `use_rules` sets it)."""
  if platform is None:
    with on_device(mesh.devices.flat[0]):
      platform = target_platform()
  replicas = replica_axes(cfg, mesh, platform)
  param_sh = sharding.tree_shardings(logical_axes(cfg)[1], mesh, cfg.mesh.rules)
  split = lambda a, s, part: NamedSharding(mesh, split_over_replicas(s.spec, a.ndim, part))
  return jax.tree.map(split, abstract_init(cfg)[0], param_sh, replica_splits(cfg, mesh, replicas))


def state_shardings(cfg: Settings, mesh: Mesh, tx, platform: str | None = None):
  """(graphdef, TrainState of NamedShardings, abstract TrainState). The optimizer state lies as its parameter's
  update (`update_shardings`)."""
  graphdef, param_specs, quant_specs = logical_axes(cfg)
  to_shardings = lambda specs: sharding.tree_shardings(specs, mesh, cfg.mesh.rules)
  param_sh, quant_sh = to_shardings(param_specs), to_shardings(quant_specs)
  abstract_params, abstract_quant = abstract_init(cfg)
  abstract_opt = jax.eval_shape(tx.init, abstract_params)
  opt_sh = _match_opt_shardings(abstract_opt, update_shardings(cfg, mesh, platform), mesh)
  replicated = NamedSharding(mesh, P())
  shardings = TrainState(step=replicated, params=param_sh, opt_state=opt_sh, quant_state=quant_sh)
  abstract = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=abstract_params, opt_state=abstract_opt,
                        quant_state=abstract_quant)
  return graphdef, shardings, abstract


@functools.lru_cache(maxsize=16)
def abstract_init(cfg: Settings):
  """(params, quant state) as ShapeDtypeStructs, traced once per settings (see `logical_axes`)."""
  def init():
    _, params, quant_state, _ = split_model(build_model(cfg, jax.random.key(0)))
    return nnx.to_pure_dict(params), nnx.to_pure_dict(quant_state)
  return jax.eval_shape(init)


def create_train_state(cfg: Settings, mesh: Mesh, tx):
  """Initialises parameters directly into their shardings (no full copy on one device)."""
  graphdef, shardings, _ = state_shardings(cfg, mesh, tx)

  def init(key):
    _, params, quant_state, _ = split_model(build_model(cfg, key))
    params = nnx.to_pure_dict(params)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                      quant_state=nnx.to_pure_dict(quant_state))

  state = jax.jit(init, out_shardings=shardings)(init_key(cfg.seed))
  return graphdef, state, shardings


def state_around(cfg: Settings, tx, params, shardings: TrainState) -> TrainState:
  """A new run's TrainState (step 0, fresh optimizer and quantization state) around given parameters."""
  def init(params):
    _, _, quant_state, _ = split_model(build_model(cfg, init_key(cfg.seed)))
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                      quant_state=nnx.to_pure_dict(quant_state))

  return jax.jit(init, out_shardings=shardings)(params)


def init_key(seed: int) -> jax.Array:
  return jax.random.fold_in(jax.random.key(seed), 0)


def step_key(seed: int, step: jax.Array) -> jax.Array:
  """The per-step key for stochastic rounding: folded from seed and step (and, inside, the layer)."""
  return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), 1), step)
