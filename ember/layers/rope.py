"""Rotary position embeddings (Llama's half-split layout), from per-token positions.

Positions restart at 0 in every packed segment, so each document sees the same rotations it
would see alone.

Frequencies: theta ** (-2i / H), and with Llama 3.1's scaling (Hugging Face's rope_type "llama3",
`model.rope_scaling_factor` > 0) those whose wavelength exceeds original_len / low_freq_factor are
divided by the factor, those below original_len / high_freq_factor kept, and the ones between mixed:
(1 - s) f / factor + s f with s = (original_len / wavelength - low_freq_factor) / (high_freq_factor -
low_freq_factor). That is transformers' `_compute_llama3_parameters`, whose attention factor is 1.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Rope:
  """A RoPE's frequencies: its base, and Llama 3.1's scaling (`scaling_factor` 0: none)."""
  theta: float
  scaling_factor: float = 0.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_len: int = 8192

  @classmethod
  def of(cls, model) -> "Rope":
    """The model config's RoPE (`model.rope_*`)."""
    return cls(model.rope_theta, model.rope_scaling_factor, model.rope_low_freq_factor, model.rope_high_freq_factor,
               model.rope_original_seq_len)

  def frequencies(self, h: int) -> jax.Array:
    """[h / 2] float32 angular frequencies of a head of `h` dims."""
    freq = self.theta ** (-jnp.arange(0, h, 2, dtype=jnp.float32) / h)
    if not self.scaling_factor:
      return freq
    wavelength = 2 * math.pi / freq
    low, high, factor = self.low_freq_factor, self.high_freq_factor, self.scaling_factor
    scaled = jnp.where(wavelength > self.original_len / low, freq / factor, freq)
    mix = (self.original_len / wavelength - low) / (high - low)
    smoothed = (1 - mix) * scaled / factor + mix * scaled
    medium = (wavelength >= self.original_len / high) & (wavelength <= self.original_len / low)
    return jnp.where(medium, smoothed, scaled)


def apply_rope(x_BxLxNxH: jax.Array, positions_BxL: jax.Array, rope: Rope) -> jax.Array:
  """`x` rotated by its tokens' positions."""
  h = x_BxLxNxH.shape[-1]
  angle_BxLx1xH2 = positions_BxL.astype(jnp.float32)[:, :, None, None] * rope.frequencies(h)
  sin, cos = jnp.sin(angle_BxLx1xH2), jnp.cos(angle_BxLx1xH2)
  x1, x2 = jnp.split(x_BxLxNxH.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxLxNxH.dtype)
