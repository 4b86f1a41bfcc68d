"""A trained model back from its checkpoint, for sampling and export: the config saved with it, the
parameters restored onto a mesh (the one it was trained on, when the devices allow, or one device)."""

from __future__ import annotations

import dataclasses
import math
import os

import jax
from flax import nnx

from ember.config import Settings, from_saved
from ember.errors import ConfigError
from ember.layers.decoder import Transformer, keys_of
from ember.layers.moe import ROUTER_BIAS
from ember.names import PIPELINE
from ember.parallel import sharding
from ember.parallel.mesh import make_mesh
from ember.trainer import checkpointing, precision
from ember.trainer.state import abstract_init, logical_axes


def load_model(path: str, *, what: str, recipe: str | None = None, dtype: str | None = None,
               one_device: bool = False, host: bool = False):
  """(settings, mesh, model) of the checkpoint at `path` (a workdir, its checkpoints/ or a step directory).

  `recipe` replaces the trained quantization recipe (e.g. "bf16": the unquantized forward pass that
  serving stacks run); `dtype` the compute dtype; `host` puts it on the host's CPU device (export needs
  host memory, not an accelerator's). Call the model inside `sharding.use_rules(mesh, rules)`.
  """
  saved, step_dir = checkpointing.saved_config(path, what)
  # No health statistics while sampling.
  cfg = from_saved(saved, {"log.quant_stats_every": 0, **({"model.dtype": dtype} if dtype else {})})
  cfg = cfg.at_phase(precision.Phases(cfg).state_phase(int(os.path.basename(step_dir))))  # The phase that saved it.
  if not one_device and not host and math.prod(cfg.mesh.sizes().values()) == jax.device_count():
    if cfg.mesh.context > 1:  # Decoding feeds a token at a time: the context devices shard the state as fsdp.
      cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, fsdp=cfg.mesh.fsdp * cfg.mesh.context,
                                                              context=1))
    if cfg.mesh.sizes()[PIPELINE] > 1:  # Nor through stages: theirs shard it as fsdp, the model's rows alone.
      cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(
          cfg.mesh, fsdp=cfg.mesh.fsdp * cfg.mesh.pipeline, pipeline=1,
          dcn_fsdp=cfg.mesh.dcn_fsdp * cfg.mesh.dcn_pipeline, dcn_pipeline=1))
    mesh = make_mesh(cfg.mesh)
  else:  # One device: every axis and host count 1.
    ones = {f.name: 1 for f in dataclasses.fields(cfg.mesh) if f.name != "rules"}
    cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, **ones))
    mesh = make_mesh(cfg.mesh, (jax.devices("cpu") if host else jax.devices())[:1])
  trained, cfg = cfg, cfg.replace("quant.recipe", recipe) if recipe else cfg
  graphdef, want = _targets(cfg, mesh)
  # Another recipe may stack the layers into other scan segments (its `quant.exclude`): the checkpoint is read
  # as it was trained, then each layer's rows are stacked where this recipe runs them.
  restack = trained.model.segments(trained.quant) != cfg.model.segments(cfg.quant)
  held = _targets(trained, mesh)[1] if restack else want
  targets = {"params": held["params"]}
  if jax.tree.leaves(want["quant_state"]):
    histories = [p for p, _ in jax.tree_util.tree_leaves_with_path(want["quant_state"])
                 if keys_of(p)[-1] != ROUTER_BIAS]
    if histories and cfg.quant.name != trained.quant.name:
      raise ConfigError(f"recipe {cfg.quant.name!r} keeps amax histories that a {trained.quant.name!r} checkpoint "
                        "does not have")
    targets["quant_state"] = held["quant_state"]
  restored = checkpointing.restore_fields(path, targets, what, checkpointing.stacked_of(trained))
  if restack:  # Each layer's rows where this recipe stacks them, on this recipe's shardings.
    restored = {field: jax.device_put(precision.restacked(tree, trained, cfg, want[field]),
                                      jax.tree.map(lambda a: a.sharding, want[field]))
                for field, tree in restored.items()}
  model: Transformer = nnx.merge(graphdef, restored["params"], restored.get("quant_state", {}))
  return cfg, mesh, model


def _targets(cfg: Settings, mesh) -> tuple:
  """(graphdef, {"params": ..., "quant_state": ...}) of `cfg`'s model: ShapeDtypeStructs placed on `mesh`."""
  graphdef, param_specs, quant_specs = logical_axes(cfg)
  abstract_params, abstract_quant = abstract_init(cfg)
  place = lambda abstract, specs: jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract,
      sharding.tree_shardings(specs, mesh, cfg.mesh.rules))
  return graphdef, {"params": place(abstract_params, param_specs), "quant_state": place(abstract_quant, quant_specs)}

