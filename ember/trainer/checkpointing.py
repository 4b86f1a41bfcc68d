"""Orbax checkpoints: train state, data iterator position, and the resolved config.

One `CheckpointManager` directory (`<workdir>/checkpoints/<step>/`) with items
  state   the TrainState (parameters, optimizer state, delayed-scaling histories, step), sharded;
  data    the Grain iterator state of this run's train split (JSON);
and the resolved config, ember's version and the mesh shape as the manager's metadata.

Orbax writes each step into a temporary directory and renames it when complete, so a process
killed mid-save leaves nothing that `latest_step` reports. A step whose files are damaged fails
to restore; `restore_latest` then falls back to the previous one, with a warning naming the step.
Restoring always targets the *current* run's shardings, so a checkpoint moves freely between
mesh shapes and device counts.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from ember.trainer.metrics import console
from ember.trainer.state import TrainState


class CheckpointError(ValueError):
  """A checkpoint that cannot serve this run (shape mismatch, missing directory)."""


def _as_dict(state: TrainState) -> dict:
  return {f.name: getattr(state, f.name) for f in dataclasses.fields(TrainState)}


def _abstract_target(abstract: TrainState, shardings: TrainState) -> dict:
  to_struct = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
  return jax.tree.map(to_struct, _as_dict(abstract), _as_dict(shardings))


class Checkpointer:
  def __init__(self, directory: str, *, every_steps: int, keep: int, async_save: bool = True,
               metadata: dict | None = None):
    self.directory = os.path.abspath(directory)
    self.every_steps = every_steps
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=True)
    self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "data"),
                                         metadata=metadata)

  def should_save(self, step: int, last_step: int) -> bool:
    return step == last_step or (self.every_steps > 0 and step % self.every_steps == 0)

  def save(self, step: int, state: TrainState, data_state: Any, *, force_sync: bool = False) -> None:
    args = ocp.args.Composite(state=ocp.args.StandardSave(_as_dict(state)),
                              data=ocp.args.JsonSave(data_state if data_state is not None else {}))
    self.manager.save(step, args=args, force=True)
    if force_sync:
      self.manager.wait_until_finished()

  def steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def restore(self, step: int, abstract: TrainState, shardings: TrainState) -> tuple[TrainState, Any]:
    args = ocp.args.Composite(state=ocp.args.StandardRestore(_abstract_target(abstract, shardings)),
                              data=ocp.args.JsonRestore())
    restored = self.manager.restore(step, args=args)
    return TrainState(**restored["state"]), restored["data"]

  def restore_latest(self, abstract: TrainState, shardings: TrainState):
    """(state, data_state, step) of the newest checkpoint that restores; None if there is none."""
    for step in reversed(self.steps()):
      try:
        state, data = self.restore(step, abstract, shardings)
      except Exception as e:  # A damaged step: fall back to the one before.
        console(f"warning: skipping checkpoint step {step} in {self.directory}: cannot restore "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
        continue
      return state, data, step
    return None

  def wait(self):
    self.manager.wait_until_finished()

  def close(self):
    self.manager.wait_until_finished()
    self.manager.close()


def _manager_dir_and_step(path: str) -> tuple[str, int | None]:
  """`path` is a run's checkpoints/ directory (newest step) or one numbered step inside it."""
  path = os.path.abspath(os.path.expanduser(path))
  if not os.path.isdir(path):
    raise CheckpointError(f"config.checkpoint.restore_from: no checkpoint directory at {path}")
  base = os.path.basename(path.rstrip("/"))
  if base.isdigit():
    return os.path.dirname(path), int(base)
  if os.path.isdir(os.path.join(path, "checkpoints")):
    path = os.path.join(path, "checkpoints")
  return path, None


def check_shapes(saved: dict, expected: dict, what: str) -> None:
  """Raises CheckpointError naming the first parameter whose shape differs from the config's."""
  flat_saved = dict(jax.tree_util.tree_flatten_with_path(saved)[0])
  for path, leaf in jax.tree_util.tree_flatten_with_path(expected)[0]:
    got = flat_saved.get(path)
    name = "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
    if got is None:
      raise CheckpointError(f"{what}: checkpoint has no parameter {name}")
    if tuple(got.shape) != tuple(leaf.shape):
      raise CheckpointError(f"{what}: parameter {name} has shape {tuple(got.shape)} in the checkpoint "
                            f"but {tuple(leaf.shape)} in this config")


def restore_from(path: str, state: TrainState, abstract: TrainState, shardings: TrainState, *,
                 params_only: bool) -> TrainState:
  """Starts a new run from another run's checkpoint: the full state, or its parameters only."""
  directory, step = _manager_dir_and_step(path)
  manager = ocp.CheckpointManager(directory, item_names=("state", "data"),
                                  options=ocp.CheckpointManagerOptions(read_only=True))
  step = manager.latest_step() if step is None else step
  if step is None:
    raise CheckpointError(f"config.checkpoint.restore_from: no complete checkpoint in {directory}")
  meta = manager.item_metadata(step)["state"]
  saved_params = meta["params"] if isinstance(meta, dict) else meta.tree["params"]
  check_shapes(saved_params, _as_dict(abstract)["params"], "config.checkpoint.restore_from")
  target = _abstract_target(abstract, shardings)
  if params_only:
    target = {"params": target["params"]}
  restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))["state"]
  manager.close()
  console(f"started from {'the parameters of ' if params_only else ''}{directory} step {step}")
  if params_only:
    return dataclasses.replace(state, params=restored["params"])
  return TrainState(**restored)
