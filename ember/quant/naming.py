"""Naming quantized residuals for remat policies: `checkpoint_name` on a QuantizedTensor.

Low-precision leaves cross the name boundary as their bit patterns (uint8, or uint4 for E2M1),
then are viewed back. Why: when a remat policy saves a floating-point residual, JAX inserts
`reduce_precision(exponent_bits, mantissa_bits)` of that dtype on it, and XLA's reduce_precision
assumes an IEEE-style format with infinities. float8_e4m3fn has none (its top exponent holds
256..448), so every saved E4M3 value >= 256 came back as NaN. Integers are left alone, and a
bitcast costs nothing. The names and byte counts are unchanged.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from ember.quant.tensor import QuantizedTensor

_BITS_DTYPE = {
    jnp.dtype(jnp.float8_e4m3fn): jnp.uint8,
    jnp.dtype(jnp.float8_e5m2): jnp.uint8,
    jnp.dtype(jnp.float8_e8m0fnu): jnp.uint8,
    jnp.dtype(jnp.float4_e2m1fn): jnp.uint4,
}


def _through_bits(a: jax.Array, name: str) -> jax.Array:
  bits = _BITS_DTYPE.get(jnp.dtype(a.dtype))
  if bits is None:
    return checkpoint_name(a, name)
  named = checkpoint_name(jax.lax.bitcast_convert_type(a, bits), name)
  return jax.lax.bitcast_convert_type(named, a.dtype)


def name_quantized(q: QuantizedTensor, name: str) -> QuantizedTensor:
  """`q` with every array leaf tagged `name` (low-precision leaves as their bit patterns)."""
  return dataclasses.replace(q, **{f.name: _through_bits(getattr(q, f.name), name)
                                   for f in dataclasses.fields(q)
                                   if not f.metadata.get("static") and getattr(q, f.name) is not None})
