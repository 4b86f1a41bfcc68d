"""The sharding rules: logical axis names -> mesh axes, applied here, and which mesh axes do what, answered here.

Layers name the axes of their parameters (`nnx.Param(..., out_sharding=("embed", "mlp"))`) and of
their main activations (`shard(x, ("batch", "length", "embed"))`). The rules table in the config
(`mesh.rules`) maps each logical name to zero, one or several mesh axes. Layer code never
mentions a mesh: outside `use_rules(...)` every `shard` call is a no-op, so a layer runs unchanged
on one device, in a test, or inside `shard_map`.

Which mesh axes do what, read from the same rules: validation, the step, the loss, the MoE layer, the planner and
the compile report ask these functions instead of naming axes themselves, so a rule changed in a config (or a new
mesh axis) reaches all of them:

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

import contextlib
import contextvars
import math
from typing import Callable, Iterable, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ember import platform
from ember.names import BATCH, EMBED, EXPERT, LAYERS, LENGTH, MLP, MLP_IN, RESIDUAL_LENGTH
from ember.quant.partitioning import entry_axes, spec_entry
from ember.quant.varying import manual_axes


Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

_ACTIVE: contextvars.ContextVar[tuple[Mesh, dict] | None] = contextvars.ContextVar("ember_rules", default=None)


def rules_dict(rules) -> dict[str, tuple[str, ...]]:
  """Normalises the config's rules table to {logical: (mesh axes...)} (a dict is taken as normalised already). A
  table written before `mlp_in` (the down projection's input) splits it as the default table does: over `mlp`'s
  axes, then `embed`'s."""
  if isinstance(rules, dict):
    return rules
  out = {}
  for logical, mesh_axes in rules:
    if mesh_axes is None:
      out[logical] = ()
    elif isinstance(mesh_axes, str):
      out[logical] = (mesh_axes,)
    else:
      out[logical] = tuple(mesh_axes)
  if MLP_IN not in out:
    out[MLP_IN] = out.get(MLP, ()) + out.get(EMBED, ())
  return out


def logical_to_spec(names: Sequence[str | None], rules: dict, mesh: Mesh | None = None) -> P:
  """PartitionSpec for an array whose axes carry the logical `names`.

  A mesh axis is used at most once per array (the first logical axis that asks for it wins),
  and axes of size 1 are dropped, so e.g. `("batch", "embed")` with batch -> (data, fsdp) and
  embed -> fsdp shards the batch over fsdp and leaves embed whole.
  """
  used: set[str] = set()
  spec = []
  for name in names:
    axes = []
    for a in rules.get(name, ()) if name is not None else ():
      if a in used or (mesh is not None and mesh.shape.get(a, 1) == 1):
        continue
      used.add(a)
      axes.append(a)
    spec.append(spec_entry(axes))
  return P(*spec)


def named_sharding(names, mesh: Mesh, rules: dict) -> NamedSharding:
  return NamedSharding(mesh, logical_to_spec(names, rules, mesh))


@contextlib.contextmanager
def use_rules(mesh: Mesh, rules):
  """Activates `mesh` and the rules table for `shard` calls traced inside the block, and the mesh's devices
  as the platform and device count traced for (ember/platform.py)."""
  token = _ACTIVE.set((mesh, rules_dict(rules)))
  try:
    with platform.on_device(mesh.devices.flat[0]), platform.over_devices(mesh.size):
      yield
  finally:
    _ACTIVE.reset(token)


def active_mesh() -> Mesh | None:
  active = _ACTIVE.get()
  return None if active is None else active[0]


def active_rules() -> dict | None:
  """The active rules table ({logical: (mesh axes...)}), for code that builds shard_map specs."""
  active = _ACTIVE.get()
  return None if active is None else active[1]


def shard(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  """Constrains activation `x` to the sharding its logical axis `names` map to (no-op outside use_rules)."""
  active = _ACTIVE.get()
  if active is None:
    return x
  mesh, rules = active
  if len(names) != x.ndim:
    raise ValueError(f"shard: {len(names)} logical names {tuple(names)} for an array of rank {x.ndim}")
  return place(x, logical_to_spec(names, rules, mesh))


def place(x: jax.Array, spec: P) -> jax.Array:
  """Constrains `x` to the mesh axes `spec` names (no-op outside use_rules); inside a shard_map, over the axes
  not manual there."""
  mesh = active_mesh()
  if mesh is None:
    return x
  manual = manual_axes()
  if manual >= set(mesh.axis_names):  # Inside a shard_map over every axis: nothing is left to place.
    return x
  if manual:  # Inside shard_map: the other axes are still the compiler's to place.
    return jax.lax.with_sharding_constraint(x, NamedSharding(jax.sharding.get_abstract_mesh(),
                                                             without_axes(spec, manual)))
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def without_axes(spec: P, axes) -> P:
  """`spec` with the mesh `axes` left out of every entry (an unconstrained entry stays one)."""
  def entry_without(entry):
    if entry is P.UNCONSTRAINED:
      return entry
    return spec_entry(a for a in entry_axes(entry) if a not in axes)
  return P(*(entry_without(e) for e in spec))


def only_axes(spec: P, axes) -> P:
  """`spec` with only the mesh `axes` kept in every entry."""
  return without_axes(spec, {a for e in spec for a in entry_axes(e)} - set(axes))


def shard_map(fn, *, mesh: Mesh, in_specs, out_specs, **kwargs):
  """`jax.shard_map` over `mesh`'s axes (or `axis_names` of them), inside an outer shard_map too (a step's
  data-parallel micro-batches, trainer/step.py): there the axes already manual are left out of the specs and of the map, and, as the outer
  one, it does not check replication (`check_vma=False`): its transpose sums an input's cotangent over the axes
  the input's spec leaves out, so an input whose "cotangent" is a global value rather than a partial sum passes
  it back once (quant/varying.py, `cotangent_once`)."""
  manual = manual_axes()
  if not manual:
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **kwargs)
  if manual >= set(mesh.axis_names):  # Every axis already manual: the values are each device's already.
    return fn
  strip = lambda specs: jax.tree.map(lambda s: without_axes(s, manual), specs, is_leaf=lambda s: isinstance(s, P))
  axis_names = set(kwargs.pop("axis_names", mesh.axis_names)) - manual
  return jax.shard_map(fn, mesh=jax.sharding.get_abstract_mesh(), in_specs=strip(in_specs),
                       out_specs=strip(out_specs), axis_names=axis_names, **{**kwargs, "check_vma": False})


def tree_shardings(logical_tree, mesh: Mesh, rules) -> object:
  """Maps a pytree of logical-name tuples (PartitionSpecs of names) to NamedShardings."""
  rd = rules_dict(rules)
  return jax.tree.map(lambda names: named_sharding(tuple(names), mesh, rd), logical_tree,
                      is_leaf=lambda x: isinstance(x, (P, tuple)))


# The batch axes that may hold replicas (`replica_axes`): data parallelism (mesh.data x mesh.dcn_data) and expert
# parallelism (mesh.expert x mesh.dcn_expert), over which only the experts' weights are split.
REPLICA_AXES = ("data", "expert")


def batch_axes(rules, mesh: Mesh | None = None) -> tuple[str, ...]:
  """The `batch` rule's axes; on `mesh`, those of more than one device."""
  return entry_axes(logical_to_spec((BATCH,), rules_dict(rules), mesh)[0])


def sequence_axes(rules) -> tuple[str, ...]:
  return rules_dict(rules).get(LENGTH, ())


def sequence_parallel_axes(rules, mesh: Mesh | None = None) -> set[str]:
  """The axes of the `residual_length` rule that the `length` rule leaves out: the residual stream's tokens are
  split over them between blocks and whole on them inside one; on `mesh`, those of more than one device."""
  split = lambda name: set(entry_axes(logical_to_spec((name,), rules_dict(rules), mesh)[0]))
  return split(RESIDUAL_LENGTH) - split(LENGTH)


def layer_axes(rules) -> tuple[str, ...]:
  return rules_dict(rules).get(LAYERS, ())


def expert_axes(rules, mesh: Mesh | None = None) -> tuple[str, ...]:
  """The `expert` rule's axes; on `mesh`, those of more than one device."""
  return entry_axes(logical_to_spec((EXPERT,), rules_dict(rules), mesh)[0])


def token_spec(rules, mesh: Mesh | None = None) -> P:
  """How tokens [batch, length] are split (an axis used once, by the batch first; on `mesh`, its size-1 axes left
  out)."""
  return logical_to_spec((BATCH, LENGTH), rules_dict(rules), mesh)


def batch_sharding(rules, mesh: Mesh) -> NamedSharding:
  """Where a global batch of tokens [batch, length] lives on `mesh`."""
  return NamedSharding(mesh, token_spec(rules, mesh))


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
  rules = rules_dict(rules)
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
