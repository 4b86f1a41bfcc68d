"""Every recipe against the NumPy reference, bit for bit; pytrees, jit, scan, Orbax."""

import dataclasses
import functools

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

import reference as ref
from tests.xla_cpu import EXACT_FP4_CASTS
from ember.quant import (E4M3, E5M2, QUANTIZED_RECIPES, RECIPES, ROLES, CurrentScaling,
                         DelayedScaling, MXFP8Scaling, NVFP4Scaling,
                         QuantizedTensor, make_quantizer, quantize,
                         health, update_history)

# One worker runs this module (`--dist loadgroup`): its tests share module-scoped state.
pytestmark = pytest.mark.xdist_group("test_quantize")

FIELDS = ("data", "scale_inv", "global_scale_inv", "amax")
# Compiled once per shape and recipe: far faster than op-by-op dispatch.
jquantize = jax.jit(quantize, static_argnames=("recipe", "role", "axis"), compiler_options=EXACT_FP4_CASTS)


def assert_same(actual, expected):
  """Bitwise equality; any NaN matches any NaN (payload and sign aside)."""
  a, e = np.asarray(actual), np.asarray(expected)
  assert a.dtype == e.dtype and a.shape == e.shape, (a.dtype, a.shape, e.dtype, e.shape)
  a_nan, e_nan = np.isnan(a.astype(np.float32)), np.isnan(e.astype(np.float32))
  np.testing.assert_array_equal(a_nan, e_nan)
  bits = lambda v: v.reshape(-1).view(f"u{v.dtype.itemsize}")
  np.testing.assert_array_equal(bits(a)[~e_nan.reshape(-1)], bits(e)[~e_nan.reshape(-1)])


def assert_matches(qt, deq, expected):
  for f in FIELDS:
    assert_same(getattr(qt, f), expected[f])
  assert_same(deq, expected["deq"])


# The fusion emitters: the tests' fast CPU code generation rounds an E2M1 cast twice (tests/xla_cpu.py), and the
# bytes here are checked against the reference's single rounding (a 16x16 weight tile of 4090, 3409 and ones: 4, not 6).
@functools.partial(jax.jit, static_argnames="axis", compiler_options=EXACT_FP4_CASTS)
def run(q, x, axis, rng=None):
  qt = q.quantize(x, axis, rng=rng)
  return qt, qt.dequantize(jnp.float32)


@st.composite
def tensors(draw, shapes):
  """float32 arrays: mixed magnitudes, zero blocks, edge values, NaN/Inf.

  Float32 subnormal inputs are excluded (backend-defined, see formats.py);
  the formats' own subnormals are reached through the scales.
  """
  shape = draw(st.sampled_from(shapes))
  mag = st.floats(2.0**-20, 2.0**20, width=32)
  edge = st.sampled_from([0.0, -0.0, 448.0, 57344.0, 6.0, 1e6, -1e6])
  x = draw(hnp.arrays(np.float32, shape, elements=mag | edge))
  x = x * draw(hnp.arrays(np.float32, shape, elements=st.sampled_from([1.0, -1.0])))
  if draw(st.booleans()):  # Zero an aligned run: often a whole block.
    flat, run = x.reshape(-1), draw(st.sampled_from([16, 32]))
    start = draw(st.integers(0, max(flat.size - run, 0))) // run * run
    flat[start:start + run] = 0
  if draw(st.integers(0, 3)) == 0:
    i = draw(st.integers(0, x.size - 1))
    x.reshape(-1)[i] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
  return x.astype(np.float32)


PER_TENSOR_SHAPES = [(8,), (4, 16), (2, 3, 32)]
MX_SHAPES = [(32,), (2, 64), (3, 32)]
NV_SHAPES = [(16,), (4, 32), (2, 2, 16)]
TILE_SHAPES = [(16, 16), (32, 48), (2, 16, 32)]


@pytest.mark.parametrize("role", ROLES)
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_fp8_current(role, data):
  x = data.draw(tensors(PER_TENSOR_SHAPES))
  fmt = "e5m2" if role == "gradient" else "e4m3"
  qt, deq = run(make_quantizer("fp8_current", role), x, -1)
  assert_matches(qt, deq, ref.fp8_current(x, fmt))
  assert (qt.recipe, qt.block, qt.data.dtype) == ("fp8_current", (), ref.DTYPES[fmt])


@settings(max_examples=30, deadline=None)
@given(x=tensors(PER_TENSOR_SHAPES[1:]), fmt=st.sampled_from(["e4m3", "e5m2"]),
       margin=st.sampled_from([0, 2]), algo=st.sampled_from(["max", "most_recent"]),
       history=hnp.arrays(np.float32, (4,), elements=st.sampled_from(
           [0.0, 1e-3, 1.0, 300.0, 1e5, np.nan, np.inf])))
def test_fp8_delayed(x, fmt, margin, algo, history):
  q = DelayedScaling(jnp.asarray(history), fmt, margin, algo)
  qt, deq = run(q, x, -1)
  assert_matches(qt, deq, ref.fp8_delayed(x, history, fmt, margin, algo))


@pytest.mark.parametrize("role", ROLES)
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_mxfp8(role, data):
  x = data.draw(tensors(MX_SHAPES))
  axis = data.draw(st.sampled_from([-1] + [a for a in range(x.ndim)
                                           if x.shape[a] % 32 == 0]))
  qt, deq = run(make_quantizer("mxfp8", role), x, axis)
  assert_matches(qt, deq, ref.mxfp8(x, axis))
  assert qt.scale_inv.dtype == jnp.float8_e8m0fnu and qt.block == (32,)


@pytest.mark.parametrize("role", ("activation", "gradient"))
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_nvfp4_1x16(role, data):
  x = data.draw(tensors(NV_SHAPES))
  axis = data.draw(st.sampled_from([-1] + [a for a in range(x.ndim)
                                           if x.shape[a] % 16 == 0]))
  qt, deq = run(make_quantizer("nvfp4", role), x, axis)  # rng=None: RNE.
  assert_matches(qt, deq, ref.nvfp4(x, axis))
  assert qt.block == (16,) and qt.scale_inv.dtype == jnp.float8_e4m3fn


def test_nvfp4_encode_order_is_the_documented_one():
  """(x * gs) / bs and x * (gs / bs) differ on some ties: pin the documented one."""
  gamax, amax0 = np.float32(777.7), np.float32(13.1)
  gs = ref.scale_from_amax(6 * 448, gamax)
  bs = ref.round_nearest_even((amax0 / np.float32(6)) * gs, "e4m3").astype(np.float32)
  x0 = np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]) * bs / gs
  near = (x0[:, None] + np.arange(-40, 41) * np.spacing(x0)[:, None]).reshape(-1)
  near = near.astype(np.float32)
  ours = ref.round_nearest_even((near * gs) / bs, "e2m1").view(np.uint8)
  other = ref.round_nearest_even(near * (gs / bs), "e2m1").view(np.uint8)
  probes = near[ours != other][:15]
  assert probes.size
  x = np.zeros((2, 16), np.float32)
  x[0, 0], x[1, 0] = amax0, gamax
  x[0, 1:1 + probes.size] = probes
  qt, deq = run(make_quantizer("nvfp4", "activation"), x, -1)
  assert_matches(qt, deq, ref.nvfp4(x))


def _tile_near_a_tie() -> np.ndarray:
  """A weight tile whose second element lies just above an E2M1 midpoint once scaled (hypothesis found it)."""
  x = np.ones((16, 16), np.float32)
  x[0, :2] = 4090.0, 3409.0
  return x


@settings(max_examples=30, deadline=None)
@given(x=tensors(TILE_SHAPES))
@example(x=_tile_near_a_tie())
def test_nvfp4_weight_tiles(x):
  qt, deq = run(make_quantizer("nvfp4", "weight"), x, -1)
  assert_matches(qt, deq, ref.nvfp4(x, tile_2d=True))
  assert qt.block == (16, 16)
  assert qt.scale_inv.shape == x.shape[:-2] + (x.shape[-2] // 16, x.shape[-1] // 16)
  # One quantized weight serves W and W.T: the transpose quantizes identically.
  xt = np.swapaxes(x, -1, -2)
  _, deq_t = run(make_quantizer("nvfp4", "weight"), xt, -1)
  assert_same(np.swapaxes(np.asarray(deq_t), -1, -2), deq)


@settings(max_examples=30, deadline=None)
@given(x=tensors(NV_SHAPES), seed=st.integers(0, 2**31 - 1))
def test_nvfp4_gradient_stochastic(x, seed):
  key = jax.random.key(seed)
  qt, deq = run(make_quantizer("nvfp4", "gradient"), x, -1, key)
  u = np.asarray(jax.random.uniform(key, x.shape, jnp.float32))
  assert_matches(qt, deq, ref.nvfp4(x, -1, u=u))


def test_nvfp4_stochastic_is_unbiased_and_keyed():
  x = jax.random.normal(jax.random.key(0), (4, 32))
  q = make_quantizer("nvfp4", "gradient")
  deq = jax.jit(jax.vmap(lambda k: q.quantize(x, rng=k).dequantize(jnp.float32)))(
      jax.random.split(jax.random.key(1), 4000))
  rne = q.quantize(x).dequantize(jnp.float32)
  # The mean approaches x, far closer than round-to-nearest gets.
  assert float(jnp.abs(deq.mean(0) - x).max()) < 0.2 * float(jnp.abs(rne - x).max())
  assert not jnp.array_equal(deq[0], deq[1])
  again = q.quantize(x, rng=jax.random.split(jax.random.key(1), 4000)[0])
  assert jnp.array_equal(again.dequantize(jnp.float32), deq[0])


# ---- documented edge cases, spelled out -------------------------------------


def test_per_tensor_nonfinite_and_zero():
  """A non-finite tensor dequantizes to NaN everywhere: an Inf alone would have saturated to 448, a finite and
  wrong operand, and the step would have gone on (its loss or gradient norm NaN now: the step is skipped)."""
  for x in ([1.0, jnp.inf, -jnp.inf, jnp.nan], [1.0, jnp.inf, 2.0, 3.0]):
    qt = jquantize(jnp.array(x), "fp8_current", "weight")
    assert jnp.isnan(qt.scale_inv) and not jnp.isfinite(qt.amax)
    assert jnp.all(jnp.isnan(qt.dequantize()))
  zero = jquantize(jnp.zeros((4, 8)), "fp8_current", "gradient")
  assert zero.scale_inv == 1.0 and not jnp.any(zero.dequantize())
  tiny = jquantize(jnp.array([0.0, 1e-38]), "fp8_current", "weight")  # Scale clamps.
  assert jnp.isfinite(tiny.scale_inv) and tiny.dequantize()[0] == 0


@pytest.mark.parametrize("quantizer", [CurrentScaling(E4M3), CurrentScaling(E5M2), "delayed"])
def test_a_per_tensor_scale_inv_is_the_bfloat16_just_above_amax_over_max(quantizer):
  """The GEMM reads scale_inv in bf16: one bf16 cannot hold would be rounded there, a bias on every element."""
  amaxes = np.float32(np.exp(np.random.default_rng(0).uniform(-30, 30, 256)))
  x = jnp.asarray(amaxes)[:, None] * jnp.asarray([1.0, -0.3, 0.7, -1.0])
  if quantizer == "delayed":  # Scaled from the history, with a margin, ahead of this tensor.
    margin, fmt_max = 1, E4M3.max
    qts = jax.vmap(lambda a, v: DelayedScaling(jnp.full((4,), a), margin=margin).quantize(v))(jnp.asarray(amaxes), x)
  else:
    margin, fmt_max = 0, quantizer.fmt.max
    qts = jax.vmap(quantizer.quantize)(x)
  scale_inv = np.asarray(qts.scale_inv)
  np.testing.assert_array_equal(scale_inv, scale_inv.astype(jnp.bfloat16).astype(np.float32))
  wanted = amaxes * np.float32(2.0**margin) / np.float32(fmt_max)
  below = (scale_inv.astype(jnp.bfloat16).view(np.uint16) - 1).view(jnp.bfloat16).astype(np.float32)  # One lower.
  assert np.all(scale_inv >= wanted * (1 - 2.0**-21)) and np.all(below < wanted)  # Three ulps below at most.
  # What arrives quantized at that scale (an MoE exchange) quantizes again at that very scale.
  current = CurrentScaling(E4M3) if quantizer == "delayed" else quantizer
  again = jax.jit(jax.vmap(lambda q: current.quantize(q.dequantize(jnp.float32))))(qts)  # As compiled.
  np.testing.assert_array_equal(again.scale_inv * 2.0**margin, scale_inv)
  # Rounded up, the scaled amax stays within the format: the amax comes back within the cast's rounding.
  deq = np.asarray(jax.vmap(lambda q: q.dequantize(jnp.float32))(qts))
  np.testing.assert_allclose(np.abs(deq).max(axis=1) * 2.0**margin, amaxes * 2.0**margin, rtol=2**-3)
  assert np.all(np.abs(np.asarray(qts.data.astype(jnp.float32))) <= fmt_max / 2**margin)


def test_delayed_scaling_saturates_past_stale_amax():
  q = DelayedScaling(jnp.array([1.0, 0.5]), E4M3)
  qt = q.quantize(jnp.array([0.5, 2.0, -500.0]))
  np.testing.assert_array_equal(qt.data.astype(jnp.float32), [224, 448, -448])
  assert qt.amax == 500.0  # The observed amax, for the next step's history.



def test_the_amax_itself_is_not_counted_saturated():
  """An amax of 1.0775 scales to 448.00003 (max / amax rounds up in float32): the cast loses nothing and no element
  counts as saturated; past a stale delayed scale the elements do."""
  saturated = health.STATS.index("saturated")
  x = jnp.array([1.0775, -0.5, 0.25], jnp.float32)
  assert float(x[0] * (jnp.float32(448.0) / x[0])) > 448.0  # The rounding this is about.
  assert CurrentScaling(E4M3).quantize(x, stats=True).health[saturated] == 0
  stale = DelayedScaling(jnp.array([1.0, 0.5]), E4M3).quantize(jnp.array([0.5, 2.0, -500.0]), stats=True)
  assert stale.health[saturated] == 2

def test_mxfp8_exponents_at_powers_of_two():
  amaxes = np.float32([448, 449, 224, 224.00002, 56, 512, 1, 2.0**-100, 0])
  x = np.zeros((len(amaxes), 32), np.float32)
  x[:, 5] = amaxes
  qt = jquantize(x, "mxfp8", "activation")
  k = np.asarray(qt.scale_inv).view(np.uint8)[:, 0].astype(int) - 127
  np.testing.assert_array_equal(k, [0, 1, -1, 0, -3, 1, -8, -108, -127])
  np.testing.assert_array_less(np.abs(qt.data.astype(jnp.float32)), 448.0001)


def test_mxfp8_nonfinite_block():
  x = np.ones((2, 32), np.float32)
  x[0, 0], x[0, 1], x[1, 0] = np.nan, 3.0, np.inf
  qt = jquantize(x, "mxfp8", "activation")
  assert np.all(np.asarray(qt.scale_inv.astype(jnp.float32)) == 1.0)
  d = np.asarray(qt.data.astype(jnp.float32))
  assert np.isnan(d[0, 0]) and d[0, 1] == 3.0 and d[1, 0] == 448.0


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nvfp4_non_finite_poisons_the_whole_tensor(bad, dtype):
  """A NaN or an Inf makes the tensor amax infinite and the global scale NaN: every element dequantizes to NaN,
  so the GEMM's output and the step's loss or gradient norm are NaN and the step is skipped. Before, an Inf
  saturated to 6 x 448 and a float32 NaN could vanish (a max reduction that skips NaN): finite, wrong steps."""
  x = np.ones((2, 32), np.float32)
  x[0, 3] = bad
  qt = jquantize(x.astype(dtype), "nvfp4", "activation")
  assert np.isinf(qt.amax) and np.isnan(qt.global_scale_inv)
  assert np.all(np.isnan(np.asarray(qt.dequantize(jnp.float32))))


def test_nvfp4_zero_block_and_tiny_block():
  x = np.zeros((1, 48), np.float32)
  x[0, 16:32] = 1e4
  x[0, 32:] = 1e-6  # Block scale underflows E4M3 to 0: data 0, no NaN.
  qt = jquantize(x, "nvfp4", "activation")
  np.testing.assert_array_equal(qt.scale_inv.astype(jnp.float32)[0, [0, 2]], [0, 0])
  deq = np.asarray(qt.dequantize(jnp.float32))
  assert not np.any(deq[0, :16]) and not np.any(deq[0, 32:])
  np.testing.assert_array_equal(deq[0, 16:32], 1e4)


def test_bf16_input_and_dequantize_dtype():
  x = (jax.random.normal(jax.random.key(0), (4, 32)) * 3).astype(jnp.bfloat16)
  for recipe in ("fp8_current", "mxfp8", "nvfp4"):
    qt = jquantize(x, recipe, "activation")
    assert qt.dtype == "bfloat16" and qt.dequantize().dtype == jnp.bfloat16
  qt = jquantize(x, "fp8_current", "activation")
  expected = qt.data.astype(jnp.bfloat16) * qt.scale_inv.astype(jnp.bfloat16)
  assert jnp.array_equal(qt.dequantize(jnp.bfloat16), expected)


def test_errors():
  assert QUANTIZED_RECIPES == ("fp8_delayed", "fp8_current", "mxfp8", "nvfp4")
  assert RECIPES == ("bf16",) + QUANTIZED_RECIPES
  with pytest.raises(ValueError, match="fp8_delayed, fp8_current, mxfp8, nvfp4"):
    quantize(jnp.ones(32), "bf16", "weight")
  with pytest.raises(ValueError, match="DelayedScaling"):
    quantize(jnp.ones(32), "fp8_delayed", "weight")
  with pytest.raises(ValueError, match="role"):
    quantize(jnp.ones(32), "mxfp8", "bias")
  with pytest.raises(ValueError, match="multiple of the block size 32"):
    quantize(jnp.ones((4, 48)), "mxfp8", "activation")
  with pytest.raises(ValueError, match="multiple of the block size 16"):
    quantize(jnp.ones((4, 24)), "nvfp4", "activation", axis=1)
  with pytest.raises(ValueError, match="16x16 tiles"):
    quantize(jnp.ones(32), "nvfp4", "weight")
  with pytest.raises(ValueError, match="compute_algo"):
    DelayedScaling.create(4, compute_algo="mean")


def test_nbytes():
  """Also on abstract values, as a memory report computes it."""
  x = jax.ShapeDtypeStruct((64, 128), jnp.bfloat16)
  nbytes = lambda r, role: jax.eval_shape(lambda v: quantize(v, r, role), x).nbytes
  assert nbytes("fp8_current", "weight") == 64 * 128 + 4 + 4
  assert nbytes("mxfp8", "weight") == 64 * 128 + 64 * 4 + 4
  assert nbytes("nvfp4", "activation") == 64 * 128 // 2 + 64 * 8 + 4
  assert nbytes("nvfp4", "weight") == 64 * 128 // 2 + 4 * 8 + 4
  assert quantize(jnp.ones(32), "nvfp4", "activation").nbytes == 16 + 2 + 4


# ---- delayed scaling state --------------------------------------------------


def test_update_history_rolls():
  h = jnp.array([4.0, 3.0, 2.0, 1.0])
  new = jax.jit(update_history)(h, jnp.float32(9))
  np.testing.assert_array_equal(new, [9, 4, 3, 2])
  np.testing.assert_array_equal(new, ref.update_history(h, 9))
  q = DelayedScaling(h).update(jnp.float32(7))
  np.testing.assert_array_equal(q.amax_history, [7, 4, 3, 2])


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_amax_spike_lasts_history_len_steps(algo):
  hist_len, steps, spike = 4, 12, 3
  amaxes = np.ones(steps, np.float32)
  amaxes[spike] = 100.0
  xs = jnp.asarray(amaxes)[:, None] * jnp.ones((steps, 8))

  def step(q, x):
    qt = q.quantize(x)
    return q.update(qt.amax), qt.scale_inv

  q, scale_inv = jax.lax.scan(step, DelayedScaling.create(hist_len, compute_algo=algo), xs)
  # The amax each step's scale came from (448: empty history, scale 1.0).
  if algo == "max":  # The spike sets the scale for exactly hist_len steps.
    expected = [448] + [1] * spike + [100] * hist_len + [1] * (steps - spike - 1 - hist_len)
  else:  # most_recent: for one step.
    expected = [448] + [1] * spike + [100] + [1] * (steps - spike - 2)
  np.testing.assert_array_equal(scale_inv, [ref.per_tensor_scale_inv(448, a) for a in expected])
  np.testing.assert_array_equal(q.amax_history, amaxes[::-1][:hist_len])


# ---- pytrees, transformations, checkpoints ------------------------------------


def all_quantizers():
  return {
      "current_e4m3": CurrentScaling(E4M3),
      "current_e5m2": CurrentScaling(E5M2),
      "delayed": DelayedScaling(jnp.arange(8, dtype=jnp.float32), E5M2, 1, "most_recent"),
      "mxfp8": MXFP8Scaling(),
      "nvfp4": NVFP4Scaling(tile_2d=True, stochastic_rounding=True),
  }


@functools.cache
@jax.jit
def all_tensors():
  x = jax.random.normal(jax.random.key(3), (32, 64)) * 7
  qts = {f"{r}_{role}": quantize(x, r, role, rng=jax.random.key(4))
         for r in ("fp8_current", "mxfp8", "nvfp4") for role in ROLES}
  qts["fp8_delayed"] = all_quantizers()["delayed"].quantize(x)
  return qts


def assert_trees_same(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert_same(u, v)


def test_pytree_roundtrip_and_static_fields():
  tree = {**all_quantizers(), **all_tensors()}
  leaves, treedef = jax.tree.flatten(tree)
  back = jax.tree.unflatten(treedef, leaves)
  assert_trees_same(back, tree)
  for k, v in tree.items():
    for f in dataclasses.fields(v):
      if f.metadata.get("static"):
        assert getattr(back[k], f.name) == getattr(v, f.name)
  assert jax.tree.leaves(CurrentScaling()) == []  # Pure configuration.
  assert len(jax.tree.leaves(tree["delayed"])) == 1
  for qt in all_tensors().values():  # Same leaves for every recipe.
    assert [l.shape == () for l in jax.tree.leaves(qt)][2:] == [True, True]
  with pytest.raises(dataclasses.FrozenInstanceError):
    tree["mxfp8"].block = 16


def test_jit_vmap_scan():
  tree = {**all_quantizers(), **all_tensors()}
  assert_trees_same(jax.jit(lambda t: t)(tree), tree)
  x = jax.random.normal(jax.random.key(5), (3, 16, 32))
  for q in all_quantizers().values():
    one = jax.jit(lambda v: q.quantize(v, 1).dequantize())

    @jax.jit
    def transformed(xs):
      batched = jax.vmap(one)(xs)
      # Quantized tensors as scan outputs (stacked), then as scan inputs.
      qts = jax.lax.scan(lambda c, v: (c, q.quantize(v, 1)), 0, xs)[1]
      return batched, qts, jax.lax.scan(lambda c, t: (c, t.dequantize()), 0, qts)[1]

    batched, qts, deq = transformed(x)
    assert qts.data.shape == x.shape and qts.axis == 1
    assert_same(deq, batched)
    for i in range(3):
      assert_same(batched[i], one(x[i]))


def test_orbax_roundtrip(tmp_path):
  tree = {**all_quantizers(), **all_tensors()}
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(tmp_path / "ckpt", tree)
  ckptr.wait_until_finished()
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
  restored = ckptr.restore(tmp_path / "ckpt", abstract)
  assert_trees_same(restored, tree)  # float4, e8m0 and fp8 leaves, bit for bit.
  for k in tree:
    assert type(restored[k]) is type(tree[k])
    if isinstance(tree[k], QuantizedTensor):
      assert_same(restored[k].dequantize(jnp.float32), tree[k].dequantize(jnp.float32))


# ---- where amaxes are reduced --------------------------------------------------


@pytest.mark.parametrize("recipe", ["fp8_current", "nvfp4"])
@pytest.mark.variants
def test_reduce_axes_in_shard_map_matches_global(recipe):
  mesh = jax.make_mesh((8,), ("d",))
  x = jax.random.normal(jax.random.key(6), (64, 32)).at[5, 7].set(40.0)
  q = make_quantizer(recipe, "activation")

  def local(x_shard):
    qt = q.quantize(x_shard, reduce_axes=("d",))
    return qt.data, qt.scale_inv, qt.global_scale_inv, qt.amax

  scale_spec = P() if recipe == "fp8_current" else P("d")
  xs = jax.device_put(x, NamedSharding(mesh, P("d")))
  out = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("d"),
                              out_specs=(P("d"), scale_spec, P(), P())))(xs)
  full = q.quantize(x)
  for got, f in zip(out, FIELDS):
    assert_same(got, getattr(full, f))
  # Without reduce_axes each shard would use its own amax: a real difference.
  assert not np.array_equal(np.asarray(q.quantize(x[8:16]).amax), np.asarray(full.amax))


def test_plain_jit_on_sharded_input_is_global():
  mesh = jax.make_mesh((8,), ("d",))
  x = jax.random.normal(jax.random.key(7), (64, 32)).at[3, 1].set(-50.0)
  xs = jax.device_put(x, NamedSharding(mesh, P("d")))
  for recipe in ("fp8_current", "mxfp8", "nvfp4"):
    f = jax.jit(lambda v: quantize(v, recipe, "activation"))
    assert_trees_same(f(xs), f(x))
