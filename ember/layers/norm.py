"""RMSNorm, computed in float32 whatever the activation dtype."""

import jax
import jax.numpy as jnp
from flax import nnx

from ember.layers import norm_kernel
from ember.names import NORM


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, *, eps: float, dtype, param_dtype):
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype), out_sharding=(NORM,))
    self.eps, self.dtype = eps, dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    return norm_kernel.reference(x, self.scale[...], self.eps, self.dtype)

  def residual(self, x: jax.Array, *, into_quantizer: bool) -> tuple[jax.Array, jax.Array]:
    """(x, the norm of x) for the residual stream, whose later reads' gradient then joins the norm's: in one
    kernel each way where layers/norm_kernel.py's kernels run, else `__call__`. `into_quantizer`: XLA's quantizer
    kernels read the norm (a per-tensor recipe's), and its forward pass is then XLA's, fused into them."""
    if norm_kernel.runs(x):
      return norm_kernel.rms_norm_rows(x, self.scale[...], self.eps, jnp.dtype(self.dtype), not into_quantizer)
    return x, self(x)
