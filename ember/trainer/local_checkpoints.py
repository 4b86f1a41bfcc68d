"""The local tier: frequent checkpoints on each node's own disk, each process's part also kept by a peer.

Persistent checkpoints (ember/trainer/checkpointing.py, Orbax, `checkpoint.every_steps`) go to shared storage and
are slow to write at scale; these go every `checkpoint.local_every_steps` to `checkpoint.local_dir`, node-local
storage. Each process writes its own part: the shards of the train state its devices hold and its data position.
A lost node takes its disk with it, so every process also sends its part to the next process (p -> p + 1 mod n,
one collective permute over one device per process) and keeps that copy beside its own. A restart takes the newest
step that every process can rebuild, from its own part or from the copy its peer kept (sent back the other way),
when that step is newer than the newest persistent checkpoint.

A local step serves only the same layout: the process count, the mesh and the state's shardings and the seed are
hashed into each file's name, so a job restarted on another mesh or process count never reads them and restores
from the persistent tier instead (which reshards).

Orbax's emergency checkpoint managers (orbax.checkpoint.experimental.emergency) were the first choice; they restore
a lost process's part from another replica of the same shards (a data-parallel copy in another slice), which a
fully-sharded layout (every process holds a different part: FSDP over all the devices, ember's default) does not
have, so they fall back to the persistent tier exactly where a node is lost. Hence this explicit peer copy.

Files: `<local_dir>/run-<run>/<step>/process_<p>-of-<n>-<layout>.bin` (process p's part) and
`peer_<p>-of-<n>-<layout>.bin` (the copy of process p's part, kept by process p + 1), each written under a temporary
name and renamed when complete; `<run>` is the run's id, made by its first start and kept in its workdir
(`run_id`), so a run sees only its own steps: neither another run's nor those of an earlier run in a workdir of
the same path, deleted since.
`local_dir` may hold `{process}` (one directory per process, for several processes per node sharing a disk or a test
on one machine). A part: an 8-byte header length, a JSON header {key: [dtype, shape, offset,
nbytes]}, then the bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ember import storage
from ember.errors import ConfigError

DATA_KEY = "__data__"
KEEP = 2  # Local steps kept on each disk.
CHUNK_BYTES = 1 << 29  # The peer exchange in pieces of at most this much device memory.
MAX_STEPS = 16  # Steps one process reports when the processes agree on a step to restore.
RUN_ID_FILE = "local_checkpoints_run"  # In the workdir: the run's id, the name of its directory of local steps.


def _index_key(path, index: tuple) -> str:
  """A shard's key: its leaf's path and its index in the global array (the same on any process)."""
  dims = ",".join(f"{s.start or 0}:{'' if s.stop is None else s.stop}" for s in index)
  return f"{jax.tree_util.keystr(path)}[{dims}]"


def pack(parts: dict[str, np.ndarray]) -> bytes:
  header, offset = {}, 0
  for key, a in parts.items():
    header[key] = [a.dtype.name, list(a.shape), offset, a.nbytes]
    offset += a.nbytes
  head = json.dumps(header).encode()
  return b"".join([struct.pack("<Q", len(head)), head, *(np.ascontiguousarray(a).tobytes() for a in parts.values())])


def unpack(blob: bytes) -> dict[str, np.ndarray]:
  (length,) = struct.unpack("<Q", blob[:8])
  header, body = json.loads(blob[8:8 + length]), memoryview(blob)[8 + length:]
  return {key: np.frombuffer(body[off:off + n], dtype=jnp.dtype(dtype)).reshape(shape)
          for key, (dtype, shape, off, n) in header.items()}


def layout(abstract, shardings, mesh: Mesh, seed: int) -> str:
  """A hash of what a local part can serve: the processes, the mesh, each leaf's shape, dtype and sharding."""
  leaves = jax.tree_util.tree_flatten_with_path(abstract)[0]
  specs = jax.tree.leaves(shardings, is_leaf=lambda s: isinstance(s, NamedSharding))
  text = json.dumps([jax.process_count(), dict(mesh.shape), seed,
                     [(jax.tree_util.keystr(p), a.shape, str(a.dtype), str(s.spec)) for (p, a), s in zip(leaves, specs)]])
  return hashlib.blake2b(text.encode(), digest_size=6).hexdigest()


def _one_device_per_process() -> Mesh:
  devices = [min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
             for p in range(jax.process_count())]
  return Mesh(np.asarray(devices), ("process",))


def exchange(blob: bytes, shift: int) -> bytes:
  """`blob` sent to process (p + shift) mod n, and the blob of process (p - shift) mod n received (every process
  calls it at the same point): a collective permute of byte rows, one device per process, in pieces."""
  n, me = jax.process_count(), jax.process_index()
  if n == 1:
    return blob
  sizes = np.asarray(multihost_utils.process_allgather(np.asarray([len(blob)], np.int64))).reshape(-1)
  mesh = _one_device_per_process()
  mine = mesh.devices[me]
  sharding = NamedSharding(mesh, P("process"))
  permute = jax.jit(jax.shard_map(lambda x: jax.lax.ppermute(x, "process", [(p, (p + shift) % n) for p in range(n)]),
                                  mesh=mesh, in_specs=P("process"), out_specs=P("process")))
  data = np.frombuffer(blob, np.uint8)
  received = []
  for start in range(0, int(sizes.max()), CHUNK_BYTES):
    piece = np.zeros((1, min(CHUNK_BYTES, int(sizes.max()) - start)), np.uint8)
    own = data[start:start + piece.shape[1]]
    piece[0, :len(own)] = own
    rows = jax.make_array_from_single_device_arrays((n, piece.shape[1]), sharding, [jax.device_put(piece, mine)])
    received.append(np.asarray(permute(rows).addressable_shards[0].data)[0])
  source = (me - shift) % n
  return np.concatenate(received or [np.zeros(0, np.uint8)])[:sizes[source]].tobytes()


def run_id(workdir: str) -> str:
  """The run's id: made by process 0 at the run's first start and written (atomically) to the workdir, read there
  by every later start, the same on every process. A workdir deleted and made again at the same path is a new
  run, which must not resume from the local steps the old one left on the nodes' disks."""
  token = np.zeros(8, np.uint8)
  if jax.process_index() == 0:
    token = np.frombuffer(bytes.fromhex(storage.kept_id(storage.join(workdir, RUN_ID_FILE), 8)), np.uint8)
  if jax.process_count() > 1:
    token = np.asarray(multihost_utils.broadcast_one_to_all(token))
  return bytes(np.asarray(token, np.uint8)).hex()


class LocalCheckpoints:
  """Save and restore of the local tier (the module's docstring)."""

  def __init__(self, directory: str, every_steps: int, mesh: Mesh, seed: int, workdir: str):
    """The run's steps go to a directory of their own under `directory`, `run-<id>` (`run_id(workdir)`): runs that
    share a node's disk neither resume from nor prune each other's steps."""
    base = directory.replace("{process}", str(jax.process_index()))  # An absolute local path (validated).
    self.directory = os.path.join(base, "run-" + run_id(workdir))
    self.every_steps, self.mesh, self.seed = every_steps, mesh, seed
    self.process, self.count = jax.process_index(), jax.process_count()
    try:
      os.makedirs(self.directory, exist_ok=True)
    except OSError as e:  # Checked here, on the node that writes it, not where the config was validated.
      raise ConfigError(f"config.checkpoint.local_dir: cannot create {self.directory}: {e.strerror or e}") from None

  def should_save(self, step: int) -> bool:
    return self.every_steps > 0 and step % self.every_steps == 0

  def _name(self, kind: str, process: int, layout_hash: str) -> str:
    return f"{kind}_{process}-of-{self.count}-{layout_hash}.bin"

  def save(self, step: int, state, shardings, data_it) -> None:
    """Every process calls it at the same step. Returns when both files are on this process's disk."""
    parts = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
      for shard in leaf.addressable_shards:
        parts.setdefault(_index_key(path, shard.index), np.asarray(shard.data))
    if data_it is not None:
      parts[DATA_KEY] = np.frombuffer(data_it.get_state(), np.uint8)
    own = pack(parts)
    peer = exchange(own, +1)  # Process p - 1's part, kept here.
    tag = layout(state, shardings, self.mesh, self.seed)
    step_dir = os.path.join(self.directory, str(step))
    os.makedirs(step_dir, exist_ok=True)
    storage.write_bytes(os.path.join(step_dir, self._name("process", self.process, tag)), own)
    if self.count > 1:
      storage.write_bytes(os.path.join(step_dir, self._name("peer", (self.process - 1) % self.count, tag)), peer)
    self._prune()
    if self.count > 1:  # No process goes on to the next step's collectives while another is still writing.
      multihost_utils.sync_global_devices(f"local checkpoint {step}")

  def forget_after(self, step: int) -> None:
    """Removes this process's steps after `step`, the step the run resumed from (or 0, a new run): steps of another
    timeline or of a layout this run cannot read. Kept, they would outrank the steps the run writes, which `_prune`
    would then delete as the oldest."""
    for stale in self._steps():
      if stale > step:
        shutil.rmtree(os.path.join(self.directory, str(stale)), ignore_errors=True)

  def _prune(self) -> None:
    steps = sorted(self._steps())
    for old in steps[:-KEEP]:
      shutil.rmtree(os.path.join(self.directory, str(old)), ignore_errors=True)

  def _steps(self) -> list[int]:
    return [int(d) for d in os.listdir(self.directory) if d.isdigit()]

  def _has(self, step: int, kind: str, process: int, tag: str) -> bool:
    return os.path.exists(os.path.join(self.directory, str(step), self._name(kind, process, tag)))

  def newest(self, targets, *, after: int) -> int | None:
    """The newest step after `after` that every process can rebuild (its own part, or its peer's copy of it) for
    this run's layout; every process calls it and gets the same answer. `targets(step)`: (shardings, abstract)."""
    candidates = sorted((s for s in self._steps() if s > after), reverse=True)[:MAX_STEPS]
    own, held = np.full(MAX_STEPS, -1, np.int64), np.full(MAX_STEPS, -1, np.int64)
    for i, step in enumerate(candidates):
      shardings, abstract = targets(step)
      tag = layout(abstract, shardings, self.mesh, self.seed)
      own[i] = step if self._has(step, "process", self.process, tag) else -1
      held[i] = step if self._has(step, "peer", (self.process - 1) % self.count, tag) else -1
    table = np.asarray(multihost_utils.process_allgather(np.stack([own, held]))).reshape(self.count, 2, MAX_STEPS)
    steps = set(table[:, 0].ravel().tolist()) | set(table[:, 1].ravel().tolist())
    for step in sorted(steps - {-1}, reverse=True):
      if all(step in table[p, 0] or step in table[(p + 1) % self.count, 1] for p in range(self.count)):
        return step
    return None

  def restore(self, step: int, targets) -> tuple[object, list[int], bytes | None]:
    """(the state of `step`, the processes whose parts came from their peers, this process's data position or
    None). The caller sets the position once every process has read its part: set on some before another
    failed, the run resuming elsewhere would read from two positions."""
    shardings, abstract = targets(step)
    tag = layout(abstract, shardings, self.mesh, self.seed)
    step_dir = os.path.join(self.directory, str(step))
    present = self._has(step, "process", self.process, tag)
    lost = np.asarray(multihost_utils.process_allgather(np.asarray([not present]))).reshape(-1) \
        if self.count > 1 else np.asarray([not present])
    blob = _read(os.path.join(step_dir, self._name("process", self.process, tag))) if present else b""
    if lost.any():  # Every process takes part; the peer of a process that lost its part sends the copy back.
      previous = (self.process - 1) % self.count
      copy = _read(os.path.join(step_dir, self._name("peer", previous, tag))) if lost[previous] else b""
      returned = exchange(copy, -1)
      if not present:
        blob = returned
        os.makedirs(step_dir, exist_ok=True)
        # Its disk holds it again.
        storage.write_bytes(os.path.join(step_dir, self._name("process", self.process, tag)), blob)
    parts = unpack(blob)

    def build(path, leaf, sharding):
      index_map = sharding.addressable_devices_indices_map(leaf.shape)
      arrays = [jax.device_put(parts[_index_key(path, index)], device) for device, index in index_map.items()]
      return jax.make_array_from_single_device_arrays(leaf.shape, sharding, arrays)

    state = jax.tree_util.tree_map_with_path(build, abstract, shardings)
    position = parts[DATA_KEY].tobytes() if DATA_KEY in parts else None
    return state, [int(p) for p in np.flatnonzero(lost)], position


def _read(path: str) -> bytes:
  with open(path, "rb") as f:
    return f.read()
