"""SwiGLU MLP: gate and up projections fused into one kernel [embed, 2, mlp], then down."""

from __future__ import annotations

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from ember import remat
from ember.layers.glu import SwiGLU
from ember.layers.linear import Linear, handed
from ember.config.model import ModelConfig
from ember.quant.recipe import Recipe
from ember.names import BATCH, EMBED, GATE, LENGTH, MLP as MLP_AXIS, MLP_IN
from ember.parallel.sharding import shard


class MLP(nnx.Module):
  def __init__(self, model: ModelConfig, d_ff: int, *, recipe: Recipe, layer: int, rngs: nnx.Rngs,
               names=("wi", "wo")):
    wi, wo = names
    recipe_of = lambda name: recipe.for_projection(name, layer, model.num_layers)
    common = dict(dtype=model.dtype, param_dtype=model.param_dtype, rngs=rngs)
    self.wi = Linear((model.d_model,), (2, d_ff), (EMBED, GATE, MLP_AXIS), name=wi, recipe=recipe_of(wi),
                     init_std=model.init_std, **common)
    # FSDP splits wo along its input (MLP_IN takes the mesh axes `embed` would: the first logical axis wins).
    self.wo = Linear((d_ff,), (model.d_model,), (MLP_IN, EMBED), name=wo, recipe=recipe_of(wo),
                     init_std=model.out_init_std, **common)

  def __call__(self, x_BxLxD, key=None, taken=None):
    """`taken`: what the step hands the projections (layers/linear.py's `Taken`, by path), or None."""
    # The projection's output is saved whole (remat.MLP_WI): saved apart, each half would be a copy of it.
    h_BxLx2xF = self.wi(x_BxLxD, key, handed(taken, "wi"))
    h_BxLx2xF = checkpoint_name(shard(h_BxLx2xF, (BATCH, LENGTH, GATE, MLP_AXIS)), remat.MLP_WI)
    if self.wo.recipe.quantized:  # The down projection quantizes the product: made here, as it lies.
      gate_BxLxF = shard(h_BxLx2xF[:, :, 0], (BATCH, LENGTH, MLP_AXIS))
      up_BxLxF = shard(h_BxLx2xF[:, :, 1], (BATCH, LENGTH, MLP_AXIS))
      y_BxLxD = self.wo(jax.nn.silu(gate_BxLxF) * up_BxLxF, key, handed(taken, "wo"))
    else:  # Its bf16 GEMM makes the product, and in the backward pass the pair's gradient with it (layers/glu.py).
      y_BxLxD = self.wo(h_BxLx2xF, key, handed(taken, "wo"), prologue=SwiGLU())
    return checkpoint_name(shard(y_BxLxD, self.wo.block_output()), remat.MLP_WO)
