"""Which mesh axes do what: read from the sharding rules (`mesh.rules`, parallel/sharding.py), in one place.

Validation, the step, the loss, the MoE layer, the planner and the compile report ask these functions instead of
naming axes themselves, so a rule changed in a config (or a new mesh axis) reaches all of them:

  batch_axes      the mesh axes the batch is split over: the `batch` rule (data, fsdp, expert by default)
  sequence_axes   the mesh axes each sequence is split over: the `length` rule (context parallelism)
  sequence_parallel_axes  the mesh axes the residual stream's length is split over beyond that (sequence
                  parallelism: `residual_length` less `length`, `tensor` by default)
  layer_axes      the mesh axes the stacked layers are split over: the `layers` rule (none by default)
  expert_axes     the mesh axes the experts are split over: the `expert` rule (each device runs its own experts,
                  whose weights are never gathered over them)
  token_axes      the axes a step's tokens [batch, length] are split over, as an array of them is sharded
  replica_axes    the batch axes whose devices hold replicas of every parameter they run (data and expert
                  parallelism): their micro-batches run apart and reduce their gradients once a step
  replica_split   the dimension along which a parameter's optimizer state is split over the replicas (ZeRO-1)
  shards          how many pieces a set of axes cuts into, from each axis's size
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

from jax.sharding import Mesh, PartitionSpec as P

from ember.names import BATCH, EXPERT, LAYERS, LENGTH, RESIDUAL_LENGTH
from ember.parallel.sharding import entry_axes, logical_to_spec, rules_dict

# The batch axes that may hold replicas (`replica_axes`): data parallelism (mesh.data x mesh.dcn_data) and expert
# parallelism (mesh.expert x mesh.dcn_expert), over which only the experts' weights are split.
REPLICA_AXES = ("data", "expert")


def _rules(rules) -> dict[str, tuple[str, ...]]:
  return rules if isinstance(rules, dict) else rules_dict(rules)


def batch_axes(rules, mesh: Mesh | None = None) -> tuple[str, ...]:
  """The `batch` rule's axes; on `mesh`, those of more than one device."""
  return entry_axes(logical_to_spec((BATCH,), _rules(rules), mesh)[0])


def sequence_axes(rules) -> tuple[str, ...]:
  return _rules(rules).get(LENGTH, ())


def sequence_parallel_axes(rules, mesh: Mesh | None = None) -> set[str]:
  """The axes of the `residual_length` rule that the `length` rule leaves out: the residual stream's tokens are
  split over them between blocks and whole on them inside one; on `mesh`, those of more than one device."""
  split = lambda name: set(entry_axes(logical_to_spec((name,), _rules(rules), mesh)[0]))
  return split(RESIDUAL_LENGTH) - split(LENGTH)


def layer_axes(rules) -> tuple[str, ...]:
  return _rules(rules).get(LAYERS, ())


def expert_axes(rules, mesh: Mesh | None = None) -> tuple[str, ...]:
  """The `expert` rule's axes; on `mesh`, those of more than one device."""
  return entry_axes(logical_to_spec((EXPERT,), _rules(rules), mesh)[0])


def token_spec(rules, mesh: Mesh | None = None) -> P:
  """How tokens [batch, length] are split (an axis used once, by the batch first; on `mesh`, its size-1 axes left
  out)."""
  return logical_to_spec((BATCH, LENGTH), _rules(rules), mesh)


def token_axes(rules, mesh: Mesh | None = None) -> tuple[str, ...]:
  return tuple(a for entry in token_spec(rules, mesh) for a in entry_axes(entry))


def shards(axes: Iterable[str], size: Callable[[str], int] | dict) -> int:
  """The pieces `axes` cut into: the product of their sizes (`size` a mapping or a function of an axis)."""
  size_of = size.get if isinstance(size, dict) else size
  return math.prod(int(size_of(a) or 1) for a in axes)


def replica_axes(rules, mesh: Mesh, parameters: Iterable[tuple[str | None, ...]], *,
                 features_split_apart: bool = True) -> tuple[str, ...]:
  """Of the batch axes, those of REPLICA_AXES with more than one device over which no parameter is split (the
  experts' weights along their experts aside: the MoE layers run over those axes as they are), in the order the
  batch is split over them. `parameters`: every parameter's logical axis names. `features_split_apart` False (a
  recipe whose kernels partition themselves, trainer/state.py says why) leaves none wherever the mesh also splits
  features over an axis the batch is not split over (tensor, context; the pipeline splits layers, not features)."""
  rules = _rules(rules)
  batch, layers = batch_axes(rules, mesh), layer_axes(rules)
  if not features_split_apart and any(n > 1 and a not in batch and a not in layers for a, n in mesh.shape.items()):
    return ()
  split = set()  # The mesh axes a parameter is split over other than as the leading axes of its experts.
  for names in parameters:
    for name, entry in zip(names, logical_to_spec(tuple(names), rules, mesh)):
      axes = entry_axes(entry)
      if name == EXPERT:  # The experts enter the shard_map as blocks along its leading replica axes alone: in
        # the order the MoE exchange numbers them (over (fsdp, expert), a block along `expert` would not be).
        axes = axes[next((i for i, a in enumerate(axes) if a not in REPLICA_AXES), len(axes)):]
      split |= set(axes)
  return tuple(a for a in batch if a in REPLICA_AXES and mesh.shape.get(a, 1) > 1 and a not in split)


def not_splitting(spec: P, replicas: Iterable[str]) -> tuple[str, ...]:
  """The `replicas` (mesh axes) that do not split an array laid out as `spec`: those that hold it whole, over which
  its gradient is summed and its optimizer state may be split (an expert weight split over `expert` is not)."""
  held = {a for entry in spec for a in entry_axes(entry)}
  return tuple(r for r in replicas if r not in held)


def replica_split(shape: tuple[int, ...], spec: P, over: Iterable[str], mesh: Mesh) -> int | None:
  """ZeRO-1 (train.shard_optimizer_state): the dimension along which a parameter's optimizer state, and its
  gradient reduced once a step, is split over the replica axes `over` that hold the parameter whole: its first
  dimension no mesh axis of more than one device splits (`spec`) whose length their devices divide. A split
  dimension is passed over, so each replica's piece lies inside the device's own block of the parameter and the
  update needs no reshuffle. None where no dimension qualifies: that leaf's state stays whole on each replica."""
  n = shards(over, mesh.shape)
  if n == 1:
    return None
  entries = tuple(spec) + (None,) * (len(shape) - len(spec))
  for dim, (length, entry) in enumerate(zip(shape, entries)):
    if shards(entry_axes(entry), mesh.shape) == 1 and length % n == 0:
      return dim
  return None


def with_split(spec: P, ndim: int, dim: int | None, over: Iterable[str]) -> P:
  """`spec` of an array of `ndim` dimensions with the axes `over` added to dimension `dim` (unchanged where
  `dim` is None): a parameter's spec made its optimizer state's (`replica_split`)."""
  if dim is None:
    return spec
  entries = list(spec) + [None] * (ndim - len(spec))
  axes = entry_axes(entries[dim]) + tuple(over)
  entries[dim] = axes[0] if len(axes) == 1 else axes
  return P(*entries)
