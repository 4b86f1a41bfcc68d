"""Multi-process initialisation: SLURM, documented environment variables or flags, or nothing.

Order of precedence:
  1. `--config.distributed.*` (coordinator_address, num_processes, process_id);
  2. environment: EMBER_COORDINATOR_ADDRESS (host:port of process 0), EMBER_NUM_PROCESSES,
     EMBER_PROCESS_ID (launch/local.sh sets these);
  3. SLURM with more than one task: JAX's own cluster detection (`jax.distributed.initialize()`);
  4. otherwise one process: nothing to initialise.
Must run before anything touches a JAX device.
"""

from __future__ import annotations

import os

import jax

from ember.config import ConfigError


def settings(dist_cfg) -> dict | None:
  """The arguments for `jax.distributed.initialize`, {} for auto-detection, or None for one process."""
  address = dist_cfg.coordinator_address or os.environ.get("EMBER_COORDINATOR_ADDRESS", "")
  num = dist_cfg.num_processes or int(os.environ.get("EMBER_NUM_PROCESSES", "0") or 0)
  pid = dist_cfg.process_id if dist_cfg.process_id >= 0 else int(os.environ.get("EMBER_PROCESS_ID", "-1") or -1)
  if address or num > 1:
    if not (address and num > 0 and 0 <= pid < num):
      raise ConfigError("config.distributed: multi-process needs coordinator_address, num_processes and a "
                        f"process_id in [0, num_processes) (got {address!r}, {num}, {pid})")
    return dict(coordinator_address=address, num_processes=num, process_id=pid)
  if int(os.environ.get("SLURM_NTASKS", "1")) > 1:
    return {}
  return None


def initialize(dist_cfg) -> None:
  args = settings(dist_cfg)
  if args is None:
    return
  # CPU devices of several processes talk over gloo (TCP); GPU backends ignore this setting.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(**args)
