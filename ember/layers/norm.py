"""RMSNorm, computed in float32 whatever the activation dtype."""

import jax
import jax.numpy as jnp
from flax import nnx

from ember.names import NORM


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, *, eps: float, dtype, param_dtype):
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype), out_sharding=(NORM,))
    self.eps, self.dtype = eps, dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...].astype(jnp.float32)).astype(self.dtype)
