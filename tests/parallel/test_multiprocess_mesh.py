"""Multi-host pieces that need no second process: dcn mesh sizes, device layout, init settings, data shards."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from ember import config as config_lib
from ember.config import ConfigError, defaults
from ember.config.settings import Mesh
from ember.parallel import distributed
from ember.parallel import mesh as mesh_lib
from ember.parallel.mesh import device_grid, make_mesh


def _cfg(**mesh):
  c = defaults.get_config()
  c.mesh.update(mesh)
  return c


@pytest.mark.parametrize("mesh,devices,total,per_host", [
    (dict(fsdp=-1, dcn_fsdp=2), 8, dict(data=1, fsdp=8), dict(data=1, fsdp=4)),
    (dict(data=2, fsdp=-1, dcn_data=2), 8, dict(data=4, fsdp=2), dict(data=2, fsdp=2)),
    (dict(data=1, fsdp=2, dcn_data=2, dcn_fsdp=2), 8, dict(data=2, fsdp=4), dict(data=1, fsdp=2)),
    (dict(fsdp=-1, tensor=2), 8, dict(data=1, fsdp=4), dict(data=1, fsdp=4)),
    (dict(fsdp=1, expert=-1, dcn_expert=2), 8, dict(fsdp=1, expert=8), dict(fsdp=1, expert=4)),
])
def test_dcn_axes_multiply_the_per_host_axes(mesh, devices, total, per_host):
  cfg = _cfg(**mesh)
  shape = mesh_lib.mesh_shape(cfg.mesh, devices)
  assert {a: shape[a] for a in total} == total
  derived = config_lib.derive(cfg, devices)
  assert {a: getattr(derived.mesh, a) for a in per_host} == per_host
  assert np.prod(list(derived.mesh.sizes().values())) == devices


@pytest.mark.parametrize("mesh,devices,key", [
    (dict(fsdp=-1, dcn_fsdp=3), 8, "config.mesh.dcn_fsdp"),  # 3 hosts cannot share 8 devices.
    (dict(fsdp=-1, dcn_data=0), 8, "config.mesh.dcn_data"),
    (dict(fsdp=-1, dcn_fsdp=-1), 8, "config.mesh.dcn_fsdp"),
    (dict(fsdp=3, dcn_fsdp=2), 8, "config.mesh:"),
    (dict(data=-1, fsdp=-1), 8, "config.mesh.fsdp"),
    (dict(fsdp=-1, tensor=3, dcn_fsdp=2), 8, "config.mesh.tensor"),  # 4 per host, not divisible by 3.
])
def test_bad_mesh_sizes_name_the_key(mesh, devices, key):
  with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
    mesh_lib.mesh_shape(_cfg(**mesh).mesh, devices)


@dataclasses.dataclass(frozen=True)
class FakeDevice:
  id: int
  process_index: int
  platform: str = "gpu"
  device_kind: str = "fake"
  slice_index: int = 0


def _devices(processes: int, per_process: int, shuffle: bool = False) -> list[FakeDevice]:
  devs = [FakeDevice(p * 100 + i, p) for p in range(processes) for i in range(per_process)]
  if shuffle:
    devs = [devs[i] for i in np.random.default_rng(0).permutation(len(devs))]
  return devs


def _mesh_cfg(**sizes):
  m = dict(pipeline=1, data=1, fsdp=1, context=1, tensor=1, expert=1, dcn_pipeline=1, dcn_data=1, dcn_fsdp=1,
           dcn_expert=1, rules=())
  m.update(sizes)
  return Mesh(**m)


def test_each_process_owns_a_contiguous_block_without_dcn():
  grid = device_grid(_mesh_cfg(data=2, fsdp=4), _devices(2, 4, shuffle=True))
  procs = np.vectorize(lambda d: d.process_index)(grid)[0, :, :, 0, 0, 0]
  np.testing.assert_array_equal(procs, [[0, 0, 0, 0], [1, 1, 1, 1]])


def test_hybrid_mesh_puts_only_dcn_axes_across_processes():
  # 4 processes x 4 devices: per host data=1, fsdp=2, tensor=2; across hosts data=2, fsdp=2.
  grid = device_grid(_mesh_cfg(fsdp=2, tensor=2, dcn_data=2, dcn_fsdp=2), _devices(4, 4, shuffle=True))
  assert grid.shape == (1, 2, 4, 1, 2, 1)
  procs = np.vectorize(lambda d: d.process_index)(grid)[0, :, :, 0, :, 0]
  # The tensor axis never crosses a process; the 2x2 host blocks follow process order.
  assert (procs[:, :, 0] == procs[:, :, 1]).all()
  np.testing.assert_array_equal(procs[:, :, 0], [[0, 0, 1, 1], [2, 2, 3, 3]])


def test_expert_parallelism_across_hosts():
  # 2 processes x 4 devices: experts over 4 devices per host and 2 hosts (dcn_expert), fsdp inside each host.
  grid = device_grid(_mesh_cfg(fsdp=2, expert=2, dcn_expert=2), _devices(2, 4, shuffle=True))
  assert grid.shape == (1, 1, 2, 1, 1, 4)
  procs = np.vectorize(lambda d: d.process_index)(grid)[0, 0, :, 0, 0, :]
  assert (procs[0] == procs[1]).all()  # fsdp stays inside a host ...
  np.testing.assert_array_equal(procs[0], [0, 0, 1, 1])  # ... and the expert axis spans both.


def test_dcn_axes_must_match_the_process_count():
  with pytest.raises(ConfigError, match=r"config\.mesh\.dcn_fsdp: .* 2 hosts but the job has 1 processes"):
    device_grid(_mesh_cfg(fsdp=4, dcn_fsdp=2), _devices(1, 8))


def test_make_mesh_on_this_process():
  mesh = make_mesh(_mesh_cfg(data=2, fsdp=2, tensor=2))
  assert dict(mesh.shape) == dict(pipeline=1, data=2, fsdp=2, context=1, tensor=2, expert=1)
  assert list(mesh.devices.flat) == sorted(jax.devices(), key=lambda d: d.id)


@dataclasses.dataclass
class DistCfg:
  coordinator_address: str = ""
  num_processes: int = 0
  process_id: int = -1


def test_init_settings(monkeypatch):
  for k in ("EMBER_COORDINATOR_ADDRESS", "EMBER_NUM_PROCESSES", "EMBER_PROCESS_ID", "SLURM_NTASKS", "SLURM_NNODES",
            "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NUM_NODES", "SLURM_NTASKS_PER_NODE", "SLURM_GPUS_ON_NODE",
            "JAX_LOCAL_DEVICE_IDS", "SLURM_STEP_NODELIST"):
    monkeypatch.delenv(k, raising=False)
  assert distributed.settings(DistCfg()) is None  # One process: nothing to initialise.
  monkeypatch.setenv("SLURM_NTASKS", "4")
  # In an allocation of 4 tasks but not started by srun (python on a node of `salloc -N4`): one process; JAX's
  # detection would stop on the coordinator, which only an srun step names.
  assert distributed.settings(DistCfg()) is None
  monkeypatch.setenv("SLURM_STEP_NODELIST", "node[01-04]")
  assert distributed.settings(DistCfg()) == {}  # JAX's own SLURM detection.
  # `srun -N4 -n4 --gpus-per-node=8` (no --ntasks-per-node): one task a node, each with its node's 8 GPUs ...
  monkeypatch.setenv("SLURM_GPUS_ON_NODE", "8")
  monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")
  monkeypatch.setenv("SLURM_STEP_NUM_NODES", "4")
  assert distributed.settings(DistCfg()) == {"local_device_ids": list(range(8))}
  monkeypatch.setenv("SLURM_STEP_NUM_NODES", "2")  # ... and two a node: JAX's task k -> GPU k.
  assert distributed.settings(DistCfg()) == {}
  for k in ("SLURM_GPUS_ON_NODE", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NUM_NODES"):
    monkeypatch.delenv(k)
  monkeypatch.setenv("EMBER_COORDINATOR_ADDRESS", "10.0.0.1:1234")
  monkeypatch.setenv("EMBER_NUM_PROCESSES", "2")
  monkeypatch.setenv("EMBER_PROCESS_ID", "1")
  assert distributed.settings(DistCfg()) == dict(coordinator_address="10.0.0.1:1234", num_processes=2, process_id=1)
  flags = DistCfg("host:9", 4, 3)  # Flags win over the environment.
  assert distributed.settings(flags) == dict(coordinator_address="host:9", num_processes=4, process_id=3)
  with pytest.raises(ConfigError, match=r"config\.distributed"):
    distributed.settings(DistCfg("host:9", 4, 4))
  # A malformed address or count: one line naming it (JAX's own errors were tracebacks, an IndexError among them).
  for address in ("localhost", "host:port", "host:0"):
    with pytest.raises(ConfigError, match=rf"^config\.distributed\.coordinator_address: '{address}' is not HOST:PORT"):
      distributed.settings(DistCfg(address, 2, 0))
  monkeypatch.setenv("EMBER_NUM_PROCESSES", "two")
  with pytest.raises(ConfigError, match=r"^EMBER_NUM_PROCESSES='two': not an integer"):
    distributed.settings(DistCfg())


def test_data_shards_follow_the_rows_a_process_holds():
  rows = distributed.ProcessRows
  # 0: one shard per row of the global batch, whatever the process count.
  assert distributed.data_shards(0, 8, rows(((4, 8),))) == distributed.DataShards(count=8, rows=1, mine=(4, 5, 6, 7))
  assert distributed.data_shards(0, 8).mine == tuple(range(8))  # One process: every row.
  assert distributed.data_shards(4, 8, rows(((4, 8),))) == distributed.DataShards(count=4, rows=2, mine=(2, 3))
  # Rows in two blocks (a layout whose devices hold rows 0-1 and 4-5), and a second reader of rows 0-7.
  assert distributed.data_shards(4, 8, rows(((0, 2), (4, 6)))).mine == (0, 2)
  assert distributed.data_shards(0, 8, rows(((0, 8),), primary=False)).primary is False
  with pytest.raises(ConfigError, match=r"config\.data\.num_shards: 3 data shards do not divide train\.batch_size=8"):
    distributed.data_shards(3, 8)
  with pytest.raises(ConfigError, match=r"config\.data\.num_shards: shards of 4 rows do not fit rows 2-3 of the batch"):
    distributed.data_shards(2, 8, rows(((2, 4),)))
