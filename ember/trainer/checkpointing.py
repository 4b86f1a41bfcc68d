"""Checkpoints: the persistent tier (Orbax) and the local tier (`LocalCheckpoints`), so that a resumed run
continues bit for bit.

`<workdir>/checkpoints/` is one Orbax `CheckpointManager` directory; each numbered step holds
  state/  the TrainState (step, parameters, optimizer state, delayed-scaling amax histories),
          sharded: every process writes its own shards (OCDBT);
  data/   `process_{i}-of-{n}.json`, each process's Grain iterator state (grain.checkpoint);
  rng/    the base key's data and the seed (every key is folded from (seed, step[, layer]));
  fingerprints/  one fingerprint per state array, checked after every restore (ember/trainer/integrity.py);
and, in the step's metadata, the resolved config, ember's version and the mesh shape.

Saves are asynchronous by default: `save` returns once the arrays are on the host and the
write goes on in a background thread (`force_sync` waits, as on preemption). Orbax writes a
step into a temporary directory and renames it when complete, so a process killed mid-save
leaves no step that `all_steps` reports. A complete step whose files are damaged fails to
restore, or restores arrays that do not match their fingerprints; `restore_latest` then renames it
`<step>.corrupt` and falls back to the one before, with one warning line naming the step, and `restore_from`
(another run's checkpoint) stops with a one-line error. A checkpoint whose shapes differ from the config's is never
skipped silently: CheckpointError names the first differing array (exit 2).

Restoring always targets the *current* run's shardings, so a checkpoint moves freely between
mesh shapes and device counts. The data position moves between process counts: each process
records the state of the shards it reads, and the shards do not depend on the process count.

The local tier (`LocalCheckpoints`): frequent checkpoints on each node's own disk, each process's part also kept by
a peer. Persistent checkpoints (Orbax, `checkpoint.every_steps`) go to shared storage and are slow to write at
scale; these go every `checkpoint.local_every_steps` to `checkpoint.local_dir`, node-local
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
(`_local_run_id`), so a run sees only its own steps: neither another run's nor those of an earlier run in a workdir of
the same path, deleted since.
`local_dir` may hold `{process}` (one directory per process, for several processes per node sharing a disk or a test
on one machine). A part: an 8-byte header length, a JSON header {key: [dtype, shape, offset,
nbytes]}, then the bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import struct
from typing import Any, Callable, NamedTuple

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ember import storage
from ember.config import Settings
from ember.data import ShardedIterator
from ember.errors import CheckpointError, ConfigError, one_line
from ember.layers.moe import ROUTER_BIAS
from ember.trainer import integrity
from ember.trainer.metrics import console
from ember.trainer.state import TrainState


def _data_files(data_dir: str) -> list[str]:
  """Every process's data-position file in a step's data/."""
  return storage.glob(data_dir, "process_*-of-*.json")


def _merged_data_state(data_dir: str) -> dict | None:
  """The shard states of every process's file in a step's data/ (None if there are none)."""
  files = _data_files(data_dir)
  if not files:
    return None
  merged = {"num_shards": None, "fingerprint": "", "shards": {}}
  for f in files:
    s = json.loads(storage.read_text(f))
    merged["num_shards"], merged["fingerprint"] = s["num_shards"], s.get("fingerprint", "")
    merged["shards"].update(s["shards"])
  return merged


# --- RNG ---------------------------------------------------------------------------------------


def rng_item(seed: int) -> dict:
  """The base key every key derives from (init: fold 0; step keys: fold 1, then step)."""
  key = jax.random.key(seed)
  return {"seed": int(seed), "impl": str(jax.random.key_impl(key)),
          "key_data": np.asarray(jax.random.key_data(key)).tolist()}


# --- Trees ------------------------------------------------------------------------------------------


def _as_dict(state: TrainState) -> dict:
  return {f.name: getattr(state, f.name) for f in dataclasses.fields(TrainState)}


def _abstract_target(abstract: TrainState, shardings: TrainState) -> dict:
  to_struct = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
  return jax.tree.map(to_struct, _as_dict(abstract), _as_dict(shardings))


def _in_saved_dtypes(target: dict, saved) -> dict:
  """`target` (ShapeDtypeStructs) with each array's dtype as the checkpoint holds it. A run may change a dtype
  (train.optimizer_state_dtype, model.param_dtype) and resume: restored as saved, the arrays can be checked against
  their fingerprints, then cast (`_in_target_dtypes`); restored cast, they would not match them and the sound step
  would be moved aside as damaged."""
  held = {name: getattr(leaf, "dtype", None) for name, leaf in _leaves_by_name(saved).items()}

  def as_saved(path, t):
    dtype = held.get(_path_name(path))
    return t if dtype is None or dtype == t.dtype else jax.ShapeDtypeStruct(t.shape, dtype, sharding=t.sharding)
  return jax.tree_util.tree_map_with_path(as_saved, target)


def _in_target_dtypes(restored: dict, target: dict) -> dict:
  """The restored arrays (`_in_saved_dtypes`) cast to this config's dtypes, on their shardings."""
  return jax.tree.map(lambda r, t: r if r.dtype == t.dtype else r.astype(t.dtype), restored, target)


def _path_name(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _leaves_by_name(tree) -> dict[str, Any]:
  is_leaf = lambda x: hasattr(x, "shape") and not isinstance(x, dict)
  return {_path_name(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]}


class Stacked(NamedTuple):
  """The decoder's stacked layers as a checkpoint's shapes show them: the model's `layers` (model.num_layers), the
  index of the scan segment a pipeline splits into stages and that segment's `rows` without padding. A pipeline pads
  that segment's rows alone (ModelConfig.staged_segment; parallel/pipeline.py, `padded_blocks`)."""
  layers: int
  segment: int
  rows: int


def stacked_of(cfg: Settings) -> Stacked:
  """The config's `Stacked`."""
  staged = cfg.model.staged_segment(cfg.quant)
  return Stacked(cfg.model.num_layers, staged, len(cfg.model.segments(cfg.quant)[staged]))


def check_shapes(saved, expected, what: str, kind: str = "array", padding: Stacked | None = None) -> None:
  """Raises CheckpointError naming the first array whose shape (or presence) differs, parameters first.
  `padding`: the checkpoint holds this config's layers (`_padding`), so a leaf of the staged segment may differ
  in its rows alone, both counts at least the segment's own: by a pipeline's padding rows, which the restore
  truncates or zero-pads."""
  if isinstance(saved, dict) and isinstance(expected, dict) and "params" in saved and "params" in expected:
    check_shapes(saved["params"], expected["params"], what, "parameter", padding)
  got = _leaves_by_name(saved)
  want = _leaves_by_name(expected)
  for name, leaf in want.items():
    if name not in got:
      raise CheckpointError(f"{what}: the checkpoint has no {kind} {name} (shape {tuple(leaf.shape)} in this config)")
    if padding is not None and _padded_apart(name, got[name].shape, leaf.shape, padding):
      continue
    if tuple(got[name].shape) != tuple(leaf.shape):
      raise CheckpointError(f"{what}: {kind} {name} has shape {tuple(got[name].shape)} in the checkpoint "
                            f"but {tuple(leaf.shape)} in this config")
  extra = next((n for n in got if n not in want), None)
  if extra is not None:
    raise CheckpointError(f"{what}: the checkpoint's {kind} {extra} (shape {tuple(got[extra].shape)}) "
                          "has no place in this config")


def _padded_apart(name: str, saved: tuple, expected: tuple, stacked: Stacked) -> bool:
  """Whether leaf `name` of the staged segment differs from its expected shape by padding rows alone."""
  parts = name.split("/")
  if "segments" not in parts or parts[parts.index("segments") + 1] != str(stacked.segment):
    return False
  return tuple(saved[1:]) == tuple(expected[1:]) and min(saved[0], expected[0]) >= stacked.rows


def _padding(custom: dict, stacked: Stacked | None, what: str) -> Stacked | None:
  """`stacked` where a leaf's rows may differ by padding (`check_shapes`): the step's custom metadata records the
  model.num_layers it was saved with and it is this config's. Where they differ, CheckpointError: with padding
  rows the arrays may have the same shapes and still hold other layers."""
  saved = custom.get("config", {}).get("model", {}).get("num_layers")
  if stacked is None or saved is None:
    return None
  if saved != stacked.layers:
    raise CheckpointError(f"{what}: the checkpoint's model has {saved} layers, but model.num_layers="
                          f"{stacked.layers} here")
  return stacked


def _state_metadata(manager: ocp.CheckpointManager, step: int) -> dict:
  meta = manager.item_metadata(step)["state"]
  meta = getattr(meta, "tree", meta)
  if meta is None:
    raise ValueError("no metadata for item 'state'")
  return meta


# --- Fingerprints ------------------------------------------------------------------------------------

FINGERPRINTS = "fingerprints"  # The step's item (a JSON file) holding them.


def _verify(step_dir: str, restored: dict, where: str) -> None:
  """Raises integrity.DamagedCheckpoint if the restored arrays (a dict of TrainState fields, or some of them)
  differ from the fingerprints saved with the step; a step saved without them (older) passes."""
  path = storage.join(step_dir, FINGERPRINTS, "metadata")
  if not storage.exists(path):
    return
  try:
    saved = json.loads(storage.read_text(path))
  except (OSError, ValueError) as e:
    raise integrity.DamagedCheckpoint(f"{where}: its fingerprints cannot be read ({type(e).__name__})") from None
  integrity.verify(saved, _leaves_by_name(restored), where)


# --- The manager -----------------------------------------------------------------------------------


def _manager(directory: str, options: ocp.CheckpointManagerOptions, *, partial_state: bool = False):
  """A manager that knows each item's handler, so that metadata reads in a fresh process too."""
  registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
  if partial_state:  # Same files; the PyTree handler restores a subtree (parameters only).
    registry.add("state", ocp.args.PyTreeRestore, ocp.PyTreeCheckpointHandler)
  else:
    registry.add("state", ocp.args.StandardSave, ocp.StandardCheckpointHandler)
    registry.add("state", ocp.args.StandardRestore, ocp.StandardCheckpointHandler)
  for item in ("rng", FINGERPRINTS):
    registry.add(item, ocp.args.JsonSave, ocp.JsonCheckpointHandler)
    registry.add(item, ocp.args.JsonRestore, ocp.JsonCheckpointHandler)
  registry.add("data", grain.checkpoint.CheckpointSave, grain.checkpoint.CheckpointHandler)  # Restored merged.
  return ocp.CheckpointManager(directory, options=options, handler_registry=registry)


class Checkpointer:
  def __init__(self, directory: str, *, every_steps: int, keep: int, async_save: bool = True):
    """`directory`: an absolute path or a URL, as Orbax takes it (the settings' workdir is one: config/settings.py
    resolves it)."""
    self.directory = directory
    self.every_steps = every_steps
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=True,
                                           cleanup_tmp_directories=True)
    self.manager = _manager(self.directory, options)

  def should_save(self, step: int, last_step: int) -> bool:
    if self.every_steps < 0:  # Checkpointing off (benchmarks, sweeps).
      return False
    return step == last_step or (self.every_steps > 0 and step % self.every_steps == 0)

  def save(self, step: int, state: TrainState, data_it: ShardedIterator | None, *, seed: int,
           metadata: dict | None = None, force_sync: bool = False) -> None:
    """Every process calls this. Returns when the arrays are on the host (or written, if force_sync)."""
    arrays = _as_dict(state)
    items = dict(state=ocp.args.StandardSave(arrays), rng=ocp.args.JsonSave(rng_item(seed)),
                 **{FINGERPRINTS: ocp.args.JsonSave(integrity.fingerprints(_leaves_by_name(arrays)))})
    if data_it is not None:
      items["data"] = grain.checkpoint.CheckpointSave(data_it)  # Reads the position now, synchronously.
    self.manager.save(step, args=ocp.args.Composite(**items), force=True, custom_metadata=metadata or {})
    if force_sync:
      self.manager.wait_until_finished()

  def steps(self) -> list[int]:
    """The saved steps, as process 0 lists them (every process calls it at the same point): each lists the
    directory on its own, and a stale listing on one (a network file system's cache just after a restart) would
    walk the processes through different steps."""
    steps = sorted(self.manager.all_steps())
    if jax.process_count() == 1:
      return steps
    from jax.experimental import multihost_utils
    count = int(multihost_utils.broadcast_one_to_all(np.int64(len(steps))))
    padded = np.asarray((steps + [0] * count)[:count], np.int64)
    return [int(s) for s in multihost_utils.broadcast_one_to_all(padded)] if count else []

  def custom_metadata(self, step: int) -> dict:
    """What `save` recorded with the step (config, version, mesh, precision phase); {} if unreadable."""
    try:
      return dict(self.manager.metadata(step).custom_metadata or {})
    except Exception:  # A step written by another version, or damaged: the restore decides.
      return {}

  def _step_dir(self, step: int) -> str:
    return storage.join(self.directory, str(step))

  def check(self, step: int, abstract: TrainState, *, seed: int | None, what: str,
            stacked: Stacked | None = None) -> None:
    """Shape and seed checks from the step's metadata; CheckpointError on a mismatch. `stacked`: this config's
    layers (a pipeline's padding rows may differ where the checkpoint's model has as many)."""
    check_shapes(_state_metadata(self.manager, step), _as_dict(abstract), what,
                 padding=_padding(self.custom_metadata(step), stacked, what))
    if seed is None:
      return
    rng_path = storage.join(self._step_dir(step), "rng", "metadata")
    if storage.exists(rng_path):
      saved = json.loads(storage.read_text(rng_path))
      if saved.get("key_data") != rng_item(seed)["key_data"]:
        raise CheckpointError(f"config.seed: {seed}, but the checkpoint in {self.directory} step {step} was saved "
                              f"with seed {saved.get('seed')}; resume with the same seed (keys derive from it)")

  def restore(self, step: int, abstract: TrainState, shardings: TrainState,
              data_it: ShardedIterator | None) -> TrainState:
    """The state of `step` onto `shardings`; sets `data_it` to the saved position (with a warning
    and the iterator's start if the position cannot be mapped onto this run's shards)."""
    # Not strict: `check` allowed a stacked leaf's rows to differ by padding alone, which Orbax truncates or pads.
    target = _abstract_target(abstract, shardings)
    as_saved = _in_saved_dtypes(target, _state_metadata(self.manager, step))
    items = dict(state=ocp.args.StandardRestore(as_saved, strict=False))
    data_dir = storage.join(self._step_dir(step), "data")
    if data_it is not None and not _data_files(data_dir):
      # The run saves its data position with every step: without one the step is incomplete, and a resume from it
      # would read the data from the start. Damaged, as an unreadable file is (`restore_latest`).
      raise FileNotFoundError(f"no data position in {data_dir}")
    restored = self.manager.restore(step, args=ocp.args.Composite(**items))
    _verify(self._step_dir(step), restored["state"], f"step {step}")
    if data_it is not None:  # From every process's file: the shards a process reads follow the mesh, not its index.
      restore_data_position(data_dir, data_it)
    return TrainState(**_in_target_dtypes(restored["state"], target))

  def restore_latest(self, targets: Callable[[int], tuple[TrainState, TrainState]],
                     data_it: ShardedIterator | None, *, seed: int,
                     stacked: Stacked | None = None) -> tuple[TrainState, int] | None:
    """(state, step) of the newest checkpoint that restores; None if there is none. `targets(step)` is
    (shardings, abstract) of the state saved at `step` (a precision schedule changes its structure); `stacked`:
    as `check`'s.

    A step that cannot be read is renamed `<step>.corrupt` (so that the run can write that step
    again) and the one before is tried. A step that reads but does not fit this config raises, and so does a
    read that ran out of memory or met a failing storage (`_is_damage`): the step is kept. When steps were moved
    aside and none restores, it raises rather than return None: a run that started over would truncate the run's
    metrics.
    """
    # Before any read: a failed read's callbacks may fire before its exception reaches this frame.
    integrity.quiet_abandoned_reads()
    for step in reversed(self.steps()):
      shardings, abstract = targets(step)
      _, error = _attempt(lambda: self.check(step, abstract, seed=seed, what=f"checkpoint {self._step_dir(step)}",
                                             stacked=stacked))  # Unreadable metadata: a damaged step, or storage.
      if self._moved_aside(step, error):
        continue
      state, error = _attempt(lambda: self.restore(step, abstract, shardings, data_it))  # Array files, memory.
      if not self._moved_aside(step, error):
        return state, step
    moved = [os.path.basename(p) for p in storage.glob(self.directory, "*.corrupt*")]
    if moved:
      raise CheckpointError(f"{self.directory}: no step restores (moved aside as damaged: {', '.join(moved)}); a "
                            "new run here would truncate this run's metrics: move them out to start over")
    return None

  def _moved_aside(self, step: int, error: Exception | None) -> bool:
    """False where every process read `step` (`error` None on each); True where it is damaged on some and every
    process moved on past it (`_skip`); raises where a process failed for another reason (`_is_damage`), the step
    kept."""
    if all_processes_ok(error is None):
      return False
    if not all_processes_ok(error is None or _is_damage(error)):
      if error is not None and not _is_damage(error):
        raise error
      raise CheckpointError(f"checkpoint {self._step_dir(step)}: another process could not read it, out of memory "
                            "or its storage failing (not damage: the step is kept)")
    self._skip(step, error or RuntimeError("another process could not read it"))
    return True

  def _skip(self, step: int, error: Exception) -> None:
    """Moves a damaged step aside (`<step>.corrupt`, kept for inspection) so the run can write it again."""
    target, n = self._step_dir(step) + ".corrupt", 1
    while storage.exists(target):
      target, n = f"{self._step_dir(step)}.corrupt{n}", n + 1
    first = one_line(error)[:300]
    console(f"warning: skipping checkpoint step {step} in {self.directory}: cannot restore it "
            f"({type(error).__name__}: {first}); moved it to {os.path.basename(target)}, trying the previous one")
    if jax.process_index() == 0:
      storage.rename(self._step_dir(step), target)
    _barrier(f"ember_skip_{step}")
    self.manager.reload()

  def close(self):
    self.manager.wait_until_finished()
    self.manager.close()


def restore_data_position(data_dir: str, data_it: ShardedIterator) -> None:
  """Sets `data_it` from every process's file of a step's data/ (shards merged, so any process count
  saved it); `ShardedIterator.set_state` warns if the position cannot serve this run."""
  merged = _merged_data_state(data_dir)
  if merged is None:
    console(f"warning: no data position in {data_dir}: the data iterator starts from the beginning")
    return
  data_it.set_state(merged)  # Its rule decides whether the position maps onto this run's shards.


def _attempt(read: Callable[[], object]) -> tuple[object, Exception | None]:
  """(what `read()` returned, None), or (None, the exception it raised); a CheckpointError (a step that does not
  fit this run) is raised, never taken for damage."""
  try:
    return read(), None
  except CheckpointError:
    raise
  except Exception as e:
    return None, e


# A failed read that speaks of now, not of the step's files: this run's memory (a state that does not fit the devices
# or the host now fits no other step either), or the storage failing or refusing (tensorstore's status codes; a
# timeout, a reset connection, a permission). The step may be sound, and the steps before it no better read now.
_NOT_DAMAGE_TYPES = (MemoryError, ConnectionError, TimeoutError, PermissionError, InterruptedError)
_NOT_DAMAGE_TEXT = re.compile(r"\b(RESOURCE_EXHAUSTED|UNAVAILABLE|DEADLINE_EXCEEDED|ABORTED|CANCELLED|UNAUTHENTICATED|"
                              r"PERMISSION_DENIED)\b|(?i:out of memory|timed out|connection (reset|refused|aborted))")


def _is_damage(error: Exception) -> bool:
  """Whether a failed read speaks of the step's files (moved aside, the one before tried) rather than of the run's
  memory or the storage now (the step kept, the error raised: a requeued run reads it again)."""
  return not any(isinstance(e, _NOT_DAMAGE_TYPES) or (e is not None and _NOT_DAMAGE_TEXT.search(str(e)))
                 for e in (error, error.__cause__, error.__context__))


def all_processes_ok(ok: bool) -> bool:
  """Whether `ok` holds on every process (each calls it at the same point)."""
  if jax.process_count() == 1:
    return ok
  from jax.experimental import multihost_utils
  return bool(np.all(multihost_utils.process_allgather(np.asarray(ok))))


def _barrier(name: str) -> None:
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)


# --- Starting a new run from another run's checkpoint ---------------------------------------------------


def _manager_dir_and_step(path: str, what: str) -> tuple[str, int | None]:
  """`path` is a run's workdir, its checkpoints/ directory (newest step) or one numbered step inside it."""
  path = storage.absolute(path)
  if not storage.isdir(path):
    raise CheckpointError(f"{what}: no checkpoint directory at {path}")
  base = os.path.basename(path)
  if base.isdigit():
    return os.path.dirname(path), int(base)
  if storage.isdir(storage.join(path, "checkpoints")):
    path = storage.join(path, "checkpoints")
  return path, None


def restore_from(path: str, targets: Callable[[int], tuple[TrainState, TrainState]], data_it: ShardedIterator | None,
                 *, params_only: bool, init: Callable[[], TrainState],
                 stacked: Stacked | None = None) -> tuple[TrainState, int]:
  """Starts a new run from another run's checkpoint: (the state, the step the run starts after).

  Full: the whole TrainState (its step, optimizer state, amax histories) and, where this run reads
  the same data shards, the data position; the run goes on from the checkpoint's step (its loop's, which
  `state.step` trails by any steps skipped), in the state that step has in this config (`targets(step)`:
  (shardings, abstract); a precision schedule changes its structure). `params_only`: the parameters, with a fresh
  optimizer state, quantization state, step 0 and data position (`init()` builds the rest). `stacked`: as
  `Checkpointer.check`'s.
  """
  what = "config.checkpoint.restore_from"
  manager, directory, step = _open_step(path, what, partial_state=params_only)
  try:
    saved = _read_state_metadata(manager, directory, step, what)
    padding = _padding(manager.metadata(step).custom_metadata or {}, stacked, what)
    shardings, abstract = targets(0 if params_only else step)
    target = _abstract_target(abstract, shardings)
    if params_only:  # The parameters, and the routers' learned biases: routing state the model needs as trained.
      fields = {"params": target["params"], "quant_state": _router_biases(target["quant_state"])}
      held = {"params": saved["params"], "quant_state": _router_biases(saved.get("quant_state", {}))}
      fields = {k: v for k, v in fields.items() if jax.tree.leaves(v)}
      restored = _restore_fields(manager, step, held, fields, what, padding)
      fresh = init()
      biases = _leaves_by_name(restored.get("quant_state", {}))
      quant_state = jax.tree_util.tree_map_with_path(lambda p, x: biases.get(_path_name(p), x), fresh.quant_state)
      state = dataclasses.replace(fresh, params=restored["params"], quant_state=quant_state)
    else:
      check_shapes(saved, target, what, padding=padding)
      as_saved = _in_saved_dtypes(target, saved)
      restored = _restore_checked(manager, directory, step, ocp.args.StandardRestore(as_saved, strict=False), what)
      state = TrainState(**_in_target_dtypes(restored, target))
      if data_it is not None:
        restore_data_position(storage.join(directory, str(step), "data"), data_it)
  finally:
    manager.close()
  console(f"started from {'the parameters of ' if params_only else ''}{directory} step {step}")
  return state, 0 if params_only else step


def _router_biases(tree):
  """The part of a state tree (nested dicts) that holds the MoE routers' biases (layers/moe.py's ROUTER_BIAS)."""
  if not isinstance(tree, dict):
    return tree
  kept = {k: _router_biases(v) for k, v in tree.items() if isinstance(v, dict) or k == ROUTER_BIAS}
  return {k: v for k, v in kept.items() if not isinstance(v, dict) or v}


def _open_step(path: str, what: str, *, partial_state: bool):
  """(manager, directory, step) of `path`: a workdir, its checkpoints/ directory (newest step) or a step."""
  directory, step = _manager_dir_and_step(path, what)
  manager = _manager(directory, ocp.CheckpointManagerOptions(create=False), partial_state=partial_state)
  step = manager.latest_step() if step is None else step
  if step is None or step not in manager.all_steps():
    manager.close()
    raise CheckpointError(f"{what}: no complete checkpoint in {os.path.join(directory, str(step or ''))}")
  return manager, directory, step


def _read_state_metadata(manager, directory: str, step: int, what: str) -> dict:
  try:
    return _state_metadata(manager, step)
  except Exception as e:
    raise CheckpointError(f"{what}: cannot read {os.path.join(directory, str(step))} ({type(e).__name__})") from None


def _restore_fields(manager, step: int, saved: dict, targets: dict, what: str, padding: Stacked | None) -> dict:
  """Some TrainState fields alone (a partial restore, e.g. {"params": ...}) onto the targets' shardings,
  shapes checked first (`padding`: as `check_shapes`')."""
  for field, target in targets.items():
    check_shapes(saved[field], target, what, "parameter" if field == "params" else "array", padding)
  as_saved = _in_saved_dtypes(targets, {field: saved[field] for field in targets})
  restore_args = jax.tree.map(lambda a: dataclasses.replace(a, strict=False),
                              ocp.checkpoint_utils.construct_restore_args(as_saved))
  args = ocp.args.PyTreeRestore(item=as_saved, partial_restore=True, restore_args=restore_args)
  restored = _restore_checked(manager, manager.directory, step, args, what)
  return _in_target_dtypes({field: restored[field] for field in targets}, targets)


def _restore_checked(manager, directory, step: int, args, what: str) -> dict:
  """The state item of `step` (restored with `args`), fingerprints checked; a damaged step is a one-line
  CheckpointError naming it."""
  step_dir = os.path.join(str(directory), str(step))
  integrity.quiet_abandoned_reads()  # Before the read (see `restore_latest`).
  try:
    restored = manager.restore(step, args=ocp.args.Composite(state=args))["state"]
    _verify(step_dir, restored, f"{what}: {step_dir}")
  except (CheckpointError, integrity.DamagedCheckpoint) as e:
    raise CheckpointError(str(e)) from None
  except Exception as e:  # Damaged array files.
    reason = one_line(e).split(" See full TensorStore details")[0][:300]  # Its details are a repr of a C++ object.
    raise CheckpointError(f"{what}: cannot restore {step_dir}, damaged ({type(e).__name__}: {reason})") from None
  return restored


def saved_config(path: str, what: str) -> tuple[dict, str]:
  """(config, step directory) of the checkpoint at `path`: the resolved config the run saved with it, as the
  nested dict of keys it was saved as (ember.config.from_saved types it)."""
  manager, directory, step = _open_step(path, what, partial_state=True)
  try:
    custom = manager.metadata(step).custom_metadata or {}
  finally:
    manager.close()
  if "config" not in custom:
    raise CheckpointError(f"{what}: {os.path.join(directory, str(step))} holds no config in its metadata")
  return custom["config"], os.path.join(directory, str(step))


def restore_fields(path: str, targets: dict, what: str, stacked: Stacked | None = None) -> dict:
  """TrainState fields of the checkpoint at `path` (as `saved_config` resolves it): `targets` maps a field
  ("params", "quant_state") to its tree of ShapeDtypeStructs with shardings, which place the result; `stacked`:
  as `Checkpointer.check`'s."""
  manager, directory, step = _open_step(path, what, partial_state=True)
  try:
    saved = _read_state_metadata(manager, directory, step, what)
    padding = _padding(manager.metadata(step).custom_metadata or {}, stacked, what)
    return _restore_fields(manager, step, saved, targets, what, padding)
  finally:
    manager.close()


DATA_KEY = "__data__"
KEEP = 2  # Local steps kept on each disk.
CHUNK_BYTES = 1 << 29  # The peer exchange in pieces of at most this much device memory.
MAX_STEPS = 16  # Steps one process reports when the processes agree on a step to restore.
RUN_ID_FILE = "local_checkpoints_run"  # In the workdir: the run's id, the name of its directory of local steps.


def _index_key(path, index: tuple) -> str:
  """A shard's key: its leaf's path and its index in the global array (the same on any process)."""
  dims = ",".join(f"{s.start or 0}:{'' if s.stop is None else s.stop}" for s in index)
  return f"{jax.tree_util.keystr(path)}[{dims}]"


def _pack_part(parts: dict[str, np.ndarray]) -> bytes:
  header, offset = {}, 0
  for key, a in parts.items():
    header[key] = [a.dtype.name, list(a.shape), offset, a.nbytes]
    offset += a.nbytes
  head = json.dumps(header).encode()
  return b"".join([struct.pack("<Q", len(head)), head, *(np.ascontiguousarray(a).tobytes() for a in parts.values())])


def _unpack_part(blob: bytes) -> dict[str, np.ndarray]:
  (length,) = struct.unpack("<Q", blob[:8])
  header, body = json.loads(blob[8:8 + length]), memoryview(blob)[8 + length:]
  return {key: np.frombuffer(body[off:off + n], dtype=jnp.dtype(dtype)).reshape(shape)
          for key, (dtype, shape, off, n) in header.items()}


def _local_layout(abstract, shardings, mesh: Mesh, seed: int) -> str:
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


def _exchange_with_peer(blob: bytes, shift: int) -> bytes:
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


def _local_run_id(workdir: str) -> str:
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
    """The run's steps go to a directory of their own under `directory`, `run-<id>` (`_local_run_id(workdir)`):
    runs that share a node's disk neither resume from nor prune each other's steps."""
    base = directory.replace("{process}", str(jax.process_index()))  # An absolute local path (validated).
    self.directory = os.path.join(base, "run-" + _local_run_id(workdir))
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
    own = _pack_part(parts)
    peer = _exchange_with_peer(own, +1)  # Process p - 1's part, kept here.
    tag = _local_layout(state, shardings, self.mesh, self.seed)
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
      tag = _local_layout(abstract, shardings, self.mesh, self.seed)
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
    tag = _local_layout(abstract, shardings, self.mesh, self.seed)
    step_dir = os.path.join(self.directory, str(step))
    present = self._has(step, "process", self.process, tag)
    lost = np.asarray(multihost_utils.process_allgather(np.asarray([not present]))).reshape(-1) \
        if self.count > 1 else np.asarray([not present])
    blob = _read_bytes(os.path.join(step_dir, self._name("process", self.process, tag))) if present else b""
    if lost.any():  # Every process takes part; the peer of a process that lost its part sends the copy back.
      previous = (self.process - 1) % self.count
      copy = _read_bytes(os.path.join(step_dir, self._name("peer", previous, tag))) if lost[previous] else b""
      returned = _exchange_with_peer(copy, -1)
      if not present:
        blob = returned
        os.makedirs(step_dir, exist_ok=True)
        # Its disk holds it again.
        storage.write_bytes(os.path.join(step_dir, self._name("process", self.process, tag)), blob)
    parts = _unpack_part(blob)

    def build(path, leaf, sharding):
      index_map = sharding.addressable_devices_indices_map(leaf.shape)
      arrays = [jax.device_put(parts[_index_key(path, index)], device) for device, index in index_map.items()]
      return jax.make_array_from_single_device_arrays(leaf.shape, sharding, arrays)

    state = jax.tree_util.tree_map_with_path(build, abstract, shardings)
    position = parts[DATA_KEY].tobytes() if DATA_KEY in parts else None
    return state, [int(p) for p in np.flatnonzero(lost)], position


def _read_bytes(path: str) -> bytes:
  with open(path, "rb") as f:
    return f.read()
