"""The shard_map axes a value varies over, and the casts a custom VJP needs to return its primal's types."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def vma_of(a) -> frozenset:
  """The shard_map axes `a` varies over (empty outside shard_map)."""
  t = jax.typeof(a)
  manual = getattr(t, "manual_axis_type", None)  # JAX >= 0.9; `vma` before.
  return frozenset(manual.varying if manual is not None else getattr(t, "vma", ()) or ())


def manual_axes() -> frozenset[str]:
  """The mesh axes the code being traced runs manually over (inside `jax.shard_map`), or none."""
  mesh = jax.sharding.get_abstract_mesh()
  return frozenset(() if mesh.empty else mesh.manual_axes)


# Manual axes whose devices hold different layers, not shards of one tensor: a pipeline's stages
# (ember/parallel/pipeline.py). No amax or statistic is ever reduced over them.
STAGE_AXES = frozenset({"pipeline"})


def shard_axes() -> frozenset[str]:
  """The manual axes over which one tensor is split (a step's replicas): `manual_axes` but a pipeline's stages.
  Where one value of the whole tensor is wanted (an amax, a routing statistic), it is reduced over these."""
  return manual_axes() - STAGE_AXES


def sum_to(a, vma: frozenset):
  """Sums a cotangent over the axes its primal was replicated on (a kernel shared by token shards),
  as the transpose of shard_map's implicit broadcast would; the VJP must return the primal's type."""
  extra = tuple(sorted(vma_of(a) - vma))
  return jax.lax.psum(a, extra) if extra else a


def varying_as(y: jax.Array, *operands: jax.Array) -> jax.Array:
  """y, varying over every axis its operands vary over: `jax.lax.scaled_dot` and `jax.nn.scaled_matmul`
  (JAX 0.10) type their output as invariant, and a custom VJP around them would then see cotangents of
  another type."""
  missing = tuple(sorted(frozenset().union(*map(vma_of, operands)) - vma_of(y)))
  return jax.lax.pcast(y, missing, to="varying") if missing else y


def first_along(axes) -> jax.Array:
  """Whether this device is the first along each of the shard_map `axes` (True for none)."""
  return functools.reduce(jnp.logical_and, [jax.lax.axis_index(a) == 0 for a in axes], jnp.asarray(True))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def cotangent_once(x, axes: tuple[str, ...]):
  """x, whose cotangent only the first device along the shard_map `axes` passes back (the others pass zeros).
  For an input of a shard_map that does not check replication (`check_vma=False`), whose transpose sums an
  input's cotangent over the axes its spec leaves out: right for a gradient (a partial sum on each device),
  but a delayed-scaling history's or health statistics' "cotangent" is one global value on every device."""
  return x


def _cotangent_once_fwd(x, axes):
  return x, None


def _cotangent_once_bwd(axes, _, ct):
  return (jnp.where(first_along(axes), ct, jnp.zeros_like(ct)),)


cotangent_once.defvjp(_cotangent_once_fwd, _cotangent_once_bwd)
