"""NVFP4's quantize passes as Pallas kernels that read the tensor once per pass.

`quantizers.NVFP4Scaling` written in jnp is several XLA kernels per copy: block amaxes, E4M3 scales, the
division and the E2M1 cast (and, for a wgrad copy, the random Hadamard transform and a transpose), several
writing float32 intermediates of the tensor's size. An NVFP4 copy needs its tensor scale before its first
element can be cast, so the fewest passes are two: one that reads the tensor for its amax, one that reads it
again and writes the copies. These kernels are those passes.

  `quantize`  one copy along the last axis (1 x 16 blocks) or in 16 x 16 tiles (weights): the amax is XLA's
              reduce (one read), the cast this module's kernel (one read, the copy written).
  `both`      a dense operand's two copies: along its last axis (x for the forward GEMM, g for dgrad) and
              along its first (the wgrad copies: after the 16 x 16 random Hadamard transform along that axis,
              stored transposed, contraction axis last), each rounding to nearest or stochastically. A first
              kernel reads the tensor for both amaxes (the transformed tensor's included: the transform runs in
              it and is not written), a second reads it again and writes both copies.
Each copy is written as its GEMM reads it: E2M1 codes two a byte (element 2j in the low nibble of byte j, as XLA
packs float4_e2m1fn: the uint8 array is bitcast to float4 outside, which moves no bytes) and E4M3 scales.

Numerics: bit for bit `NVFP4Scaling(...).quantize` (the tests run the kernels in interpret mode on the CPU
against it), in float32 and in its order:
    scale = cast_e4m3((block_amax / 6) * global_scale)
    data  = e2m1((x * global_scale) / scale), 0 where scale == 0
E2M1's round-to-nearest-even is read off thresholds: its magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 have codes 0..7
and a magnitude at a midpoint goes to the even code, so code = [a > .25] + [a >= .75] + [a > 1.25] +
[a >= 1.75] + [a > 2.5] + [a >= 3.5] + [a > 5]; the sign bit is x's (a negative value that rounds to 0 keeps
it, as the cast does), and NaN is +0. Stochastic rounding is `formats.stochastic_cast` with the same uniform
draws: `jax.random.uniform(key, shape)`'s bits are threefry2x32 of the key and each element's row-major index in
the whole tensor (JAX's partitionable threefry), computed here per element from the global row and column ids,
so a shard draws what the whole tensor would. The Hadamard transform is a float32 GEMM with a 16 x 16 matrix
as in `hadamard.py`, rounded to the tensor's dtype (in bits: `kernels.round_like`); its sums may be ordered
differently from XLA's GEMM, on a GPU, and on the CPU where a block's float32 sum rounds (16 values spanning more
than about 2**12): a last-bit difference before that rounding.

Where they run (`one_pass`, `casts`): NVFP4 operands of a dense projection, and an expert layout's x outside
`shard_map` (quant/core.py), on a GPU, without health statistics, when each dimension's blocks divide among the
devices; stochastic rounding only with keys whose draws the kernel reproduces (`draws_as_jax`). Sharding:
`custom_partitioning` runs a kernel on each device's shard, split between blocks only; the amaxes are then
reduced across devices by XLA.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from ember.names import STACKED_ROW_SCOPE
from ember.platform import target_platform
from ember.quant import formats, kernels, partitioning
from ember.quant.formats import E2M1, E4M3
from ember.quant.hadamard import rht_matrix
from ember.quant.quantizers import scale_from_amax, tensor_amax
from ember.quant.recipe import KERNEL, WEIGHT
from ember.quant.tensor import QuantizedTensor

BLOCK = 16  # NVFP4's block (and tile side).
_TILES = (64, 32, 16)  # Tile sides tried, largest first: multiples of the block, powers of two.
_E2M1_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
_GLOBAL = 6.0 * E4M3.max  # NVFP4's tensor scale numerator: E2M1's max times E4M3's.
SCOPE = "nvfp4_quantize"  # The kernels' name scope: their row in the compile report's `memory_by_op`.


def one_pass(layout, recipe, stats: bool, *operands: jax.Array) -> bool:
  """Whether NVFP4 `operands` of a dense projection (`layout`, quant/core.py's) are quantized by this module's
  kernels (`casts`)."""
  return layout.transposed and casts(recipe, stats, *operands)


def casts(recipe, stats: bool, *operands: jax.Array) -> bool:
  """Whether this module's kernels cast 2-d NVFP4 `operands`: on a GPU, without health statistics, each
  dimension's blocks dividing among the traced program's devices (otherwise propagation may split a block
  between devices, which the partition rule cannot take)."""
  return (recipe.scheme.tensor_scale and not stats and target_platform() == "gpu"
          and all(a.ndim == 2 and kernels.splits_evenly(a.shape, BLOCK) for a in operands))


def casts_kernel_tiles(recipe) -> bool:
  """Whether a dense kernel of `recipe` traced now is cast by `quantize` in 16 x 16 tiles after an amax pass of
  its own (which a step of micro-batches then takes once: quant/dot.py's `takes_kernel_amax`). A kernel whose
  shape does not split evenly among the devices takes the quantizer instead, which ignores the amax handed in."""
  return (recipe.quantized and recipe.scheme.tensor_scale and target_platform() == "gpu"
          and recipe.quantizer(WEIGHT).tile_2d)


def quantize(x: jax.Array, *, tile_2d: bool = False, axis: int = 1, reduce_axes: tuple[str, ...] = (),
             amax: jax.Array | None = None, interpret: bool | None = None,
             row_of: tuple[jax.Array, int] | None = None) -> QuantizedTensor:
  """`NVFP4Scaling(tile_2d=tile_2d).quantize(x, axis=axis)` (round to nearest) for a 2-d x of whole blocks:
  along its last axis, or in 16 x 16 tiles (which serve either axis: `axis` is then the one recorded).
  `reduce_axes`: the mesh axes (inside shard_map) x's tensor amax is taken over; `amax`: max|x|, taken by the
  caller, or None. `interpret`: run the Pallas kernel in interpret mode (default: off a GPU). `row_of`:
  (stacked, i) where x is row i of a stacked [L, R, C] array (a layer's kernel): the kernel then reads that row
  where it lies. A Pallas call reads whole arrays, so for x alone XLA first copied the row out of the stacked
  parameter: 7 GB a step of float32 kernels for llama3_8b on b200x8, more than the cast itself reads."""
  kernels.check_whole_blocks(x, BLOCK, "NVFP4")
  if axis not in ((-2, -1, 0, 1) if tile_2d else (-1, 1)):
    raise ValueError(f"one-pass NVFP4 quantize: axis {axis} of a 2-d operand, 1 x {BLOCK} blocks along the last "
                     f"axis only")
  interpret = kernels.interpret_off_gpu(interpret)
  amax = tensor_amax(x, reduce_axes) if amax is None else amax
  global_scale = scale_from_amax(_GLOBAL, amax)
  source, layer = (x, None) if row_of is None else row_of
  if layer is not None and source.shape[1:] != x.shape:
    raise ValueError(f"one-pass NVFP4 quantize: row {layer} of {source.shape} is no {x.shape} operand")
  reads = contextlib.nullcontext() if layer is None else jax.named_scope(STACKED_ROW_SCOPE.format(source.shape[0]))
  with reads, jax.named_scope(SCOPE):
    packed, scale = _cast_rows(source, global_scale.reshape(1, 1), tile_2d, interpret, layer)
  return _tensor(packed, scale, global_scale, amax, x, axis % 2, (BLOCK,) * (2 if tile_2d else 1))


def both(a: jax.Array, *, keys: tuple[jax.Array, jax.Array] | None = None, rht_seed: int | None = None,
         reduce_axes: tuple[str, ...] = (), interpret: bool | None = None) -> tuple[QuantizedTensor, QuantizedTensor]:
  """A 2-d operand's two copies, equal to
      NVFP4Scaling(stochastic_rounding=sr).quantize(a, axis=1, rng=keys[0])                     along the last axis
      NVFP4Scaling(stochastic_rounding=sr).quantize(rht(a, axis=0), axis=0, rng=keys[1]).T      along the first
  with sr = `keys` is not None (round to nearest otherwise) and rht `hadamard.random_hadamard_transform` with
  `rht_seed` (None: no transform). `reduce_axes`: mesh axes (inside shard_map) the amaxes are taken over."""
  kernels.check_whole_blocks(a, BLOCK, "NVFP4")
  interpret = kernels.interpret_off_gpu(interpret)
  stochastic = keys is not None
  with jax.named_scope(SCOPE):
    rht = _rht(rht_seed)
    tile_amaxes = _amaxes(a, rht, rht_seed is not None, interpret)
    amax_rows, amax_cols = (tensor_amax(t, reduce_axes) for t in tile_amaxes)
    g_rows, g_cols = (scale_from_amax(_GLOBAL, m) for m in (amax_rows, amax_cols))
    extra = ()
    if stochastic:  # Each element's index in the whole tensor, as row bases plus column ids, in both orientations.
      key_words = [w.reshape(1, 1) for k in keys for w in _key_words(k)]
      high, low = _row_bases(a.shape[0], a.shape[1])
      col = jnp.arange(a.shape[1], dtype=jnp.uint32)[None]
      extra = (*key_words, high, low, col, high.T, low.T, col.T)
    outs = _cast_both(a, g_rows.reshape(1, 1), g_cols.reshape(1, 1), rht, rht_seed is not None, stochastic,
                      interpret, *extra)
  rows = _tensor(outs[0], outs[1], g_rows, amax_rows, a, 1, (BLOCK,))
  cols = _tensor(outs[2], outs[3], g_cols, amax_cols, a.T, 1, (BLOCK,))  # Stored transposed: axis 0's copy.
  return rows, cols


def draws_as_jax(key) -> bool:
  """Whether `both`'s in-kernel draws are `jax.random.uniform(key, ...)`'s: a threefry2x32 key under JAX's
  partitionable threefry (the default), whose bits the kernel computes."""
  typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
  impl = jax.random.key_impl(key) if typed else jax.config.jax_default_prng_impl
  return bool(jax.config.jax_threefry_partitionable) and str(impl) == "threefry2x32"


# --- As the GEMM core asks (quant/one_pass.py) ------------------------------------------------------------

def operand_copies(layout, recipe, quantizer, a, stats: bool, keys=None):
  """(a along its last axis, its wgrad copy) from `both`, or None where it does not run (`one_pass`, and keys
  whose draws the kernel reproduces where `quantizer` rounds stochastically)."""
  if not one_pass(layout, recipe, stats, a):
    return None
  keys = keys if quantizer.stochastic_rounding else None
  if keys is not None and not all(draws_as_jax(k) for k in keys):
    return None
  return both(a, keys=keys, rht_seed=recipe.wgrad_rht_seed, reduce_axes=layout.reduce_axes)


def operand_rows(recipe, quantizer, rows_2d, stats: bool, reduce_axes):
  """`quantize` along the last axis for a 2-d operand where it runs (rounding to nearest only), or None."""
  if not casts(recipe, stats, rows_2d) or quantizer.stochastic_rounding:
    return None
  return quantize(rows_2d, reduce_axes=reduce_axes)


def kernel_copies(layout, recipe, w, stats: bool, amax=None, row_of=None):
  """{kernel: w cast in 16 x 16 tiles} (the tiles serve dgrad too), or None where it does not run. `amax`:
  max|w| taken by the caller, or None; `row_of`: (stacked, i) where w lies in stacked kernels, or None."""
  if not (one_pass(layout, recipe, stats, w) and casts_kernel_tiles(recipe)):
    return None
  return {KERNEL: quantize(w, tile_2d=True, axis=0, amax=amax, row_of=row_of)}


def _tensor(packed, scale, global_scale, amax, like, axis, block) -> QuantizedTensor:
  data = jax.lax.bitcast_convert_type(packed, E2M1.dtype).reshape(like.shape)
  return QuantizedTensor(data=data, scale_inv=scale, global_scale_inv=jnp.float32(1.0) / global_scale, amax=amax,
                         recipe="nvfp4", axis=axis, block=block, dtype=jnp.dtype(like.dtype).name)


def _key_words(key) -> tuple[jax.Array, jax.Array]:
  """A threefry key's two uint32 words."""
  data = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
  return data[0], data[1]


def _row_bases(rows: int, cols: int) -> tuple[jax.Array, jax.Array]:
  """(high, low) uint32 words of r * cols for each row r, [rows, 1] each: the row-major index of the row's first
  element, which threefry's counter splits into two words (products of 16-bit halves, with carries)."""
  if cols >= 2**32:
    raise ValueError(f"one-pass NVFP4 quantize: {cols} columns, over 2**32")
  u32 = lambda v: jnp.asarray(v, jnp.uint32)
  r = jnp.arange(rows, dtype=jnp.uint32)
  r_hi, r_lo, c_hi, c_lo = r >> 16, r & 0xFFFF, u32(cols >> 16), u32(cols & 0xFFFF)
  cross_a, cross_b = r_lo * c_hi, r_hi * c_lo
  low = r_lo * c_lo
  low_a = low + (cross_a << 16)
  low_b = low_a + (cross_b << 16)
  high = r_hi * c_hi + (cross_a >> 16) + (cross_b >> 16) + (low_a < low).astype(jnp.uint32) + (
      low_b < low_a).astype(jnp.uint32)
  return high[:, None], low_b[:, None]


# --- Inside the kernels --------------------------------------------------------------------------------------


def _e2m1_codes(y, u=None):
  """E2M1's 4-bit codes of y as int32: formats.cast (u None) or formats.stochastic_cast with uniform draws u."""
  a = jnp.minimum(jnp.abs(y), E2M1.max)
  if u is not None:  # Between E2M1's neighbours lo and lo + ulp, up with probability (a - lo) / ulp: exact values
    # (ulp is a power of two: dividing by it is multiplying by its inverse).
    ulp = jnp.where(a >= 4.0, 2.0, jnp.where(a >= 2.0, 1.0, 0.5))
    per_ulp = jnp.where(a >= 4.0, 0.5, jnp.where(a >= 2.0, 1.0, 2.0))
    lo = jnp.floor(a * per_ulp) * ulp
    a = jnp.minimum(jnp.where(u < (a - lo) * per_ulp, lo + ulp, lo), E2M1.max)
  code = sum(((a >= t) if inclusive else (a > t)).astype(jnp.int32) for t, inclusive in _E2M1_THRESHOLDS)
  negative = (jax.lax.bitcast_convert_type(y, jnp.int32) < 0) & ~jnp.isnan(y)
  return jnp.where(jnp.isnan(y), 0, code + 8 * negative.astype(jnp.int32))


def _packed(codes):
  """[R, C] codes -> [R, C / 2] bytes, element 2j in the low nibble."""
  r, c = codes.shape
  pairs = codes.reshape(r, c // 2, 2)
  return jnp.sum(pairs << (4 * jax.lax.broadcasted_iota(jnp.int32, pairs.shape, 2)), axis=2).astype(jnp.uint8)


def _block_amaxes(magnitude):
  """[R, C] -> [R, C / 16]: the max of each 1 x 16 block."""
  r, c = magnitude.shape
  return jnp.max(magnitude.reshape(r, c // BLOCK, BLOCK), axis=2)


def _tile_amaxes(magnitude):
  """[R, C] -> [R / 16, C / 16]: the max of each 16 x 16 tile."""
  r, c = magnitude.shape
  return jnp.max(_block_amaxes(magnitude).reshape(r // BLOCK, BLOCK, c // BLOCK), axis=1)


def _repeat(s, n: int, axis: int):
  """s repeated n times along `axis` (each element n times in a row)."""
  r, c = s.shape
  if axis == 1:
    return jnp.broadcast_to(s[:, :, None], (r, c, n)).reshape(r, c * n)
  return jnp.broadcast_to(s[:, None, :], (r, n, c)).reshape(r * n, c)


def _divide(a, b, interpret: bool):
  """a / b rounded to nearest, as XLA divides. Triton compiles a float32 `/` to PTX's div.full.f32, up to 2 ulp
  off, which would move values across E4M3 and E2M1 rounding points: the GPU kernel divides with div.rn.f32."""
  a, b = jnp.broadcast_arrays(a, b)
  if interpret:
    return a / b
  from jax.experimental.pallas import triton as pallas_triton  # pylint: disable=g-import-not-at-top
  return pallas_triton.elementwise_inline_asm("div.rn.f32 $0, $1, $2;", args=[a, b], constraints="=f,f,f", pack=1,
                                              result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])[0]


def _cast_blocks(x, global_scale, interpret: bool, tile_2d: bool = False, u=None):
  """NVFP4 of float32 x [R, C] along its last axis: (packed data [R, C / 2], E4M3 scales [R, C / 16] or, for
  16 x 16 tiles, [R / 16, C / 16])."""
  magnitude = formats.magnitude(x)
  amax = _tile_amaxes(magnitude) if tile_2d else _block_amaxes(magnitude)
  block_scale = kernels.cast_e4m3(_divide(amax, 6.0, interpret) * global_scale)
  s = block_scale.astype(jnp.float32)
  s = _repeat(_repeat(s, BLOCK, 0) if tile_2d else s, BLOCK, 1)
  y = jnp.where(s == 0, 0.0, _divide(x * global_scale, s, interpret))
  return _packed(_e2m1_codes(y, u)), block_scale


def _transformed_t(source, rht, transform: bool):
  """The source tile transposed, [C, R], as float32, each block of 16 along R multiplied by the RHT matrix and
  rounded to the source's dtype (`hadamard._apply`); or just transposed. A bf16 source is multiplied on the
  tensor cores, accumulating in float32: its products by +-1/4 are exact, and a float32 GEMM on the CUDA cores
  (32 FLOPs an element) would make this memory-bound kernel compute-bound. The sums' order is the GEMM's, as
  XLA's is its own (the module doc's caveat)."""
  xt = source.T
  if not transform:
    return xt.astype(jnp.float32)
  c, r = xt.shape
  blocks = xt.reshape(c * r // BLOCK, BLOCK)
  if source.dtype == jnp.bfloat16:
    y = jnp.dot(blocks, rht.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
  else:
    y = jnp.dot(blocks.astype(jnp.float32), rht, precision=jax.lax.Precision.HIGHEST,
                preferred_element_type=jnp.float32)
  return kernels.round_like(y.reshape(c, r), source.dtype)


def _rotate_left(v, r: int):
  return (v << np.uint32(r)) | (v >> np.uint32(32 - r))


def _threefry2x32(k1, k2, x1, x2):
  """JAX's threefry2x32 hash (random/threefry2x32.py, unrolled): 20 rounds over two uint32 words."""
  rotations = ((13, 15, 26, 6), (17, 29, 16, 24))
  ks = (k1, k2, k1 ^ k2 ^ np.uint32(0x1BD11BDA))
  x1, x2 = x1 + ks[0], x2 + ks[1]
  for i in range(5):
    for r in rotations[i % 2]:
      x1 = x1 + x2
      x2 = _rotate_left(x2, r) ^ x1
    x1, x2 = x1 + ks[(i + 1) % 3], x2 + ks[(i + 2) % 3] + np.uint32(i + 1)
  return x1, x2


def _uniform(k1, k2, high, low):
  """`jax.random.uniform(key, shape)`'s draw for the elements whose row-major indices are (high, low) words."""
  b1, b2 = _threefry2x32(k1, k2, high, low)
  bits = ((b1 ^ b2) >> np.uint32(9)) | np.uint32(0x3F800000)
  return jnp.maximum(0.0, jax.lax.bitcast_convert_type(bits, jnp.float32) - 1.0)


def _indices(high_ref, low_ref, col_ref):
  """(high, low) words of base + column id, a [R, 1] and a [1, C] operand (or [1, C] and [R, 1]) broadcast."""
  low = low_ref[...] + col_ref[...]
  return high_ref[...] + (low < low_ref[...]).astype(jnp.uint32), low


def _rows_kernel(scale_ref, x_ref, data_ref, block_scale_ref, *, tile_2d: bool, interpret: bool):
  data_ref[...], block_scale_ref[...] = _cast_blocks(x_ref[...].astype(jnp.float32), scale_ref[...], interpret,
                                                     tile_2d)


def _amax_kernel(rht_ref, x_ref, rows_ref, cols_ref, *, transform: bool):
  x = x_ref[...].astype(jnp.float32)
  rows_ref[...] = _tile_amaxes(formats.magnitude(x))
  cols_ref[...] = _tile_amaxes(formats.magnitude(_transformed_t(x_ref[...], rht_ref[...], transform))).T


def _both_kernel(*refs, transform: bool, stochastic: bool, interpret: bool):
  g_rows_ref, g_cols_ref, rht_ref = refs[:3]
  u_rows = u_cols = None
  if stochastic:  # Draws for x [R, C] and for x.T [C, R], each from its elements' indices in the whole tensor.
    k_rows1, k_rows2, k_cols1, k_cols2 = refs[3:7]
    u_rows = _uniform(k_rows1[...], k_rows2[...], *_indices(*refs[7:10]))
    u_cols = _uniform(k_cols1[...], k_cols2[...], *_indices(*refs[10:13]))
  x_ref, data_ref, scale_ref, data_t_ref, scale_t_ref = refs[-5:]
  x = x_ref[...].astype(jnp.float32)
  data_ref[...], scale_ref[...] = _cast_blocks(x, g_rows_ref[...], interpret, u=u_rows)
  xt = _transformed_t(x_ref[...], rht_ref[...], transform)
  data_t_ref[...], scale_t_ref[...] = _cast_blocks(xt, g_cols_ref[...], interpret, u=u_cols)


# --- Calls and their partitioning ----------------------------------------------------------------------------


def _tiles(x) -> tuple[int, int]:
  return kernels.tile(x.shape[-2], _TILES), kernels.tile(x.shape[-1], _TILES)


_WHOLE = lambda shape: pl.BlockSpec(shape, lambda i, j: (0, 0))  # noqa: E731  A small input every tile reads.


def _rows_call(x, global_scale, tile_2d: bool, interpret: bool, layer: int | None = None):
  """x [R, C], or row `layer` of x [L, R, C] read where it lies."""
  (r, c), (tr, tc) = x.shape[-2:], _tiles(x)
  scale_rows, scale_tile_rows = (r // BLOCK, tr // BLOCK) if tile_2d else (r, tr)
  source = (pl.BlockSpec((tr, tc), lambda i, j: (i, j)) if layer is None
            else pl.BlockSpec((None, tr, tc), lambda i, j: (layer, i, j)))
  return kernels.pallas(
      functools.partial(_rows_kernel, tile_2d=tile_2d, interpret=interpret), (r // tr, c // tc),
      [_WHOLE((1, 1)), source],
      [pl.BlockSpec((tr, tc // 2), lambda i, j: (i, j)),
       pl.BlockSpec((scale_tile_rows, tc // BLOCK), lambda i, j: (i, j))],
      [jax.ShapeDtypeStruct((r, c // 2), jnp.uint8), jax.ShapeDtypeStruct((scale_rows, c // BLOCK), E4M3.dtype)],
      interpret)(global_scale, x)


def _rht(seed: int | None) -> jax.Array:
  """The transform's 16 x 16 matrix (an identity stand-in where there is no transform: the kernels skip it)."""
  return jnp.asarray(rht_matrix(seed) if seed is not None else np.eye(BLOCK, dtype=np.float32))


def _amax_call(x, m, transform: bool, interpret: bool):
  (r, c), (tr, tc) = x.shape, _tiles(x)
  tiles = pl.BlockSpec((tr // BLOCK, tc // BLOCK), lambda i, j: (i, j))
  out = jax.ShapeDtypeStruct((r // BLOCK, c // BLOCK), jnp.float32)
  return kernels.pallas(functools.partial(_amax_kernel, transform=transform), (r // tr, c // tc),
                 [_WHOLE((BLOCK, BLOCK)), pl.BlockSpec((tr, tc), lambda i, j: (i, j))], [tiles, tiles], [out, out],
                 interpret)(m, x)


def _both_call(x, g_rows, g_cols, m, transform: bool, stochastic: bool, interpret: bool, *extra):
  (r, c), (tr, tc) = x.shape, _tiles(x)
  straight, crossed = (lambda i, j: (i, j)), (lambda i, j: (j, i))
  in_specs = [_WHOLE((1, 1)), _WHOLE((1, 1)), _WHOLE((BLOCK, BLOCK))]
  if stochastic:  # Four key words; the rows' index bases (two words) and the columns' ids, then transposed.
    rows, cols = pl.BlockSpec((tr, 1), lambda i, j: (i, 0)), pl.BlockSpec((1, tc), lambda i, j: (0, j))
    rows_t, cols_t = pl.BlockSpec((1, tr), lambda i, j: (0, i)), pl.BlockSpec((tc, 1), lambda i, j: (j, 0))
    in_specs += [_WHOLE((1, 1))] * 4 + [rows, rows, cols, rows_t, rows_t, cols_t]
  in_specs += [pl.BlockSpec((tr, tc), straight)]
  return kernels.pallas(
      functools.partial(_both_kernel, transform=transform, stochastic=stochastic, interpret=interpret),
      (r // tr, c // tc), in_specs,
      [pl.BlockSpec((tr, tc // 2), straight), pl.BlockSpec((tr, tc // BLOCK), straight),
       pl.BlockSpec((tc, tr // 2), crossed), pl.BlockSpec((tc, tr // BLOCK), crossed)],
      [jax.ShapeDtypeStruct((r, c // 2), jnp.uint8), jax.ShapeDtypeStruct((r, c // BLOCK), E4M3.dtype),
       jax.ShapeDtypeStruct((c, r // 2), jnp.uint8), jax.ShapeDtypeStruct((c, r // BLOCK), E4M3.dtype)],
      interpret)(g_rows, g_cols, m, *extra, x)


def _spec(mesh, shape):
  return kernels.block_sharded_axes(mesh, shape, BLOCK)


def _named(mesh, *specs):
  return tuple(NamedSharding(mesh, P(*s)) for s in specs)


# `quantize`'s cast: x [R, C] (or [L, R, C] and a row of it) and the tensor scale [1, 1] -> data [R, C / 2],
# scales.


@functools.partial(custom_partitioning, static_argnums=(2, 3, 4))
def _cast_rows(x, global_scale, tile_2d, interpret, layer):
  return _rows_call(x, global_scale, tile_2d, interpret, layer)


def _rows_shardings(mesh, arg_shapes):
  """A stacked operand's rows of layers are read whole on every device (only its own row is read)."""
  x = arg_shapes[0]
  lead = x.ndim - 2
  spec = tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))
  row = jax.ShapeDtypeStruct(x.shape[lead:], x.dtype, sharding=NamedSharding(mesh, P(*spec[lead:])))
  r, c = _spec(mesh, row)
  return _named(mesh, (None,) * lead + (r, c), ()), _named(mesh, (r, c), (r, c))


@partitioning.rule
def _rows_partition(tile_2d, interpret, layer, mesh, arg_shapes, result_shape):
  operands, results = _rows_shardings(mesh, arg_shapes)
  return mesh, lambda x, g: _rows_call(x, g, tile_2d, interpret, layer), results, operands


def _rows_rule(tile_2d, interpret, layer, mesh, operand_types, result_types):
  """Rows are (blocks, 16) for tiles, columns (blocks, 8 byte pairs, 2): a byte is a pair of columns and a scale
  a block of them (or a tile), so data and scales shard alike and no block is split. A stacked operand's layers
  (`l`) stay whole. Factors needing replication are listed in the order they appear."""
  del interpret, mesh, operand_types, result_types
  lead, stacked = ("l ", ("l",)) if layer is not None else ("", ())
  if tile_2d:
    return (f"{lead}(r i) (c j k), g h -> (r i) (c j), r c",
            dict(need_replication_factors=(*stacked, "i", "j", "k", "g", "h"), i=BLOCK, j=BLOCK // 2, k=2))
  return (f"{lead}r (c j k), g h -> r (c j), r c",
          dict(need_replication_factors=(*stacked, "j", "k", "g", "h"), j=BLOCK // 2, k=2))


@partitioning.rule
def _rows_infer(tile_2d, interpret, layer, mesh, arg_shapes, result_shape):
  return _rows_shardings(mesh, arg_shapes)[1]


_cast_rows.def_partition(partition=_rows_partition, infer_sharding_from_operands=_rows_infer,
                         sharding_rule=_rows_rule)


# `both`'s amax pass: x [R, C] and the transform's matrix -> the max of each 16 x 16 tile of |x| and of
# |x transformed|, [R / 16, C / 16].


@functools.partial(custom_partitioning, static_argnums=(2, 3))
def _amaxes(x, m, transform, interpret):
  return _amax_call(x, m, transform, interpret)


@partitioning.rule
def _amax_partition(transform, interpret, mesh, arg_shapes, result_shape):
  r, c = _spec(mesh, arg_shapes[0])
  return (mesh, lambda x, m: _amax_call(x, m, transform, interpret), _named(mesh, (r, c), (r, c)),
          _named(mesh, (r, c), ()))


@partitioning.rule
def _amax_infer(transform, interpret, mesh, arg_shapes, result_shape):
  return _named(mesh, _spec(mesh, arg_shapes[0]), _spec(mesh, arg_shapes[0]))


def _amax_rule(transform, interpret, mesh, operand_types, result_types):
  del transform, interpret, mesh, operand_types, result_types
  return "(r i) (c j), p q -> r c, r c", dict(need_replication_factors=("i", "j", "p", "q"), i=BLOCK, j=BLOCK)


_amaxes.def_partition(partition=_amax_partition, infer_sharding_from_operands=_amax_infer, sharding_rule=_amax_rule)


# `both`'s cast: x [R, C], the two tensor scales, the transform's matrix, [stochastic: four key words, row bases
# [R, 1] x 2, column ids [1, C], and those three transposed] -> along rows: data [R, C / 2], scales [R, C / 16];
# along columns: data [C, R / 2], scales [C, R / 16].


@functools.partial(custom_partitioning, static_argnums=(4, 5, 6))
def _cast_both(x, g_rows, g_cols, m, transform, stochastic, interpret, *extra):
  return _both_call(x, g_rows, g_cols, m, transform, stochastic, interpret, *extra)


def _both_shardings(mesh, arg_shapes, stochastic: bool):
  r, c = _spec(mesh, arg_shapes[0])
  index = [(r, None), (r, None), (None, c), (None, r), (None, r), (c, None)]
  operands = [(r, c), (), (), ()] + ([()] * 4 + index if stochastic else [])
  return _named(mesh, *operands), _named(mesh, (r, c), (r, c), (c, r), (c, r))


@partitioning.rule
def _both_partition(transform, stochastic, interpret, mesh, arg_shapes, result_shape):
  operands, results = _both_shardings(mesh, arg_shapes, stochastic)
  call = lambda x, g_rows, g_cols, m, *extra: _both_call(x, g_rows, g_cols, m, transform, stochastic, interpret,
                                                         *extra)
  return mesh, call, results, operands


@partitioning.rule
def _both_infer(transform, stochastic, interpret, mesh, arg_shapes, result_shape):
  return _both_shardings(mesh, arg_shapes, stochastic)[1]


def _both_rule(transform, stochastic, interpret, mesh, operand_types, result_types):
  """x is (r i) (c j), 16-blocks both ways; a data dimension of bytes is (blocks, 8), a scale dimension blocks."""
  del transform, interpret, mesh, operand_types, result_types
  extra = (", k1 k2, k3 k4, k5 k6, k7 k8, (r i) z1, (r i) z2, y1 (c j), z3 (r i), z4 (r i), (c j) y2"
           if stochastic else "")
  scalars = ("k1", "k2", "k3", "k4", "k5", "k6", "k7", "k8", "z1", "z2", "y1", "z3", "z4", "y2") if stochastic else ()
  return (f"(r i) (c j), g1 g2, g3 g4, p q{extra} -> (r i) (c b), (r i) c, (c j) (r a), (c j) r",
          dict(need_replication_factors=("i", "j", "g1", "g2", "g3", "g4", "p", "q", *scalars, "b", "a"), i=BLOCK,
               j=BLOCK, b=BLOCK // 2, a=BLOCK // 2))


_cast_both.def_partition(partition=_both_partition, infer_sharding_from_operands=_both_infer,
                         sharding_rule=_both_rule)
