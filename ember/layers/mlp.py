"""SwiGLU MLP: gate and up projections fused into one kernel [embed, 2, mlp], then down."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from ember import remat
from ember.layers.linear import Linear
from ember.parallel.sharding import shard


class MLP(nnx.Module):
  def __init__(self, cfg, d_ff: int, *, path: str, recipe, rngs: nnx.Rngs, names=("wi", "wo")):
    m = cfg.model
    dtype, param_dtype = jnp.dtype(m.dtype), jnp.dtype(m.param_dtype)
    out_std = m.init_std / (2 * m.num_layers) ** 0.5
    wi, wo = names
    self.wi = Linear((m.d_model,), (2, d_ff), ("embed", "gate", "mlp"), name=wi, path=f"{path}.{wi}",
                     recipe=recipe, init_std=m.init_std, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.wo = Linear((d_ff,), (m.d_model,), ("mlp", "embed"), name=wo, path=f"{path}.{wo}", recipe=recipe,
                     init_std=out_std, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def __call__(self, x_BxLxD, key=None):
    h = self.wi(x_BxLxD, key)  # [B, L, 2, F]
    gate_BxLxF = checkpoint_name(shard(h[:, :, 0], ("batch", "length", "mlp")), remat.MLP_WI_0)
    up_BxLxF = checkpoint_name(shard(h[:, :, 1], ("batch", "length", "mlp")), remat.MLP_WI_1)
    y_BxLxD = self.wo(jax.nn.silu(gate_BxLxF) * up_BxLxF, key)
    return checkpoint_name(shard(y_BxLxD, ("batch", "length", "embed")), remat.MLP_WO)
