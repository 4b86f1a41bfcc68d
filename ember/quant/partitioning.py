"""How the partition rules of ember's self-partitioning kernels (the Pallas quantize kernels of quant/fused.py and
quant/fused_nvfp4.py, cuDNN's block-scaled GEMM in quant/gemm.py: `custom_partitioning`) see their operands.

Over a whole mesh, JAX hands a rule NamedShardings over that mesh. Inside a `shard_map` over part of a mesh (a
step's data- or expert-parallel replicas, trainer/step.py), XLA partitions each replica's group of devices on its
own and hands the rule that group's shardings: device ids numbered within the group, in the order of the op's
own tiling, and no mesh axes. `rule` decodes those over a mesh of the group's own, one axis per prime factor of
its size, major to minor: every tiling XLA writes (an iota of the devices, reshaped and transposed) is a
PartitionSpec over it, and every operand's in the same numbering. A rule written against mesh axes then runs
unchanged, and the shardings it returns over that mesh are the group's again.

What a rule cannot do there is name a collective: XLA reads a partitioned body's replica groups as the program's
device ids, which an axis of the group's mesh does not give (`collectives`). Nor can a group of one device be
handed to a rule (JAX cannot read the sharding XLA gives it): where the replicas leave no axis of more than one
device to the compiler, the step's shard_map is manual over every axis instead (trainer/step.py). The decoding
reads JAX's own sharding internals (`_hlo_sharding`, `parse_flatten_op_sharding`; as of JAX 0.10)."""

from __future__ import annotations

import functools
import itertools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

_GROUP_AXIS = "replica_group_"  # The prefix of a group mesh's axes.


def rule(fn):
  """A partition or infer rule `fn(*static_args, mesh, arg_shapes, result_shape)` that sees NamedShardings over
  a mesh wherever it runs (see the module doc)."""
  @functools.wraps(fn)
  def wrapped(*args):
    *static, mesh, arg_shapes, result_shape = args
    return fn(*static, *_named(mesh, arg_shapes, result_shape))
  return wrapped


def entry_axes(entry) -> tuple[str, ...]:
  """The mesh axes one PartitionSpec entry names (None, an axis, or a tuple of axes)."""
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def spec_entry(axes) -> str | tuple[str, ...] | None:
  """The PartitionSpec entry that names `axes` (`entry_axes`' inverse): None for none, an axis, or a tuple."""
  axes = tuple(axes)
  return None if not axes else axes[0] if len(axes) == 1 else axes


def collectives(mesh: Mesh) -> bool:
  """Whether a rule handed `mesh` may reduce over its axes: not over a replica group's own mesh."""
  return not any(a.startswith(_GROUP_AXIS) for a in mesh.axis_names)


def _named(mesh, arg_shapes, result_shape):
  leaves = [s for s in jax.tree.leaves((arg_shapes, result_shape)) if s.sharding is not None]
  if all(isinstance(s.sharding, NamedSharding) for s in leaves):
    return mesh, arg_shapes, result_shape
  if any(isinstance(s.sharding, NamedSharding) for s in leaves):
    raise ValueError(f"a partition rule handed shardings over a mesh and a replica group's at once: {leaves}")
  first = leaves[0].sharding
  # The group's size: any tiled sharding's devices (a replicated one names none; all replicated, one will do).
  size = max(max(s.sharding._hlo_sharding.num_devices() for s in leaves), 1)  # pylint: disable=protected-access
  for factors in sorted(set(itertools.permutations(_prime_factors(size)))):  # One order, but for mixed primes.
    group = Mesh(np.array(first._device_assignment[:size]).reshape(factors),  # pylint: disable=protected-access
                 tuple(f"{_GROUP_AXIS}{i}" for i in range(len(factors))))
    try:
      return group, jax.tree.map(lambda s: _over(group, s), arg_shapes), jax.tree.map(lambda s: _over(group, s),
                                                                                        result_shape)
    except (ValueError, AssertionError, KeyError, NotImplementedError):  # JAX's decoder: no tiling over `group`.
      continue
  raise ValueError(f"a replica group's sharding {first} is no tiling of a mesh of {size} devices")


def _over(group: Mesh, shape):
  """`shape` with its group-local sharding as a NamedSharding over `group`."""
  if shape.sharding is None or isinstance(shape.sharding, NamedSharding):
    return shape
  from jax._src.sharding_impls import parse_flatten_op_sharding  # pylint: disable=g-import-not-at-top
  spec = parse_flatten_op_sharding(shape.sharding._hlo_sharding, group)[0]  # pylint: disable=protected-access
  spec = P(*spec, *((None,) * (len(shape.shape) - len(spec))))
  return jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=NamedSharding(group, spec))


def _prime_factors(n: int) -> tuple[int, ...]:
  """n's prime factors, smallest first ((1,) for 1)."""
  factors, p = [], 2
  while n > 1:
    while n % p == 0:
      factors.append(p)
      n //= p
    p += 1
  return tuple(factors) or (1,)
