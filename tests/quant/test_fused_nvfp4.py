"""NVFP4's one-kernel cast (ember/quant/fused_nvfp4.py), run in Pallas' interpret mode, against the quantizer
(itself tested against NumPy in test_quantize.py): the same bytes (data, block scales, tensor scale) along the
last axis and in 16 x 16 tiles, on random, heavy-tailed and special tensors; inside a sharded jit the same as on
one device; and a dense projection built on it, or an expert layout whose x takes the one-copy kernels (MXFP8's
too), gives the same output and gradients as one without them."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ember.quant import fused_nvfp4
from ember.quant.hadamard import random_hadamard_transform
from ember.quant.quantizers import NVFP4Scaling
from tests.xla_cpu import EXACT_FP4_CASTS

# Exact E2M1 casts (tests/xla_cpu.py): the kernel jitted as a program is, the quantizer as it runs op by op.
jit = functools.partial(jax.jit, compiler_options=EXACT_FP4_CASTS)
op_by_op = functools.partial(jax.jit, compiler_options={**EXACT_FP4_CASTS, "xla_allow_excess_precision": False})


def quantized(x, axis, **scaling):
  """The quantizer's cast of `x` along `axis`, the reference."""
  return op_by_op(lambda a: NVFP4Scaling(**scaling).quantize(a, axis=axis))(x)


def _tensor(seed, shape, dtype=jnp.bfloat16):
  k1, k2 = jax.random.split(jax.random.key(seed))
  heavy = jax.random.normal(k1, shape) * jnp.exp(4 * jax.random.normal(k2, shape))  # Blocks of very unlike scales.
  heavy = heavy.at[:16, :16].set(0.0)  # An all-zero block and tile: scale 0, data 0.
  heavy = heavy.at[3, 40].set(3e38).at[40, 3].set(-1e-30).at[7, 7].set(-500.0)  # Saturating, tiny.
  return heavy.at[20, 20].set(-0.0).astype(dtype)  # E2M1 keeps the sign of a zero.


def _bits(a):
  """Bytes of `a`: E2M1 elements in pairs (as they are packed), E4M3 one each."""
  four_bits = jnp.finfo(a.dtype).bits == 4
  return np.asarray(jax.lax.bitcast_convert_type(a.reshape(*a.shape[:-1], -1, 2) if four_bits else a, jnp.uint8))


def _same(got, want):
  assert (got.data.shape, got.scale_inv.shape, got.axis, got.block, got.dtype) == (
      want.data.shape, want.scale_inv.shape, want.axis, want.block, want.dtype)
  for g, w in ((got.data, want.data), (got.scale_inv, want.scale_inv)):
    np.testing.assert_array_equal(_bits(jnp.asarray(g)), _bits(jnp.asarray(w)))
  np.testing.assert_array_equal([got.global_scale_inv, got.amax], [want.global_scale_inv, want.amax])  # NaN alike.


def _cases(grid: list[tuple], kept) -> list:
  """`grid` (a product of options) as pytest params, the cases `kept(*case)` rejects marked extended: a test over a
  product keeps a set in which every pair of options meets (each shape with each tile layout and each dtype, each
  tile layout with each dtype) and leaves the rest of the product to `pytest --extended`."""
  name = lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else getattr(v, "__name__", str(v))
  return [pytest.param(*case, id="-".join(map(name, case)),
                       marks=() if kept(*case) else pytest.mark.extended) for case in grid]


CAST_SHAPES = [(96, 160), (128, 64), (64, 4096), (48, 80)]  # Tiles of 32, 64 and 16.


def _cast_kept(tile_2d, shape, dtype) -> bool:
  """Shape i: the 1D tiles in bfloat16 where i is even, float32 where odd; the 2D tiles in the other dtype."""
  return (CAST_SHAPES.index(shape) + tile_2d) % 2 == (dtype == jnp.float32)


@pytest.mark.parametrize("tile_2d,shape,dtype", _cases(
    [(t, s, d) for s in CAST_SHAPES for t in (False, True) for d in (jnp.bfloat16, jnp.float32)], _cast_kept))
@pytest.mark.variants
def test_cast_equals_the_quantizer(tile_2d, shape, dtype):
  x = _tensor(0, shape, dtype)
  got = jit(lambda a: fused_nvfp4.quantize(a, tile_2d=tile_2d, interpret=True))(x)
  _same(got, quantized(x, 1, tile_2d=tile_2d))


def test_tiles_record_the_axis_they_are_read_along():
  w = _tensor(1, (64, 96), jnp.float32)
  got = jit(lambda a: fused_nvfp4.quantize(a, tile_2d=True, axis=0, interpret=True))(w)
  _same(got, quantized(w, 0, tile_2d=True))
  with pytest.raises(ValueError, match="along the last axis only"):
    fused_nvfp4.quantize(w, axis=0, interpret=True)


def test_non_finite_values_follow_the_quantizer():
  """NaN and infinities make the tensor amax infinite and its scale NaN (every element of the GEMM's output NaN:
  the step is skipped); the same bytes as the quantizer."""
  x = _tensor(2, (64, 64), jnp.float32).at[5, 9].set(jnp.nan).at[40, 50].set(jnp.inf).at[41, 51].set(-jnp.inf)
  for tile_2d in (False, True):
    got = jit(lambda a: fused_nvfp4.quantize(a, tile_2d=tile_2d, interpret=True))(x)
    _same(got, quantized(x, 1, tile_2d=tile_2d))


def test_sharded_equals_one_device():
  """Inside jit on a 2 x 4 mesh (rows over 2 and columns over 4; rows over all 8, as a batch of tokens is): the
  cast equals one device's, and data and scales come out sharded like the operand."""
  x = _tensor(3, (512, 256))
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))
  full = lambda s: tuple(s) + (None,) * (2 - len(s))
  for tile_2d in (False, True):
    want = quantized(x, 1, tile_2d=tile_2d)
    for spec in (P("a", "b"), P(("a", "b"))):
      got = jit(lambda a: fused_nvfp4.quantize(a, tile_2d=tile_2d, interpret=True))(
          jax.device_put(x, NamedSharding(mesh, spec)))
      _same(got, want)
      assert full(got.data.sharding.spec) == full(spec) == full(got.scale_inv.sharding.spec)


def test_a_stacked_kernels_row_is_cast_where_it_lies():
  """`row_of`: a layer's row of stacked [L, R, C] kernels (float32, 16 x 16 tiles), read in place: the same bytes
  as that row cast alone, on one device and sharded as FSDP shards a stacked kernel (its rows, a mesh axis)."""
  stacked = jnp.stack([_tensor(s, (128, 256), jnp.float32) * (s + 1) for s in range(3)])
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))
  for layer in range(3):
    want = quantized(stacked[layer], 0, tile_2d=True)
    cast = lambda w, i=layer: fused_nvfp4.quantize(w[i], tile_2d=True, axis=0, row_of=(w, i), interpret=True)
    _same(jit(cast)(stacked), want)
    _same(jit(cast)(jax.device_put(stacked, NamedSharding(mesh, P(None, "a", "b")))), want)
  with pytest.raises(ValueError, match="is no"):
    fused_nvfp4.quantize(stacked[0, :64], tile_2d=True, row_of=(stacked, 0), interpret=True)


KEYS = (jax.random.key(1), jax.random.key(2))


def quantizer_copies(a, rht_seed, stochastic):
  """`both`'s reference: the quantizer along the last axis, and along the first after the transform,
  transposed."""
  q = NVFP4Scaling(stochastic_rounding=stochastic)
  keys = KEYS if stochastic else (None, None)

  def copies(a):
    transformed = a if rht_seed is None else random_hadamard_transform(a, axis=0, seed=rht_seed)
    return q.quantize(a, axis=1, rng=keys[0]), q.quantize(transformed, axis=0, rng=keys[1]).T
  return op_by_op(copies)(a)


BOTH_SHAPES = [(96, 160), (64, 4096), (48, 80)]


def _both_kept(rht_seed, stochastic, shape) -> bool:
  """Shape i: with the transform rounding stochastically where i is odd (to nearest where even); without it the
  other way."""
  return stochastic == ((BOTH_SHAPES.index(shape) % 2 == 1) == (rht_seed is not None))


@pytest.mark.parametrize("rht_seed,stochastic,shape", _cases(
    [(r, st, s) for s in BOTH_SHAPES for r in (0, None) for st in (False, True)], _both_kept))
@pytest.mark.variants
def test_both_copies_equal_the_quantizer(rht_seed, stochastic, shape):
  """Round to nearest (activations) or stochastically (gradients: the same uniform draws, element by element),
  with or without the Hadamard transform of the wgrad copy."""
  x = _tensor(8, shape)
  got = jit(lambda a: fused_nvfp4.both(a, keys=KEYS if stochastic else None, rht_seed=rht_seed,
                                       interpret=True))(x)
  for g, w in zip(got, quantizer_copies(x, rht_seed, stochastic)):
    _same(g, w)


@pytest.mark.parametrize("shape", [(512, 256), (96, 160)])
def test_the_transform_is_rounded_to_the_source_dtype(shape):
  """The wgrad copy's transformed values, and its tensor amax (no saturating outlier sets it here), are the
  transform rounded to the source's dtype (bf16), as the quantizer takes them, even where the compiler allows
  excess precision (XLA elides a float32 -> bf16 -> float32 round trip, so a cast there kept every bit). The
  values are sixteenths below 4, so every block's float32 sum is exact in any order and only the rounding is
  tested, and one block of column 0 transforms to a largest value that bf16 rounds (59.7734375 -> 59.75)."""
  from ember.quant.hadamard import random_signs  # pylint: disable=g-import-not-at-top
  x = jax.random.randint(jax.random.key(5), shape, -64, 64) / 16
  magnitudes = jnp.array([255 / 64] * 15 + [1 / 128])  # Each exact in bf16; their sum is not.
  x = x.at[:16, 0].set(jnp.asarray(random_signs(0)) * magnitudes).astype(jnp.bfloat16)
  got = jit(lambda a: fused_nvfp4.both(a, rht_seed=0, interpret=True))(x)
  for g, w in zip(got, quantizer_copies(x, 0, False)):
    _same(g, w)


def test_row_bases_are_the_high_and_low_words_of_each_rows_first_index():
  rows, cols = 100_000, 300_007  # 3e10 elements: indices past 2**32, where the high word counts.
  high, low = fused_nvfp4._row_bases(rows, cols)  # pylint: disable=protected-access
  first = np.arange(rows, dtype=np.uint64) * cols
  np.testing.assert_array_equal(np.asarray(high)[:, 0], (first >> 32).astype(np.uint32))
  np.testing.assert_array_equal(np.asarray(low)[:, 0], (first & 0xFFFFFFFF).astype(np.uint32))


def test_an_index_past_a_low_words_end_carries_into_the_high_word():
  """In the kernel each element's index is its row's base (two words) plus its column id: a low word that wraps
  adds one to the high word."""
  indices = fused_nvfp4._indices  # pylint: disable=protected-access
  high, low = indices(np.array([[1]], np.uint32), np.array([[2**32 - 3]], np.uint32), np.arange(5, dtype=np.uint32)[None])
  index = (np.asarray(high, np.uint64) << 32) + np.asarray(low, np.uint64)
  np.testing.assert_array_equal(index[0], 2**32 + 2**32 - 3 + np.arange(5, dtype=np.uint64))


def test_stochastic_rounding_in_the_kernel_only_for_keys_it_reproduces():
  assert fused_nvfp4.draws_as_jax(jax.random.key(0))
  assert not fused_nvfp4.draws_as_jax(jax.random.key(0, impl="rbg"))


def test_both_sharded_equals_one_device():
  """On a 2 x 4 mesh each device casts its shard, drawing what the whole tensor draws at its elements: the copies
  equal one device's, the first sharded like the operand and the second transposed."""
  x = _tensor(9, (512, 256))
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))
  full = lambda s: tuple(s) + (None,) * (2 - len(s))
  want = quantizer_copies(x, 0, True)
  for spec in (P("a", "b"), P(("a", "b"))):
    got = jit(lambda a: fused_nvfp4.both(a, keys=KEYS, rht_seed=0, interpret=True))(
        jax.device_put(x, NamedSharding(mesh, spec)))
    for g, w in zip(got, want):
      _same(g, w)
    assert full(got[0].data.sharding.spec) == full(spec) and full(got[1].data.sharding.spec) == full(spec)[::-1]


@pytest.mark.parametrize("rht,stochastic", [(True, True), (False, False)])
@pytest.mark.variants
def test_a_dense_projection_with_the_kernels_equals_one_without(monkeypatch, rht, stochastic):
  """Traced for a Hopper-like GPU (block-scaled GEMMs emulated in bf16, which the CPU runs), a dense NVFP4
  projection whose operand copies come from the kernels (interpret mode) gives the same output and gradients,
  bit for bit, as one whose copies come from the quantizer: x's two copies, the kernel's tiles, the gradient's
  two copies (stochastically rounded with the same draws; with and without the Hadamard transform)."""
  from ember.platform import on_platform
  from ember.quant import dot
  from ember.quant.recipe import Recipe

  x, w, g = _tensor(4, (96, 64)), _tensor(5, (64, 160), jnp.float32) * 0.05, _tensor(6, (96, 160))
  recipe = Recipe("nvfp4", nvfp4_rht=rht, nvfp4_stochastic_rounding=stochastic)

  def run(use_kernel: bool):
    def f(x, w):
      return dot.quantized_matmul(x, w, recipe=recipe, name="wi", dtype=jnp.bfloat16, key=jax.random.key(7))

    def step(x, w, g):
      y, vjp = jax.vjp(f, x, w)
      return (y, *vjp(g))

    calls = []
    for kernel in ("quantize", "both"):
      original = getattr(fused_nvfp4, kernel)
      monkeypatch.setattr(fused_nvfp4, kernel, lambda a, _f=original, _k=kernel, **kw: calls.append(
          (_k, a.shape, kw.get("keys") is not None)) or _f(a, interpret=True, **kw))
    if not use_kernel:
      monkeypatch.setattr(fused_nvfp4, "casts", lambda *a: False)
    with on_platform("gpu", (9, 0)):
      out = jax.jit(step)(x, w, g)  # A new function each time: no trace cached across the two.
    monkeypatch.undo()
    assert calls == ([("both", (96, 64), False), ("quantize", (64, 160), False), ("both", (96, 160), stochastic)]
                     if use_kernel else [])
    return out

  for a, b in zip(run(True), run(False)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
@pytest.mark.variants
def test_expert_rows_cast_by_the_kernels_equal_the_quantizer(monkeypatch, recipe):
  """The capacity layout's x [E, C, K], quantized along K only, goes through the one-copy kernels viewed as 2-d
  (`fused.rows` for MXFP8, `fused_nvfp4.quantize` for NVFP4; interpret mode, traced for a Hopper-like GPU): the
  expert GEMMs' output and gradients equal, bit for bit, those of the quantizer's copy."""
  from ember.platform import on_platform
  from ember.quant import fused
  from ember.quant.batched import batched_matmul
  from ember.quant.recipe import Recipe

  x, w = _tensor(10, (4 * 32, 64)).reshape(4, 32, 64), _tensor(11, (4, 64, 48), jnp.float32) * 0.05
  g = _tensor(12, (4 * 32, 48)).reshape(4, 32, 48)
  kernel = {"mxfp8": (fused, "rows"), "nvfp4": (fused_nvfp4, "quantize")}[recipe]

  def run(use_kernel: bool):
    def step(x, w, g):
      y, vjp = jax.vjp(lambda x, w: batched_matmul(x, w, recipe=Recipe(recipe, nvfp4_stochastic_rounding=False),
                                                   name="moe_wi", dtype=jnp.bfloat16), x, w)
      return (y, *vjp(g))

    calls = []
    original = getattr(*kernel)
    monkeypatch.setattr(*kernel, lambda a, **kw: calls.append(a.shape) or original(a, interpret=True, **kw))
    if not use_kernel:
      monkeypatch.setattr(kernel[0], "casts", lambda *a: False)
    with on_platform("gpu", (9, 0)):
      out = jax.jit(step)(x, w, g)
    monkeypatch.undo()
    assert calls == ([(128, 64)] if use_kernel else [])
    return out

  for a, b in zip(run(True), run(False)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
