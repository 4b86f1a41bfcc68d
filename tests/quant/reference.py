"""A NumPy + ml_dtypes reference of ember.quant's semantics, written apart from it.

It imports nothing from ember. Rounding is done by searching the table of a
format's representable values (decoded by ml_dtypes), not by a cast, so the
tests check XLA's converts too. Scale arithmetic is float32, in the order the
recipes document; block layouts are built with moveaxis/reshape, a different
route from the JAX code's in-place split.
"""

import ml_dtypes
import numpy as np

F32 = np.float32
DTYPES = {
    "e4m3": ml_dtypes.float8_e4m3fn,
    "e5m2": ml_dtypes.float8_e5m2,
    "e2m1": ml_dtypes.float4_e2m1fn,
    "e8m0": ml_dtypes.float8_e8m0fnu,
}
MAX = {"e4m3": 448.0, "e5m2": 57344.0, "e2m1": 6.0}
HAS_NAN = {"e4m3": True, "e5m2": True, "e2m1": False}
# Number of non-negative finite codes, in increasing order of value.
_CODES = {"e4m3": 0x7F, "e5m2": 0x7C, "e2m1": 8}


def grid(fmt: str) -> np.ndarray:
  """Non-negative finite values of `fmt`, indexed by their code (float64)."""
  if fmt == "e2m1":
    return np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)
  codes = np.arange(_CODES[fmt], dtype=np.uint8)
  return codes.view(DTYPES[fmt]).astype(np.float64)


def _finish(x, mag, fmt):
  """Sign, NaN policy (E2M1: NaN -> +0), then the exact cast to storage."""
  out = np.copysign(mag, x).astype(F32)
  out = np.where(np.isnan(x), np.nan if HAS_NAN[fmt] else 0.0, out).astype(F32)
  return out.astype(DTYPES[fmt])


def round_nearest_even(x, fmt: str) -> np.ndarray:
  """Nearest representable value, ties to the even code, saturating at max."""
  x = np.asarray(x, F32)
  g = grid(fmt)
  with np.errstate(invalid="ignore"):
    a = np.minimum(np.abs(x).astype(np.float64), MAX[fmt])
    a = np.where(np.isnan(a), 0.0, a)
  i = np.clip(np.searchsorted(g, a, side="left"), 1, len(g) - 1)
  lo, hi = g[i - 1], g[i]
  d_lo, d_hi = a - lo, hi - a
  pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (i % 2 == 0))
  return _finish(x, np.where(pick_hi, hi, lo), fmt)


def stochastic_round(x, fmt: str, u) -> np.ndarray:
  """Rounds |x| up to the next value iff u < (|x| - lo) / (hi - lo)."""
  x = np.asarray(x, F32)
  g = grid(fmt).astype(F32)
  with np.errstate(invalid="ignore"):
    a = np.minimum(np.abs(x), F32(MAX[fmt]))
    a = np.where(np.isnan(a), F32(0), a)
  i = np.searchsorted(g, a, side="right") - 1
  lo, hi = g[i], g[np.minimum(i + 1, len(g) - 1)]
  with np.errstate(invalid="ignore", divide="ignore"):
    p = np.where(hi > lo, (a - lo) / (hi - lo), F32(0)).astype(F32)
  return _finish(x, np.where(np.asarray(u, F32) < p, hi, lo), fmt)


def scale_from_amax(numerator, amax) -> np.float32:
  amax = F32(amax)
  if not np.isfinite(amax):
    return F32(np.nan)
  if not amax > 0:
    return F32(1)
  with np.errstate(over="ignore"):
    s = F32(numerator) / amax
  return F32(min(s, np.finfo(F32).max))


def per_tensor_scale_inv(fmt_max, amax, margin=0) -> np.float32:
  """amax * 2**margin * (1 / fmt_max) in float32, then the next bfloat16 at or above it (rounding away from zero),
  except that up to 3 ulps above a bfloat16 round down to it; at least 2**-126."""
  amax = F32(amax)
  if not np.isfinite(amax):
    return F32(np.nan)  # A non-finite tensor's scale: its GEMM's output is NaN, and the step is skipped.
  if not amax > 0:
    return F32(1)
  inv = F32(F32(amax * F32(2.0**margin)) * F32(1.0 / fmt_max))
  bits = int(np.array(inv, F32).view(np.uint32))
  if bits & 0xFFFF > 3:
    bits += 0x10000
  bits &= ~0xFFFF
  return max(np.array(bits, np.uint32).view(F32)[()], F32(2.0**-126))


def _magnitude(x):
  """|x| with a NaN as +Inf (ember's `formats.magnitude`): what every amax is the max of."""
  return np.where(np.isnan(x), np.inf, np.abs(x)).astype(np.asarray(x).dtype)


def _amax(x) -> np.float32:
  return F32(np.max(_magnitude(x)))


def per_tensor(x, fmt: str, scale_inv, amax) -> dict:
  x = np.asarray(x, F32)
  data = round_nearest_even(x * (F32(1) / scale_inv), fmt)
  return dict(data=data, scale_inv=scale_inv, global_scale_inv=F32(1),
              amax=F32(amax), deq=data.astype(F32) * scale_inv)


def fp8_current(x, fmt: str) -> dict:
  amax = _amax(x)
  return per_tensor(x, fmt, per_tensor_scale_inv(MAX[fmt], amax), amax)


def fp8_delayed(x, history, fmt: str, margin=0, algo="max") -> dict:
  history = np.asarray(history, F32)
  ref = np.max(history) if algo == "max" else history[0]
  return per_tensor(x, fmt, per_tensor_scale_inv(MAX[fmt], ref, margin), _amax(x))


def update_history(history, amax) -> np.ndarray:
  history = np.asarray(history, F32)
  return np.concatenate([np.array([amax], F32), history[:-1]])


def _blocks(x, axis, b):
  """x -> (..., n // b, b) with `axis` moved last, and the inverse."""
  xm = np.moveaxis(x, axis, -1)
  shape = xm.shape
  xb = xm.reshape(shape[:-1] + (shape[-1] // b, b))
  return xb, lambda y: np.moveaxis(y.reshape(shape), -1, axis)


def _ceil_log2_ratio(amax, denom):
  """Smallest integer k with amax <= denom * 2**k, exactly (float64 checks)."""
  a = amax.astype(np.float64)
  with np.errstate(divide="ignore", invalid="ignore"):
    k = np.ceil(np.log2(a / denom))
  k = np.where(np.isfinite(k), k, 0.0)
  k = k + (a > denom * 2.0**k)  # Undo any one-off error of log2.
  k = k - (a <= denom * 2.0**(k - 1))
  return k


def mxfp8(x, axis=-1) -> dict:
  x = np.asarray(x, F32)
  xb, unblock = _blocks(x, axis, 32)
  bamax = np.max(_magnitude(xb), axis=-1)
  k = _ceil_log2_ratio(bamax, 448.0)
  k = np.where(bamax == 0, -127, np.clip(k, -127, 127))
  k = np.where(np.isfinite(bamax), k, 0)
  scale = (2.0**k).astype(F32)  # Exact, 2**-127 included (a float32 subnormal).
  data = round_nearest_even(xb / scale[..., None], "e4m3")
  deq = data.astype(F32) * scale[..., None]
  scale_inv = np.moveaxis(scale.astype(DTYPES["e8m0"]), -1, axis)
  return dict(data=unblock(data), scale_inv=scale_inv,
              global_scale_inv=F32(1), amax=F32(np.max(bamax)),
              deq=unblock(deq))


def nvfp4(x, axis=-1, tile_2d=False, u=None) -> dict:
  """NVFP4 in the documented order; `u` (same shape as x) selects SR."""
  x = np.asarray(x, F32)
  amax = _amax(x)
  gs = scale_from_amax(F32(6 * 448), amax)
  if tile_2d:
    r, c = x.shape[-2:]
    lead = x.shape[:-2]
    xb = x.reshape(lead + (r // 16, 16, c // 16, 16))
    bamax = np.max(_magnitude(xb), axis=(-3, -1))
    expand = lambda s: s[..., :, None, :, None]
    unblock = lambda y: y.reshape(x.shape)
  else:
    xb, unblock = _blocks(x, axis, 16)
    bamax = np.max(_magnitude(xb), axis=-1)
    expand = lambda s: s[..., None]
  bscale = round_nearest_even((bamax / F32(6)) * gs, "e4m3")
  bs = expand(bscale.astype(F32))
  with np.errstate(divide="ignore", invalid="ignore"):
    y = np.where(bs == 0, F32(0), (xb * gs) / bs).astype(F32)
  if u is None:
    data = round_nearest_even(y, "e2m1")
  else:
    ub = np.asarray(u, F32).reshape(xb.shape) if tile_2d else _blocks(
        np.asarray(u, F32), axis, 16)[0]
    data = stochastic_round(y, "e2m1", ub)
  gsi = F32(1) / gs
  deq = (data.astype(F32) * bs) * gsi
  if not tile_2d:
    bscale = np.moveaxis(bscale, -1, axis)
  return dict(data=unblock(data), scale_inv=bscale, global_scale_inv=gsi,
              amax=amax, deq=unblock(deq))
