"""Low-precision number formats and the two casts every recipe is built from.

A cast here always
  * computes in float32 (bfloat16 inputs are widened first, exactly),
  * rounds to nearest, ties to even (or stochastically, see `stochastic_cast`),
  * saturates: |x| > max becomes +-max, and +-Inf becomes +-max. A bare
    `astype(float8_e4m3fn)` would turn 500 into NaN, which is never what a
    training step wants,
  * keeps NaN as NaN in formats that have one (E4M3, E5M2). E2M1 has no NaN:
    a NaN becomes +0. NVFP4 does not lose the NaN, it carries it in the E4M3
    block scale instead (see `quantizers.NVFP4Scaling`).

Float32 subnormal *inputs* are outside the contract: XLA's CPU backend flushes
them to zero in some ops and not in others, so results on them are
backend-defined. Every scale the recipes compute keeps intermediates normal.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Format:
  """A floating-point storage format.

  Attributes:
    name: short name ("e4m3", ...).
    dtype: the JAX/NumPy dtype that stores it.
    max: the largest finite value; casts saturate here.
    mant_bits: explicit mantissa bits.
    min_exp: exponent of the smallest normal binade (subnormals share its step).
    bits: storage bits per element (4 for E2M1; XLA keeps one per byte in
      memory, but the format, a checkpoint of packed data and a GEMM use 4).
    has_nan: whether the format can hold a NaN.
  """

  name: str
  dtype: np.dtype
  max: float
  mant_bits: int
  min_exp: int
  bits: int
  has_nan: bool

  def __repr__(self):
    return self.name.upper()

  @property
  def hlo_name(self) -> str:
    """HLO's spelling of the element type (`f8e4m3fn`, `f4e2m1fn`): see `hlo_type`."""
    return hlo_type(self.dtype)


def hlo_type(dtype) -> str:
  """HLO's spelling of a float dtype: its NumPy name with `float` shortened to `f` and no underscores
  (bfloat16 -> bf16, float8_e4m3fn -> f8e4m3fn)."""
  return jnp.dtype(dtype).name.replace("float", "f").replace("_", "")


E4M3 = Format("e4m3", jnp.dtype(jnp.float8_e4m3fn), 448.0, 3, -6, 8, True)
E5M2 = Format("e5m2", jnp.dtype(jnp.float8_e5m2), 57344.0, 2, -14, 8, True)
E2M1 = Format("e2m1", jnp.dtype(jnp.float4_e2m1fn), 6.0, 1, 0, 4, False)
# Scale-only format (MX block scales): 2**k for k in [-127, 127], plus NaN.
E8M0 = Format("e8m0", jnp.dtype(jnp.float8_e8m0fnu), 2.0**127, 0, -127, 8, True)

FORMATS = {f.name: f for f in (E4M3, E5M2, E2M1, E8M0)}


def get_format(fmt: "Format | str") -> Format:
  """Accepts a Format or its name, so configs can say "e5m2"."""
  if isinstance(fmt, Format):
    return fmt
  try:
    return FORMATS[str(fmt).lower()]
  except KeyError:
    raise ValueError(f"unknown format {fmt!r}; valid: {sorted(FORMATS)}") from None


def cast(x: jax.Array, fmt: "Format | str") -> jax.Array:
  """Round-to-nearest-even, saturating cast of `x` to `fmt` (see module doc)."""
  fmt = get_format(fmt)
  y = jnp.clip(x.astype(jnp.float32), -fmt.max, fmt.max)  # NaN passes through.
  if not fmt.has_nan:
    y = jnp.where(jnp.isnan(y), 0.0, y)
  return y.astype(fmt.dtype)


def cast_toward_zero(x: jax.Array, dtype) -> jax.Array:
  """float32 `x` in the float `dtype` (float32, bfloat16, float16), rounded toward zero as IEEE's mode does: never
  larger in magnitude than `x` (a finite value past dtype's max gives its max); NaN and Inf stay. In bits and
  exact float32 steps, as `kernels.round_like`: a compiler that allows excess precision (XLA's default on GPUs)
  drops a narrowing round trip, so a check of the cast against `x` would always pass there. The float32 mantissa
  bits dtype lacks are cleared (bfloat16's subnormals are float32's, cleared alike); below float16's normal range,
  where its steps are 2**-24 apart, x is truncated to a multiple of that step. Either is exact in dtype, and so is
  the cast after it."""
  x = x.astype(jnp.float32)
  info = jnp.finfo(dtype)
  if info.nmant >= 23:
    return x.astype(dtype)
  low = jnp.uint32((1 << (23 - info.nmant)) - 1)
  y = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(x, jnp.uint32) & ~low, jnp.float32)
  if info.minexp > jnp.finfo(jnp.float32).minexp:  # float16: subnormal where float32 is not.
    step = float(info.smallest_subnormal)  # A power of two: x / step and its product with step are exact.
    y = jnp.where(jnp.abs(x) < float(info.smallest_normal), jnp.trunc(x / step) * step, y)
  y = jnp.clip(y, -float(info.max), float(info.max))
  return jnp.where(jnp.isfinite(x), y, x).astype(dtype)


def pow2(k: jax.Array) -> jax.Array:
  """Exactly 2**k as float32 for integer k in [-126, 127], built from bits.

  `ldexp`/`exp2` are avoided: the former flushes on CPU, the latter is an
  approximation on some backends.
  """
  biased = (k.astype(jnp.int32) + 127) << 23
  return jax.lax.bitcast_convert_type(biased, jnp.float32)


def e8m0_from_exponent(k: jax.Array) -> jax.Array:
  """2**k stored as E8M0 (one byte, biased exponent), k in [-127, 127]."""
  return jax.lax.bitcast_convert_type(
      (k.astype(jnp.int32) + 127).astype(jnp.uint8), jnp.float8_e8m0fnu)


def stochastic_cast(x: jax.Array, fmt: "Format | str",
                    key: jax.Array) -> jax.Array:
  """Unbiased stochastic rounding of `x` to `fmt`, saturating at +-max.

  With lo <= |x| < hi the two neighbouring representable magnitudes,
  |x| rounds up to hi with probability (|x| - lo) / (hi - lo), so the
  expectation is |x| for every |x| <= max. Concretely, in float32:

    u    = jax.random.uniform(key, x.shape, float32)    # one draw per element
    a    = min(|x|, max)
    ulp  = 2**(max(floor(log2 a), min_exp) - mant_bits)  # exact, from frexp
    lo   = floor(a / ulp) * ulp                          # all exact
    a'   = lo + ulp  if u < (a - lo) / ulp  else lo
    out  = cast(copysign(a', x), fmt)                    # exact cast

  Deterministic for a key. NaN follows `cast`'s policy.
  """
  fmt = get_format(fmt)
  x32 = x.astype(jnp.float32)
  u = jax.random.uniform(key, x32.shape, jnp.float32)
  a = jnp.minimum(jnp.abs(x32), fmt.max)
  _, e = jnp.frexp(a)  # a = m * 2**e, m in [0.5, 1): floor(log2 a) = e - 1.
  ulp = pow2(jnp.maximum(e - 1, fmt.min_exp) - fmt.mant_bits)
  lo = jnp.floor(a / ulp) * ulp
  up = u < (a - lo) / ulp
  rounded = jnp.minimum(jnp.where(up, lo + ulp, lo), fmt.max)
  return cast(jnp.copysign(rounded, x32), fmt)


def magnitude(x: jax.Array) -> jax.Array:
  """|x| with a NaN as +Inf: what every amax (a tensor's, a block's) is the max of, in x's dtype. A max reduction
  may skip NaN (XLA's vectorised CPU one does, Pallas lowers max to a NaN-ignoring op on GPUs); as an Inf, a NaN
  makes its amax non-finite on every platform, and the scale policy (ember/quant/quantizers.py) takes it from
  there."""
  return jnp.where(jnp.isnan(x), jnp.asarray(jnp.inf, x.dtype), jnp.abs(x))
