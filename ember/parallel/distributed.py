"""Multi-process set-up: initialisation, which data shards a process reads, preemption notices.

Initialisation, in order of precedence:
  1. `--config.distributed.*` (coordinator_address, num_processes, process_id);
  2. environment: EMBER_COORDINATOR_ADDRESS (host:port of process 0), EMBER_NUM_PROCESSES,
     EMBER_PROCESS_ID (launch/local.sh and the Kubernetes manifest set these);
  3. SLURM with more than one task: JAX's own cluster detection (`jax.distributed.initialize()`
     reads SLURM_* for the coordinator, the process count and id); with one task per node
     (SLURM_NTASKS_PER_NODE=1, or as many tasks as nodes) each process gets all SLURM_GPUS_ON_NODE GPUs,
     not JAX's default of GPU SLURM_LOCALID (JAX_LOCAL_DEVICE_IDS, if set, wins);
  4. otherwise one process: nothing to initialise.
`initialize` must run before anything touches a JAX device.

Preemption: one process gets SIGTERM, every process must stop *at the same step* (a checkpoint
is a collective). With several processes JAX's preemption service does this: its notifier
catches SIGTERM, the coordination service agrees on a step, and
`multihost_utils.reached_preemption_sync_point(step)` turns True on every process at that step
(Orbax's `reached_preemption` is the same call). With one process a Python SIGTERM handler
sets a flag.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys

import jax
import numpy as np

from ember import errors
from ember.errors import ConfigError


def settings(dist_cfg) -> dict | None:
  """The arguments for `jax.distributed.initialize`, {} for auto-detection, or None for one process."""
  address = dist_cfg.coordinator_address or os.environ.get("EMBER_COORDINATOR_ADDRESS", "")
  num = dist_cfg.num_processes or _env_int("EMBER_NUM_PROCESSES", 0)
  pid = dist_cfg.process_id if dist_cfg.process_id >= 0 else _env_int("EMBER_PROCESS_ID", -1)
  if address or num > 1:
    if not (address and num > 0 and 0 <= pid < num):
      raise ConfigError("config.distributed: multi-process needs coordinator_address, num_processes and a "
                        f"process_id in [0, num_processes) (got {address!r}, {num}, {pid})")
    host, _, port = address.rpartition(":")
    if not (host and port.isdigit() and 0 < int(port) < 65536):
      raise ConfigError(f"config.distributed.coordinator_address: {address!r} is not HOST:PORT (process 0's host "
                        "and a free port, e.g. node001:8476)")
    return dict(coordinator_address=address, num_processes=num, process_id=pid)
  if int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1:
    if "SLURM_STEP_NODELIST" not in os.environ:  # The allocation's, not a step's: python run outside srun.
      errors.warn(f"SLURM_NTASKS={os.environ['SLURM_NTASKS']} but this process is not an srun task: it runs alone; "
                  "launch the job's tasks with srun (launch/slurm.sbatch)")
      return None
    return _slurm_local_devices()
  return None


def _env_int(name: str, default: int) -> int:
  value = os.environ.get(name, "")
  try:
    return int(value) if value else default
  except ValueError:
    raise ConfigError(f"{name}={value!r}: not an integer (launch/local.sh and the manifests set it)") from None


def _slurm_local_devices() -> dict:
  """JAX's SLURM detection gives task k of a node GPU k only; one task per node gets all its GPUs."""
  gpus = os.environ.get("SLURM_GPUS_ON_NODE", "")
  if _one_task_per_node() and gpus.isdigit() and not os.environ.get("JAX_LOCAL_DEVICE_IDS"):
    return {"local_device_ids": list(range(int(gpus)))}
  return {}


def _one_task_per_node() -> bool:
  """SLURM sets SLURM_NTASKS_PER_NODE only where --ntasks-per-node was given; `srun -N4 -n4` says it by its
  counts: as many tasks in the step as nodes."""
  env = os.environ.get
  tasks = env("SLURM_STEP_NUM_TASKS") or env("SLURM_NTASKS", "")
  nodes = env("SLURM_STEP_NUM_NODES") or env("SLURM_NNODES", "")
  return env("SLURM_NTASKS_PER_NODE") == "1" or (tasks.isdigit() and tasks == nodes)


def initialize(dist_cfg) -> None:
  """Joins the job (when there is one to join), and notes this process's index for the warnings (ember/errors.py)."""
  args = settings(dist_cfg)
  if args is not None and not _initialized():
    # CPU devices of several processes talk over gloo (TCP); GPU backends ignore this setting.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**args)
  errors.note_process_index(jax.process_index())


def _initialized() -> bool:
  from jax._src import distributed as jax_distributed  # No public query in JAX 0.10.
  return jax_distributed.global_state.client is not None


@dataclasses.dataclass(frozen=True)
class DataShards:
  """Which data shards there are and which this process reads (`data_shards`)."""
  count: int  # Shards of every global batch, each its own pipeline over its own share of the documents.
  rows: int  # Rows of the global batch each shard feeds.
  mine: tuple[int, ...]  # This process's shards, in global row order.
  primary: bool = True  # The first process reading these shards: the one whose counts of them are summed.


@dataclasses.dataclass(frozen=True)
class ProcessRows:
  """The rows of a global batch a process feeds (`process_rows`)."""
  blocks: tuple[tuple[int, int], ...]  # [start, stop) ranges, in order.
  primary: bool = True  # No process of a lower index feeds the same rows.


def data_shards(num_shards: int, batch_size: int, rows: ProcessRows | None = None) -> DataShards:
  """The data-shard rule, the one place it is written.

  A global batch of `batch_size` rows (`train.batch_size`) is cut into `num_shards` shards
  (`data.num_shards`; 0 means one shard per row) of consecutive rows; a process reads the shards of the rows
  its devices hold (`rows`, from the batch's sharding: `process_rows`; None: every row, one process). With the
  default the global batches, and a saved data position, are independent of the process count and layout.
  Raises ConfigError naming the key when the shards do not divide the batch or a process's rows.
  """
  count = num_shards or batch_size
  if batch_size % count:
    raise ConfigError(f"config.data.num_shards: {count} data shards do not divide train.batch_size={batch_size}")
  per = batch_size // count
  rows = rows or ProcessRows(blocks=((0, batch_size),))
  for start, stop in rows.blocks:
    if start % per or stop % per:
      key = "data.num_shards" if num_shards else "train.batch_size"
      raise ConfigError(f"config.{key}: shards of {per} rows do not fit rows {start}-{stop - 1} of the batch, "
                        f"which process {jax.process_index()}'s devices hold")
  mine = tuple(s for start, stop in rows.blocks for s in range(start // per, stop // per))
  return DataShards(count=count, rows=per, mine=mine, primary=rows.primary)


def process_rows(sharding, batch_size: int, seq_len: int) -> ProcessRows:
  """The rows of a [batch_size, seq_len] batch that this process's devices hold under `sharding`: what it feeds
  `jax.make_array_from_process_local_data`, which places a process's distinct row slices in order. Processes
  whose devices split something other than the batch (pipeline stages, tensor or context ranks on other
  hosts) hold the same rows, and so read the same shards."""
  held: dict[int, set[tuple[int, int]]] = {}
  for device, index in sharding.devices_indices_map((batch_size, seq_len)).items():
    rows = index[0]
    stop = batch_size if rows.stop is None else rows.stop
    held.setdefault(device.process_index, set()).add((rows.start or 0, stop))
  mine = held[jax.process_index()]
  return ProcessRows(blocks=tuple(sorted(mine)),
                     primary=not any(blocks == mine for p, blocks in held.items() if p < jax.process_index()))


def sum_over_processes(values: np.ndarray) -> np.ndarray:
  """`values` summed over every process (each calls it at the same point); itself with one process."""
  return gather_over_processes(values).sum(axis=0)


def fetched(tree):
  """`tree`'s arrays whole on this host, as numpy: `jax.device_get`, or with several processes a gather of the
  parts other processes hold (a collective: every process calls it at the same point)."""
  if jax.process_count() == 1:
    return jax.device_get(tree)
  from jax.experimental import multihost_utils
  return multihost_utils.process_allgather(tree, tiled=True)


def gather_over_processes(values: np.ndarray) -> np.ndarray:
  """Every process's `values` stacked, [processes, ...] in process order (each calls it at the same point)."""
  values = np.asarray(values)
  if jax.process_count() == 1:
    return values[None]
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(values)).reshape(-1, *values.shape)


class Preemption:
  """`reached(step)`: True at the step where every process should save and stop."""

  def __init__(self):
    self._flag = False
    self.signal = "SIGTERM"  # The notice's name, for the run's last line.
    self._previous: dict = {}
    from jax._src import distributed as jax_distributed
    # JAX's notifier (installed by jax.distributed.initialize) owns SIGTERM in a multi-process job;
    # a Python handler would replace it and the other processes would never hear of the notice.
    self._service = jax.process_count() > 1 and jax_distributed.global_state.preemption_sync_manager is not None

  def install(self) -> "Preemption":
    """SIGTERM, and in one process Ctrl-C (SIGINT) too: the first stops the run after its step with a checkpoint,
    a second Ctrl-C interrupts at once. (Several processes get Ctrl-C as a SIGTERM from their launcher.)"""
    if not self._service:
      try:
        self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._handle)
        if jax.process_count() == 1:
          self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._handle)
      except ValueError:  # Not the main thread (a test harness): no preemption handling.
        self._previous = {}
    return self

  def _handle(self, signum, _frame):
    self._flag = True
    if signum == signal.SIGINT:
      self.signal = "SIGINT"
      signal.signal(signal.SIGINT, signal.default_int_handler)  # A second Ctrl-C: KeyboardInterrupt, at once.
      print("stopping after this step with a checkpoint (Ctrl-C again to stop at once)", file=sys.stderr, flush=True)

  def reached(self, step: int) -> bool:
    """Call once per step, with the same step on every process."""
    if self._service:
      from jax.experimental import multihost_utils
      return multihost_utils.reached_preemption_sync_point(step)
    if jax.process_count() == 1:
      return self._flag
    # Several processes without JAX's preemption service: agree every step (a small all-gather).
    from jax.experimental import multihost_utils
    return bool(np.any(multihost_utils.process_allgather(np.asarray(self._flag))))

  def uninstall(self):
    for signum, previous in self._previous.items():
      if previous is not None:
        signal.signal(signum, previous)
    self._previous = {}
