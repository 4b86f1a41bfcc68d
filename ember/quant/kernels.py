"""What the Pallas quantize kernels (quant/fused.py for MXFP8, quant/fused_nvfp4.py for NVFP4) share: where they
run in interpret mode, their tiles, the E4M3 cast inside a kernel, the Triton call, and how an operand's sharding
is split between whole blocks for `custom_partitioning`."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ember.platform import target_platform, traced_device_count
from ember.quant import partitioning
from ember.quant.formats import E4M3


def interpret_off_gpu(interpret: bool | None) -> bool:
  """`interpret`, or by default: interpret mode wherever the traced platform is not a GPU."""
  return target_platform() != "gpu" if interpret is None else interpret


def tile(n: int, sides: tuple[int, ...]) -> int:
  """The largest of `sides` (powers of two, multiples of the block, largest first) that divides n."""
  return next(t for t in sides if n % t == 0)


def cast_e4m3(v):
  """formats.cast to E4M3 inside a kernel: saturating, NaN kept, round to nearest even."""
  clipped = jnp.minimum(jnp.maximum(v, -E4M3.max), E4M3.max)
  return jnp.where(jnp.isnan(v), v, clipped).astype(E4M3.dtype)


def round_like(v, dtype):
  """float32 `v` rounded to `dtype`'s precision (nearest even) and kept in float32: `v.astype(dtype)
  .astype(float32)` for bf16, written in bits because a compiler that allows excess precision (XLA's default, which
  runs a kernel in interpret mode) may elide that round trip and keep every bit of v. NaN stays NaN."""
  if jnp.dtype(dtype) == jnp.float32:
    return v
  if jnp.dtype(dtype) != jnp.bfloat16:
    raise ValueError(f"round_like: a float32 or bfloat16 source, got {jnp.dtype(dtype)}")
  bits = jax.lax.bitcast_convert_type(v, jnp.uint32)
  bits = (bits + jnp.uint32(0x7FFF) + ((bits >> 16) & jnp.uint32(1))) & jnp.uint32(0xFFFF0000)
  return jnp.where(jnp.isnan(v), v, jax.lax.bitcast_convert_type(bits, jnp.float32))


def pallas(kernel, grid, in_specs, out_specs, out_shape, interpret: bool, num_warps: int = 4):
  """`pl.pallas_call` lowered through Triton (`num_warps` warps, one stage: each tile is read once) or
  interpreted."""
  params = {}
  if not interpret:
    from jax.experimental.pallas import triton as pallas_triton  # pylint: disable=g-import-not-at-top
    params["compiler_params"] = pallas_triton.CompilerParams(num_warps=num_warps, num_stages=1)
  return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                        interpret=interpret, **params)


def check_whole_blocks(a, block: int, recipe: str) -> None:
  """ValueError unless `a` is a 2-d operand of whole `block`-blocks both ways (what the kernels tile)."""
  if a.ndim != 2 or a.shape[0] % block or a.shape[1] % block:
    raise ValueError(f"one-pass {recipe} quantize: a 2-d operand of whole {block}-blocks, got {a.shape}")


def splits_evenly(shape, block: int) -> bool:
  """Whether each dimension's blocks divide among the traced program's devices. Otherwise sharding propagation
  may split a dimension over part of a mesh axis (64 rows are 2 blocks of 32: half of an 8-way axis), a sharding
  that `custom_partitioning` cannot hand to a partition rule; such an operand takes the quantizer."""
  devices = traced_device_count()
  return all(n % block == 0 and (n // block) % devices == 0 for n in shape)


def block_sharded_axes(mesh, shape, block: int) -> tuple:
  """A 2-d operand's (rows, columns) mesh axes, each kept only where its shards hold whole blocks (a partition
  rule's propagation may split blocks unevenly on small tensors; such a dimension is gathered first)."""
  spec = tuple(shape.sharding.spec) + (None,) * (2 - len(shape.sharding.spec))
  return tuple(s if whole_blocks(s, n, mesh, block) else None for s, n in zip(spec, shape.shape))


def whole_blocks(entry, size: int, mesh, block: int) -> bool:
  """Whether a dimension of `size` split over the mesh axes of PartitionSpec `entry` leaves each shard whole blocks."""
  shards = math.prod(mesh.shape[a] for a in partitioning.entry_axes(entry))
  return size % shards == 0 and (size // shards) % block == 0
