"""Which mesh axes do what (ember/parallel/sharding.py): read from `mesh.rules`, so a config that changes the rules
changes what validation, the step and the planner count."""

import types

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from ember import config as config_lib
from ember.errors import ConfigError
from ember.parallel import sharding
from ember.parallel import mesh as mesh_lib
from ember.parallel.sharding import rules_dict
from ember.plan.layer import per_device_batch, sequence_shards
from ember.trainer.state import replica_axes
from tests.helpers import config, start

MESH_AXES = ("data", "fsdp", "context", "tensor", "expert")
MESH_AXES_ALL = ("pipeline", *MESH_AXES)


def _rules(cfg, **changed):
  return tuple((logical, changed.get(logical, mesh_axes)) for logical, mesh_axes in cfg.mesh.rules)


def _mesh(**sizes) -> Mesh:
  shape = [sizes.get(a, 1) for a in MESH_AXES]
  return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), MESH_AXES)


def test_the_default_rules():
  rules = config_lib.derive(config("tiny"), 8).mesh.rules_dict
  assert sharding.batch_axes(rules) == ("data", "fsdp", "expert")
  assert sharding.sequence_axes(rules) == ("context",) and sharding.layer_axes(rules) == ("pipeline",)
  mesh = _mesh(data=2, fsdp=2, context=2)
  assert sharding.batch_axes(rules, mesh) == ("data", "fsdp")  # Axes of one device left out.
  assert sharding.token_axes(rules, mesh) == ("data", "fsdp", "context")
  assert sharding.shards(sharding.token_axes(rules, mesh), dict(mesh.shape)) == 8


def test_fsdp_splits_each_kernel_along_its_leading_axis():
  """The gate/up kernel [embed, 2, mlp] along embed, the down projection [mlp, embed] along mlp (the `mlp_in`
  rule), each in its own leading axis; a rules table written without `mlp_in` splits wo as the default does."""
  s = start(config("tiny"), 8)
  specs = {jax.tree_util.keystr(path): leaf.sharding.spec for path, leaf in
           jax.tree_util.tree_flatten_with_path(s.state.params)[0] if "mlp" in jax.tree_util.keystr(path)}
  wi, wo = (next(v for k, v in specs.items() if f"'{name}'" in k and "kernel" in k) for name in ("wi", "wo"))
  assert tuple(wi)[1:] == ("fsdp", None, None) and tuple(wo)[1:] == ("fsdp", None)  # After the stacked layers' axis.
  old = tuple(r for r in config("tiny").mesh.rules if r[0] != "mlp_in")
  assert rules_dict(old)["mlp_in"] == ("tensor", "fsdp", "context") == rules_dict(config("tiny").mesh.rules)["mlp_in"]


def test_a_batch_rule_without_fsdp_is_what_validation_and_the_planner_count():
  """Batch split over data alone: FSDP still shards the weights, but every fsdp device sees the same rows."""
  cfg = config("tiny", **{"train.batch_size": 4, "mesh.fsdp": 2, "mesh.data": 4})
  cfg.mesh.rules = _rules(cfg, batch=("data",))
  settings = config_lib.validate(cfg, 8)
  assert sharding.batch_axes(settings.mesh.rules_dict) == ("data",)
  assert per_device_batch(settings) == 1 and sequence_shards(settings) == 1
  cfg.train.batch_size = 6  # Divisible by data*fsdp? No; by data alone? No: named as the rules have it.
  with pytest.raises(ConfigError, match=r"6 is not divisible by the data-parallel size data=4"):
    config_lib.validate(cfg, 8)
  cfg.train.batch_size, cfg.train.grad_accum_steps = 8, 3
  with pytest.raises(ConfigError, match=r"train.batch_size=8 / data=4 = 2"):
    config_lib.validate(cfg, 8)


def test_replicas_are_the_batch_axes_no_parameter_is_split_over():
  settings = config_lib.derive(config("tiny", **{"mesh.data": 2, "mesh.fsdp": 4}), 8)
  mesh = _mesh(data=2, fsdp=4)
  assert replica_axes(settings, mesh, "cpu") == ("data",)
  params = [("embed", "mlp"), ("vocab", "embed")]
  assert sharding.replica_axes(settings.mesh.rules_dict, mesh, params) == ("data",)
  # A parameter split over `data` makes it no replica axis; a recipe that partitions itself has none beside tensor.
  assert sharding.replica_axes(_dict(settings, mlp=("data",)), mesh, params) == ()
  assert sharding.replica_axes(settings.mesh.rules_dict, _mesh(data=2, tensor=4), params,
                           features_split_apart=False) == ()
  # A pipeline splits layers, not features: such a recipe keeps its replicas beside the stages (it lost them, and
  # with them the optimizer state's split and the once-a-step gradient reduction).
  staged = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("pipeline", "data", "fsdp"))
  assert sharding.replica_axes(settings.mesh.rules_dict, staged, params, features_split_apart=False) == ("data",)


def _dict(settings, **changed):
  return {**settings.mesh.rules_dict, **changed}


def test_the_axes_across_hosts_are_those_whose_lines_hold_two_processes():
  """A job over two hosts with no `mesh.dcn_*` set lays its devices out process by process: the first axis
  of more than one device crosses the hosts."""
  device = lambda p: types.SimpleNamespace(process_index=p)
  grid = np.array([[device(0), device(0)], [device(1), device(1)]], dtype=object)  # Rows are the processes.
  assert mesh_lib.axes_across_hosts(grid, ("data", "fsdp")) == {"data"}
  assert mesh_lib.axes_across_hosts(np.asarray(jax.devices()[:1]).reshape(1, 1), ("data", "fsdp")) == set()


def test_a_tensor_group_across_hosts_is_warned_about():
  """Two processes of 8 GPUs with mesh.tensor=2, mesh.expert=8 and no dcn axis: the process-major layout puts the
  processes along tensor, so every tensor group crosses the network; with the split on mesh.dcn_expert it does not."""
  devices = [types.SimpleNamespace(process_index=i // 8, id=i, platform="gpu") for i in range(16)]
  cfg = types.SimpleNamespace(**{a: 1 for a in MESH_AXES_ALL}, **{f"dcn_{a}": 1 for a in MESH_AXES_ALL})
  crossing = mesh_lib.device_grid(types.SimpleNamespace(**{**vars(cfg), "tensor": 2, "expert": 8}), devices)
  assert "mesh.tensor: its groups span processes" in mesh_lib.tensor_across_hosts(crossing)
  inside = mesh_lib.device_grid(types.SimpleNamespace(**{**vars(cfg), "tensor": 2, "expert": 4}), devices[:8])
  assert mesh_lib.tensor_across_hosts(inside) is None
