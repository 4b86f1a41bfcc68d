"""One pass per quantized operand: a kernel that reads a 2-d tensor once and writes both copies the GEMMs read.

A block-scaled operand of a dense projection is read by two GEMMs along two axes: x along K (forward) and along
M (wgrad), the kernel along K (forward) and along N (dgrad), the output gradient along N (dgrad) and along M
(wgrad). Quantized one copy at a time, XLA reads the bf16 source four times (a block-amax pass and a quantize
pass per copy: it does not put a reduction along rows and one along columns in one kernel) and transposes the
copy quantized along the first axis for the GEMM, which wants its contraction axis last. `both` is one Pallas
kernel per tile of the tensor: it reads the tile once, takes the amaxes of its row blocks and of its column
blocks, and writes
  along the last axis     data [R, C] and scales [R, C / 32], and
  along the first axis    data [C, R] and scales [C, R / 32]: transposed, contraction axis last,
so the source is read once and each copy written once: the fewest bytes a quantize of both copies can move.

Numerics: bit for bit `quantizers.MXFP8Scaling` along each axis (the tests run the kernel in interpret mode on the
CPU against it). The block exponent is read off the amax's float32 bits instead of `frexp`: for a normal amax
= 1.f x 2**(E - 127), frexp's (m, e) are (1.f / 2, E - 126), so k = e - 9 + (m > 0.875) = E - 135 + (f > 0.75);
a subnormal amax gives k <= -134 either way, clipped to -127 as before.

Where it runs (`one_pass`): MXFP8 on a GPU, a dense projection's operands (whose first-axis copies are stored
transposed, quant/dot.py's DenseLayout) whose blocks divide among the devices, without health statistics (they
take the per-copy path, which measures them). The kernel is lowered with Pallas' Triton backend, a
`__gpu$xla.gpu.triton` custom call that the compile report counts by its bytes; elsewhere the per-copy
quantizers run and the first-axis copy is transposed after, so that both paths give the same arrays.
Sharding: `custom_partitioning` runs the kernel on each device's shard; its rule splits a dimension between
blocks only, and a dimension whose shards would still not hold whole blocks is gathered first.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from ember.platform import target_platform
from ember.quant import formats, kernels, partitioning
from ember.quant.formats import E4M3
from ember.quant.quantizers import tensor_amax
from ember.quant.recipe import KERNEL, KERNEL_T
from ember.quant.tensor import QuantizedTensor

BLOCK = 32  # MXFP8's block.
_TILES = (64, 32)  # Tile sides tried, largest first: each a multiple of the block and a power of two.
_E8M0_BIAS = 127
SCOPE = "mxfp8_quantize_both"  # The kernel's name scope: its row in the compile report's `memory_by_op`.


def one_pass(layout, recipe, stats: bool, *operands: jax.Array) -> bool:
  """Whether `operands` of `recipe` (quant/recipe.py's Recipe) in `layout` (quant/core.py's) are quantized by the
  one-pass kernel (see the module doc; the recipe table says which recipes have one)."""
  return layout.transposed and casts(recipe, stats, *operands)


def casts(recipe, stats: bool, *operands: jax.Array) -> bool:
  """Whether this module's kernel casts 2-d `operands` of `recipe` (`both`, or `rows` alone): MXFP8 on a GPU,
  without health statistics, blocks dividing among the devices."""
  return (recipe.scheme.one_pass_kernel and not stats and target_platform() == "gpu"
          and all(a.ndim == 2 and kernels.splits_evenly(a.shape, BLOCK) for a in operands))


def both(a: jax.Array, *, reduce_axes: tuple[str, ...] = (), interpret: bool | None = None):
  """(a quantized along its last axis [R, C], a quantized along its first axis as its transpose [C, R]), both
  MXFP8 QuantizedTensors with `axis=1`, equal to `MXFP8Scaling().quantize(a, axis=1)` and
  `.quantize(a.T, axis=1)`. `interpret`: run the Pallas kernel in interpret mode (default: off a GPU)."""
  kernels.check_whole_blocks(a, BLOCK, "MXFP8")
  interpret = kernels.interpret_off_gpu(interpret)
  with jax.named_scope(SCOPE):
    data, scale, data_t, scale_t = _both(a, interpret, True)
  amax = tensor_amax(a, reduce_axes)  # Read only where a consumer needs it (health, not this path): else dead.
  quantized = lambda d, s: QuantizedTensor(
      data=d, scale_inv=jax.lax.bitcast_convert_type(s, jnp.float8_e8m0fnu), global_scale_inv=jnp.float32(1.0),
      amax=amax, recipe="mxfp8", axis=1, block=(BLOCK,), dtype=jnp.dtype(a.dtype).name)
  return quantized(data, scale), quantized(data_t, scale_t)


def rows(a: jax.Array, *, interpret: bool | None = None) -> QuantizedTensor:
  """`MXFP8Scaling().quantize(a, axis=1)` for a 2-d a of whole blocks: `both`'s kernel writing the first copy
  alone (an operand only one GEMM reads along its last axis: an expert layout's rows), one read of a."""
  kernels.check_whole_blocks(a, BLOCK, "MXFP8")
  interpret = kernels.interpret_off_gpu(interpret)
  with jax.named_scope(SCOPE):
    data, scale = _both(a, interpret, False)
  return QuantizedTensor(data=data, scale_inv=jax.lax.bitcast_convert_type(scale, jnp.float8_e8m0fnu),
                         global_scale_inv=jnp.float32(1.0), amax=tensor_amax(a), recipe="mxfp8", axis=1,
                         block=(BLOCK,), dtype=jnp.dtype(a.dtype).name)


# --- As the GEMM core asks (quant/one_pass.py) ------------------------------------------------------------

def operand_copies(layout, recipe, quantizer, a, stats: bool, keys=None):
  """(a along its last axis, its wgrad copy) from `both`, or None where it does not run (`one_pass`); MXFP8
  rounds to nearest, so `quantizer` and `keys` are not read."""
  return both(a, reduce_axes=layout.reduce_axes) if one_pass(layout, recipe, stats, a) else None


def operand_rows(recipe, quantizer, rows_2d, stats: bool, reduce_axes):
  """`rows` for a 2-d operand where it runs, or None."""
  return rows(rows_2d) if casts(recipe, stats, rows_2d) else None


def kernel_copies(layout, recipe, w, stats: bool, amax=None, row_of=None):
  """{kernel_t, kernel} from `both`, or None: the kernel's amax pass is the kernel's own, so `amax` and
  `row_of` are not read."""
  if not one_pass(layout, recipe, stats, w):
    return None
  kernel_t, kernel = both(w)
  return {KERNEL_T: kernel_t, KERNEL: kernel}


def casts_kernel_tiles(recipe) -> bool:
  """MXFP8 kernels are cast along each axis, not in tiles."""
  return False


# --- The kernel --------------------------------------------------------------------------------------------


def _exponents(amax):
  """MXFP8's block exponent k from a float32 block amax (module doc), as int32."""
  bits = jax.lax.bitcast_convert_type(amax, jnp.int32)
  biased = (bits >> 23) & 0xFF
  k = biased - 135 + ((bits & 0x7FFFFF) > 0x600000).astype(jnp.int32)
  k = jnp.where(amax == 0, -127, k)
  return jnp.where(biased == 255, 0, jnp.clip(k, -127, 127))  # Non-finite amax: scale 1.


def _inverse_scale(k):
  """2**-k as float32, from its bits (k in [-127, 120] for finite amaxes: a normal number)."""
  return jax.lax.bitcast_convert_type((127 - k) << 23, jnp.float32)


def _kernel(x_ref, data_ref, scale_ref, *transposed_refs, rows: int, cols: int):
  x = x_ref[...].astype(jnp.float32)
  magnitude = formats.magnitude(x)
  k_rows = _exponents(jnp.max(magnitude.reshape(rows, cols // BLOCK, BLOCK), axis=2))  # [rows, cols / 32]
  along_rows = jnp.broadcast_to(_inverse_scale(k_rows)[:, :, None], (rows, cols // BLOCK, BLOCK))
  data_ref[...] = kernels.cast_e4m3(x * along_rows.reshape(rows, cols))
  scale_ref[...] = (k_rows + _E8M0_BIAS).astype(jnp.uint8)
  if transposed_refs:  # `both`: the copy along the first axis too.
    data_t_ref, scale_t_ref = transposed_refs
    k_cols = _exponents(jnp.max(magnitude.reshape(rows // BLOCK, BLOCK, cols), axis=1))  # [rows / 32, cols]
    along_cols = jnp.broadcast_to(_inverse_scale(k_cols)[:, None, :], (rows // BLOCK, BLOCK, cols))
    data_t_ref[...] = kernels.cast_e4m3(x * along_cols.reshape(rows, cols)).T
    scale_t_ref[...] = (k_cols + _E8M0_BIAS).astype(jnp.uint8).T


def _call(a, interpret: bool, transposed: bool = True):
  r, c = a.shape
  tr, tc = kernels.tile(r, _TILES), kernels.tile(c, _TILES)
  spec = lambda shape, index: pl.BlockSpec(shape, index)
  straight, crossed = (lambda i, j: (i, j)), (lambda i, j: (j, i))
  return kernels.pallas(
      functools.partial(_kernel, rows=tr, cols=tc), (r // tr, c // tc), [spec((tr, tc), straight)],
      [spec((tr, tc), straight), spec((tr, tc // BLOCK), straight)] + (
          [spec((tc, tr), crossed), spec((tc, tr // BLOCK), crossed)] if transposed else []),
      [jax.ShapeDtypeStruct((r, c), E4M3.dtype), jax.ShapeDtypeStruct((r, c // BLOCK), jnp.uint8)] + (
          [jax.ShapeDtypeStruct((c, r), E4M3.dtype), jax.ShapeDtypeStruct((c, r // BLOCK), jnp.uint8)]
          if transposed else []),
      interpret)(a)


@functools.partial(custom_partitioning, static_argnums=(1, 2))
def _both(a, interpret, transposed):
  return _call(a, interpret, transposed)


def _shardings(mesh, shape, transposed: bool):
  """(the operand's, (data and scales along the last axis[, the transposed copy and its scales])) shardings for
  an operand of `shape`: each device quantizes its shard. A dimension whose shards would not hold whole blocks
  (the rule's propagation may split blocks unevenly on small tensors) is gathered first."""
  r, c = kernels.block_sharded_axes(mesh, shape, BLOCK)
  straight, crossed = NamedSharding(mesh, P(r, c)), NamedSharding(mesh, P(c, r))
  return straight, (straight, straight) + ((crossed, crossed) if transposed else ())


@partitioning.rule
def _partition(interpret, transposed, mesh, arg_shapes, result_shape):
  operand, results = _shardings(mesh, arg_shapes[0], transposed)
  return mesh, lambda a: _call(a, interpret, transposed), results, (operand,)


@partitioning.rule
def _infer(interpret, transposed, mesh, arg_shapes, result_shape):
  return _shardings(mesh, arg_shapes[0], transposed)[1]


def _rule(interpret, transposed, mesh, operand_types, result_types):
  """Each dimension is (blocks, 32 within a block); a scale dimension is the blocks factor alone, so data and
  scales shard alike, and the within-block factors are never sharded: a block is never split."""
  del interpret, mesh, operand_types, result_types
  results = "(r i) (c j), (r i) c" + (", (c j) (r i), (c j) r" if transposed else "")
  return f"(r i) (c j) -> {results}", dict(need_replication_factors=("i", "j"), i=BLOCK, j=BLOCK)


_both.def_partition(partition=_partition, infer_sharding_from_operands=_infer, sharding_rule=_rule)
