"""The device mesh: axes (data, fsdp, tensor, expert), hybrid across hosts.

Within a host the mesh follows the config's `mesh.*` sizes; across hosts the `mesh.dcn_*` sizes
multiply the matching axis, laid out so that only those axes cross the slow network
(`mesh_utils.create_hybrid_device_mesh`). On one process the plain device order is used.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from ember.config import MESH_AXES


def make_mesh(mesh_cfg, devices=None) -> Mesh:
  """Builds the mesh from a derived config's `mesh` section (no -1 left)."""
  devices = list(devices if devices is not None else jax.devices())
  ici = [int(mesh_cfg[a]) for a in MESH_AXES]
  dcn = [int(mesh_cfg.get(f"dcn_{a}", 1)) for a in MESH_AXES]
  if int(np.prod(dcn)) > 1:
    grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices=devices)
  else:
    shape = tuple(i * d for i, d in zip(ici, dcn))
    try:
      grid = mesh_utils.create_device_mesh(shape, devices=devices)
    except (AssertionError, NotImplementedError, ValueError):
      grid = np.asarray(devices).reshape(shape)
  return Mesh(grid, MESH_AXES)
