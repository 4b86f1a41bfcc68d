"""The one-pass MXFP8 quantize kernel (ember/quant/fused.py), run in Pallas' interpret mode, against the per-copy
quantizer (itself tested against NumPy in test_quantize.py): the same bytes, both copies, on random, heavy-tailed
and special tensors; and inside a sharded jit, the same as on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ember.quant import fused
from ember.quant.quantizers import MXFP8Scaling


def per_copy(a):
  """`both`'s two copies from the per-copy quantizer: the reference."""
  return MXFP8Scaling(fused.BLOCK).quantize(a, axis=1), MXFP8Scaling(fused.BLOCK).quantize(a.T, axis=1)


def _tensor(seed, shape, dtype=jnp.bfloat16):
  k1, k2 = jax.random.split(jax.random.key(seed))
  heavy = jax.random.normal(k1, shape) * jnp.exp(4 * jax.random.normal(k2, shape))  # Blocks of very unlike scales.
  heavy = heavy.at[:32, :32].set(0.0)  # An all-zero block: its scale is 2**-127.
  heavy = heavy.at[3, 40].set(3e38).at[40, 3].set(-1e-30).at[7, 7].set(-500.0)  # Saturating, tiny, past 448.
  return heavy.astype(dtype)


def _bits(a):
  return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8))


def _same(got, want):
  for g, w in zip(got, want):
    assert g.data.shape == w.data.shape and g.axis == w.axis == 1 and g.block == w.block
    np.testing.assert_array_equal(_bits(g.data), _bits(w.data))
    np.testing.assert_array_equal(_bits(g.scale_inv), _bits(w.scale_inv))
    assert float(g.amax) == float(w.amax)


@pytest.mark.parametrize("shape", [(96, 160), (128, 64), (64, 4096)])  # Tiles of 32 and 64, one tall tile row.
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.variants
def test_both_copies_equal_the_per_copy_quantizer(shape, dtype):
  x = _tensor(0, shape, dtype)
  _same(jax.jit(lambda a: fused.both(a, interpret=True))(x), per_copy(x))


@pytest.mark.parametrize("shape", [(96, 160), (64, 4096)])
@pytest.mark.variants
def test_rows_alone_equal_the_quantizer(shape):
  """`rows`, the kernel writing the copy along the last axis alone: the quantizer's bytes."""
  x = _tensor(6, shape)
  _same([jax.jit(lambda a: fused.rows(a, interpret=True))(x)], [MXFP8Scaling(fused.BLOCK).quantize(x, axis=1)])


def test_non_finite_values_follow_the_format_rules():
  x = _tensor(1, (64, 64), jnp.float32).at[5, 9].set(jnp.nan).at[40, 50].set(jnp.inf).at[41, 51].set(-jnp.inf)
  got, want = jax.jit(lambda a: fused.both(a, interpret=True))(x), per_copy(x)
  for g, w in zip(got, want):  # NaN stays NaN (bits may differ in sign); the rest byte for byte.
    gd, wd = _bits(g.data), _bits(w.data)
    nan = np.isnan(np.asarray(w.data, np.float32))
    assert (np.isnan(np.asarray(g.data, np.float32)) == nan).all()
    np.testing.assert_array_equal(gd[~nan], wd[~nan])
    np.testing.assert_array_equal(_bits(g.scale_inv), _bits(w.scale_inv))


@pytest.mark.long
def test_sharded_equals_one_device():
  """Inside jit on a 2 x 4 mesh (rows over 2 and columns over 4; rows over all 8, as a batch of tokens is): the
  copies equal one device's, and each comes out sharded like its operand (transposed for the second)."""
  x = _tensor(2, (512, 128))
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))
  want = per_copy(x)
  for spec in (P("a", "b"), P(("a", "b"))):
    got = jax.jit(lambda a: fused.both(a, interpret=True))(jax.device_put(x, NamedSharding(mesh, spec)))
    _same(got, want)
    full = lambda s: tuple(s) + (None,) * (2 - len(s))
    assert full(got[0].data.sharding.spec) == full(spec) and full(got[1].data.sharding.spec) == full(spec)[::-1]


def test_a_dense_projection_with_the_kernel_equals_one_without(monkeypatch):
  """Traced for a Hopper-like GPU (block-scaled GEMMs emulated in bf16, which the CPU runs), a dense MXFP8
  projection whose operands come from the one-pass kernel (interpret mode) gives the output and gradients of one
  whose operands come from the per-copy quantizers: the operands are the same bytes (above), and the CPU's dot
  sums a transposed operand in another order, so the results agree to float32 rounding, not bit for bit."""
  from ember.platform import on_platform
  from ember.quant import dot
  from ember.quant.recipe import Recipe

  x, w, g = _tensor(3, (96, 64)), _tensor(4, (64, 160), jnp.float32) * 0.05, _tensor(5, (96, 160))

  def run(use_kernel: bool):
    def f(x, w):
      return dot.quantized_matmul(x, w, recipe=Recipe("mxfp8"), name="wi", dtype=jnp.bfloat16)

    def step(x, w, g):
      y, vjp = jax.vjp(f, x, w)
      return (y, *vjp(g))

    calls = []
    kernel = fused.both
    monkeypatch.setattr(fused, "both", lambda a, **kw: calls.append(a.shape) or kernel(a, interpret=True, **kw))
    monkeypatch.setattr(fused, "casts", lambda *a: use_kernel)
    with on_platform("gpu", (9, 0)):
      out = jax.jit(step)(x, w, g)  # A new function each time: no trace cached across the two.
    monkeypatch.undo()
    assert calls == ([(96, 64), (64, 160), (96, 160)] if use_kernel else [])  # x, the kernel, the gradient.
    return out

  for a, b in zip(run(True), run(False)):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * np.abs(b).max())
