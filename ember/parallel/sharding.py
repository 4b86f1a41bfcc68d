"""Logical axis names -> mesh axes: the one place sharding rules are applied.

Layers name the axes of their parameters (`nnx.Param(..., out_sharding=("embed", "mlp"))`) and of
their main activations (`shard(x, ("batch", "length", "embed"))`). The rules table in the config
(`mesh.rules`) maps each logical name to zero, one or several mesh axes. Layer code never
mentions a mesh: outside `use_rules(...)` every `shard` call is a no-op, so a layer runs unchanged
on one device, in a test, or inside `shard_map`.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ember import platform
from ember.names import EMBED, MLP, MLP_IN
from ember.quant.partitioning import entry_axes, spec_entry
from ember.quant.varying import manual_axes

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

_ACTIVE: contextvars.ContextVar[tuple[Mesh, dict] | None] = contextvars.ContextVar("ember_rules", default=None)


def rules_dict(rules) -> dict[str, tuple[str, ...]]:
  """Normalises the config's rules table to {logical: (mesh axes...)}. A table written before `mlp_in` (the down
  projection's input) splits it as the default table does: over `mlp`'s axes, then `embed`'s."""
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

