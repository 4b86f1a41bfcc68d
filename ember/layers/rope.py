"""Rotary position embeddings (Llama's half-split layout), from per-token positions.

Positions restart at 0 in every packed segment, so each document sees the same rotations it
would see alone.
"""

import jax
import jax.numpy as jnp


def apply_rope(x_BxLxNxH: jax.Array, positions_BxL: jax.Array, theta: float) -> jax.Array:
  h = x_BxLxNxH.shape[-1]
  freq_H2 = theta ** (-jnp.arange(0, h, 2, dtype=jnp.float32) / h)
  angle_BxLx1xH2 = positions_BxL.astype(jnp.float32)[:, :, None, None] * freq_H2
  sin, cos = jnp.sin(angle_BxLx1xH2), jnp.cos(angle_BxLx1xH2)
  x1, x2 = jnp.split(x_BxLxNxH.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxLxNxH.dtype)
