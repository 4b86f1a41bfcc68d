"""Casts to E4M3 / E5M2 / E2M1: round-to-nearest-even and stochastic rounding."""

import functools

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import reference as ref
from tests.xla_cpu import EXACT_FP4_CASTS
from ember.quant import E2M1, E4M3, E5M2, E8M0, cast, get_format, stochastic_cast
from ember.quant.formats import cast_toward_zero

FMTS = ("e4m3", "e5m2", "e2m1")


def assert_same(actual, expected):
  """Bitwise equality of low-precision arrays; any NaN matches any NaN."""
  a, e = np.asarray(actual), np.asarray(expected)
  assert a.dtype == e.dtype and a.shape == e.shape
  a_nan, e_nan = np.isnan(a.astype(np.float32)), np.isnan(e.astype(np.float32))
  np.testing.assert_array_equal(a_nan, e_nan)
  np.testing.assert_array_equal(a.view(np.uint8)[~e_nan], e.view(np.uint8)[~e_nan])


def edge_values(fmt):
  """Every representable value, every midpoint and its float32 neighbours."""
  g = ref.grid(fmt).astype(np.float32)
  mid = ((g[:-1].astype(np.float64) + g[1:]) / 2).astype(np.float32)
  near = np.concatenate([np.nextafter(mid, np.float32(-np.inf)),
                         np.nextafter(mid, np.float32(np.inf))])
  top = g[-1]
  past = np.array([top * 1.01, top * 2, top + (top - g[-2]) / 2, 1e30, 3e38],
                  np.float32)
  special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-30], np.float32)
  v = np.concatenate([g, mid, near, past])
  return np.concatenate([v, -v, special])


@jax.jit
def _cast_all(x):
  return tuple(cast(x, f) for f in FMTS)


def test_format_constants():
  assert (E4M3.max, E5M2.max, E2M1.max) == (448.0, 57344.0, 6.0)
  for f in (E4M3, E5M2, E2M1):
    assert f.max == float(ml_dtypes.finfo(f.dtype).max)
    assert f.mant_bits == ml_dtypes.finfo(f.dtype).nmant
    assert f.min_exp == ml_dtypes.finfo(f.dtype).minexp
  np.testing.assert_array_equal(ref.grid("e2m1"), [0, .5, 1, 1.5, 2, 3, 4, 6])
  assert (E2M1.bits, E4M3.bits, E8M0.bits) == (4, 8, 8)
  assert get_format("E5M2") is E5M2
  with pytest.raises(ValueError, match="e4m3"):
    get_format("int8")


@pytest.mark.parametrize("fmt", FMTS)
def test_cast_edges_match_reference(fmt):
  x = edge_values(fmt)
  assert_same(jax.jit(functools.partial(cast, fmt=fmt), compiler_options=EXACT_FP4_CASTS)(x),
              ref.round_nearest_even(x, fmt))


@pytest.mark.parametrize("fmt", ("e4m3", "e5m2"))
def test_reference_agrees_with_ml_dtypes(fmt):
  """The table search and ml_dtypes' own cast agree where both are defined."""
  x = edge_values(fmt)
  x = x[np.isfinite(x) & (np.abs(x) <= ref.MAX[fmt])]
  assert_same(ref.round_nearest_even(x, fmt), x.astype(ref.DTYPES[fmt]))


def test_saturation_and_nan_policy():
  x = jnp.array([500.0, -1e9, jnp.inf, -jnp.inf, jnp.nan, -0.0])
  np.testing.assert_array_equal(
      cast(x, E4M3).astype(jnp.float32)[:4], [448, -448, 448, -448])
  assert jnp.isnan(cast(x, E4M3)[4]) and jnp.isnan(cast(x, E5M2)[4])
  e2m1 = np.asarray(cast(x, E2M1))
  np.testing.assert_array_equal(e2m1.astype(np.float32), [6, -6, 6, -6, 0, 0])
  assert e2m1.view(np.uint8)[4] == 0  # NaN -> +0 ...
  assert e2m1.view(np.uint8)[5] == 8  # ... while -0 keeps its sign.


def test_format_subnormals():
  """Values in the formats' subnormal ranges round on their fixed step."""
  x = np.array([2.0**-9, 1.5 * 2.0**-9, 2.0**-10, 3 * 2.0**-8, 0.25], np.float32)
  np.testing.assert_array_equal(
      np.asarray(cast(x, E4M3)).astype(np.float32),
      [2.0**-9, 2.0**-8, 0.0, 3 * 2.0**-8, 0.25])
  np.testing.assert_array_equal(
      np.asarray(cast(np.float32([0.25, 0.26, 0.75]), E2M1)).astype(np.float32),
      [0.0, 0.5, 1.0])  # 0.25 ties to even (0); 0.75 ties to even (1.0).


def test_bfloat16_input():
  x = edge_values("e4m3").astype(jnp.bfloat16)
  assert_same(cast(jnp.asarray(x), "e4m3"),
              ref.round_nearest_even(x.astype(np.float32), "e4m3"))


finite32 = st.floats(-1e6, 1e6, width=32, allow_subnormal=False)


@settings(max_examples=40, deadline=None)
@given(x=hnp.arrays(np.float32, (64,), elements=finite32 | st.sampled_from(
    [np.nan, np.inf, -np.inf, 448.0, 464.0, 6.0, 5.0])))
def test_cast_property(x):
  for fmt, out in zip(FMTS, _cast_all(x)):
    assert_same(out, ref.round_nearest_even(x, fmt))


@functools.partial(jax.jit, static_argnames="fmt")
def _sr(x, key, fmt):
  return stochastic_cast(x, fmt, key), jax.random.uniform(key, x.shape)


@settings(max_examples=30, deadline=None)
@given(x=hnp.arrays(np.float32, (64,), elements=finite32 | st.sampled_from(
    [np.nan, np.inf, -np.inf, 0.0, 2.5, 0.25])),
       seed=st.integers(0, 2**31 - 1), fmt=st.sampled_from(FMTS))
def test_stochastic_matches_reference(x, seed, fmt):
  scale = np.float32(ref.MAX[fmt] / 448.0)  # Keep a good share in range.
  x = (x * scale).astype(np.float32)
  out, u = _sr(x, jax.random.key(seed), fmt)
  assert_same(out, ref.stochastic_round(x, fmt, np.asarray(u)))


@pytest.mark.parametrize("fmt", FMTS)
def test_stochastic_is_unbiased(fmt):
  top = ref.MAX[fmt]
  x = np.array([0.3, -0.3, 0.01, 1.1, -2.6, 0.77 * top, -0.98 * top,
                ref.grid(fmt)[1] / 3], np.float32)
  n = 20000
  draws = _sr(jnp.broadcast_to(x, (n, x.size)), jax.random.key(0), fmt)[0]
  draws = np.asarray(draws).astype(np.float32)
  g = ref.grid(fmt)
  i = np.searchsorted(g, np.abs(x), side="right") - 1
  gap = (g[i + 1] - g[i]).astype(np.float32)
  # Each draw is lo or hi: the mean's std is at most gap / (2 sqrt(n)).
  np.testing.assert_array_less(np.abs(np.mean(draws, 0) - x), 5 * gap / (2 * np.sqrt(n)))
  lo_hi = np.stack([np.copysign(g[i], x), np.copysign(g[i + 1], x)])
  assert np.all((draws == lo_hi[0]) | (draws == lo_hi[1]))


def test_stochastic_keys_and_fixed_points():
  x = jnp.linspace(-5.9, 5.9, 512)
  a, b, c = (_sr(x, jax.random.key(k), "e2m1")[0] for k in (1, 1, 2))
  assert_same(a, b)
  assert np.any(np.asarray(a.astype(jnp.float32)) != np.asarray(c.astype(jnp.float32)))
  for fmt in FMTS:  # Representable values never move; overflow saturates.
    g = np.concatenate([ref.grid(fmt), -ref.grid(fmt)]).astype(np.float32)
    big = np.float32([ref.MAX[fmt] * 1.2, -np.inf, 1e30])
    x = np.concatenate([g, big])
    for seed in range(3):
      out = np.asarray(_sr(x, jax.random.key(seed), fmt)[0]).astype(np.float32)
      np.testing.assert_array_equal(out[:g.size], g)
      np.testing.assert_array_equal(out[g.size:], np.float32([1, -1, 1]) * ref.MAX[fmt])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_cast_toward_zero_gives_the_grid_value_at_or_inside_x(dtype):
  """ml_dtypes' grid: the result is a `dtype` value no larger in magnitude than x, and the next one out is larger
  (past dtype's max: its max); subnormals, NaN and Inf included. Under jit, as a compiled MoE exchange runs it."""
  rng = np.random.default_rng(0)
  x = (rng.standard_normal(50_000) * np.exp(rng.uniform(-30, 14, 50_000))).astype(np.float32)
  x = np.concatenate([x, np.float32([0.0, -0.0, 1.0, 7e4, -7e4, 1e-6, 3e-41, np.nan, np.inf, -np.inf])])
  y = np.asarray(jax.jit(lambda v: cast_toward_zero(v, dtype))(jnp.asarray(x)))
  assert y.dtype == np.dtype(dtype)
  ours = y.astype(np.float32)
  finite = np.isfinite(x)
  np.testing.assert_array_equal(np.isnan(ours), np.isnan(x))
  np.testing.assert_array_equal(ours[np.isinf(x)], x[np.isinf(x)])
  assert np.all(np.abs(ours[finite]) <= np.abs(x[finite])) and np.all(np.sign(ours[finite]) * np.sign(x[finite]) >= 0)
  out = np.nextafter(y[finite], np.copysign(np.inf, x[finite]).astype(dtype)).astype(np.float32)
  top = np.abs(ours[finite]) == float(ml_dtypes.finfo(dtype).max)
  assert np.all((np.abs(out) > np.abs(x[finite])) | top)
