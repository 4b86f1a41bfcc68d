"""The device mesh: axes (data, fsdp, tensor, expert), hybrid across hosts.

A derived config's `mesh.data|fsdp|tensor|expert` are the sizes *within* a host (the fast
network: NVLink, ICI) and `mesh.dcn_data|dcn_fsdp|dcn_expert` the number of hosts along that axis (the slow
network: InfiniBand / Ethernet, "DCN"). The mesh axis `a` has size `mesh.a * mesh.dcn_a`, laid out
by `mesh_utils.create_hybrid_device_mesh` so that only the dcn axes cross hosts: each host holds
one contiguous block of the mesh. A host is a JAX process (one process per node, all its GPUs),
or a slice on TPU. Without dcn axes the devices keep JAX's order (by process, then local id), so
each process's devices are again one contiguous block along the batch axes and
`jax.make_array_from_process_local_data` places its rows in process order.

The sizes themselves are worked out here too, the one place (`mesh_shape`, `ici_dcn`: the -1 axis
resolved, hosts folded in, a one-line ConfigError naming the key otherwise); config.validate and
config.derive call them.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from ember.errors import ConfigError, bad_key, warn
from ember.names import MESH_AXES, TENSOR


def mesh_shape(mesh_cfg, num_devices: int) -> dict[str, int]:
  """{axis: size} for data, fsdp, tensor, expert: the -1 axis resolved, dcn (across-host) sizes folded in."""
  ici, dcn = ici_dcn(mesh_cfg, num_devices)
  return {a: ici[a] * dcn[a] for a in MESH_AXES}


def ici_dcn(mesh_cfg, num_devices: int) -> tuple[dict[str, int], dict[str, int]]:
  """Per-host sizes (`mesh.a`, -1 resolved) and host counts (`mesh.dcn_a`) of each axis; ConfigError naming
  the key when they do not make a mesh of `num_devices`."""
  dcn = {a: getattr(mesh_cfg, f"dcn_{a}", 1) for a in MESH_AXES}
  for a, d in dcn.items():
    if isinstance(d, bool) or not isinstance(d, int) or d < 1:
      bad_key(f"mesh.dcn_{a}", f"must be an integer >= 1, got {d!r}")
  hosts = math.prod(dcn.values())
  if num_devices % hosts:
    key = next(f"mesh.dcn_{a}" for a, d in dcn.items() if d > 1)
    bad_key(key, f"the dcn axes ask for {hosts} hosts, which do not divide the {num_devices} devices")
  per_host = num_devices // hosts
  ici = {a: getattr(mesh_cfg, a) for a in MESH_AXES}
  for a, s in ici.items():
    if isinstance(s, bool) or not isinstance(s, int) or s == 0 or s < -1:
      bad_key(f"mesh.{a}", f"must be an integer >= 1 or -1, got {s!r}")
  fill = [a for a, s in ici.items() if s < 0]
  if len(fill) > 1:
    bad_key(f"mesh.{fill[1]}", f"only one mesh axis may be -1 (mesh.{fill[0]} is)")
  known = math.prod(s for s in ici.values() if s > 0)
  if fill:
    if per_host % known:
      where = " per host" if hosts > 1 else ""
      # The axes set, not the one left to fill: what the user wrote is what does not divide.
      named = [a for a, s in ici.items() if s > 1]
      set_axes = " x ".join(f"mesh.{a}={ici[a]}" for a in named)
      bad_key(f"mesh.{named[0]}" if len(named) == 1 else "mesh",
              f"{set_axes} ({known}) does not divide the {per_host} devices{where} (mesh.{fill[0]}=-1 takes the "
              "rest)")
    ici[fill[0]] = per_host // known
  if math.prod(ici.values()) != per_host:
    shape = ", ".join(f"{a}={s * dcn[a]}" for a, s in ici.items())
    bad_key("mesh", f"mesh ({shape}) has {math.prod(ici.values()) * hosts} devices but {num_devices} are available")
  return ici, dcn



def make_mesh(mesh_cfg, devices=None) -> Mesh:
  """Builds the mesh from a derived config's `mesh` section (no -1 left), with a warning where a tensor-parallel
  group spans processes (hosts)."""
  grid = device_grid(mesh_cfg, list(devices if devices is not None else jax.devices()))
  problem = tensor_across_hosts(grid)
  if problem:
    warn(problem)
  return Mesh(grid, MESH_AXES)


def tensor_across_hosts(grid: np.ndarray) -> str | None:
  """A warning where the device grid's tensor-parallel groups span processes (hosts), else None: a mesh set with
  no mesh.dcn_* axis on several hosts lays the processes over its leading axes of more than one device, which
  may be tensor's."""
  if TENSOR not in axes_across_hosts(grid, MESH_AXES):
    return None
  sizes = ", ".join(f"{a}={n}" for a, n in zip(MESH_AXES, grid.shape) if n > 1)
  return (f"mesh.tensor: its groups span processes (hosts) in this mesh ({sizes}): two collectives a layer and pass "
          "cross the network. Split across hosts with the mesh.dcn_* axes (docs/multihost.md)")


def device_grid(mesh_cfg, devices: list) -> np.ndarray:
  """The devices as an array of the mesh's shape (data, fsdp, tensor, expert); see the module doc."""
  ici = [int(getattr(mesh_cfg, a)) for a in MESH_AXES]
  dcn = [int(getattr(mesh_cfg, f"dcn_{a}", 1)) for a in MESH_AXES]
  if math.prod(ici) * math.prod(dcn) != len(devices):
    raise ConfigError(f"config.mesh: {dict(zip(MESH_AXES, ici))} per host x {math.prod(dcn)} hosts does not "
                      f"match the {len(devices)} devices")
  if math.prod(dcn) > 1:
    by_slice = devices[0].platform == "tpu"
    granules = len({getattr(d, "slice_index" if by_slice else "process_index") for d in devices})
    if granules != math.prod(dcn):
      key = next(f"mesh.dcn_{a}" for a, d in zip(MESH_AXES, dcn) if d > 1)
      raise ConfigError(f"config.{key}: the dcn axes ask for {math.prod(dcn)} hosts but the job has {granules} "
                        f"{'slices' if by_slice else 'processes'}")
    grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices=devices, process_is_granule=not by_slice)
  else:
    if devices[0].platform == "tpu":  # One slice: follow the physical torus.
      grid = mesh_utils.create_device_mesh(tuple(ici), devices=devices)
    else:  # Process-major (on GPU that is also id order): each process owns a contiguous block.
      grid = np.asarray(sorted(devices, key=lambda d: (d.process_index, d.id))).reshape(tuple(ici))
  return grid


def axes_across_hosts(devices: np.ndarray, axis_names) -> set[str]:
  """The mesh axes along which a line of the device grid holds devices of more than one process: those whose
  collectives cross hosts (the dcn axes; with none set, whichever axes the process-major layout spreads over the
  processes)."""
  process = np.vectorize(lambda d: d.process_index, otypes=[int])(devices)
  return {a for i, a in enumerate(axis_names) if (process != np.take(process, [0], axis=i)).any()}
