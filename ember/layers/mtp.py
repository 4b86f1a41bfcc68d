"""Multi-token prediction (DeepSeek-V3, section 2.2): modules that predict tokens further ahead in training.

Module k (1-based, `model.mtp_depth` of them, in a chain) sees at position i the previous depth's hidden state
(the decoder's last layer output for k = 1, before the final norm) and the embedding of token i + k (the shared
embedding), each RMS-normed, concatenated [embedding; hidden] and projected back to the model width (`mtp_proj`,
a quantized projection like any other); one decoder layer (MoE where the model's last layer is) follows, and its
output, normed by the module's own norm, goes through the shared LM head to predict token i + k + 1.

The chain's inputs come from the batch's targets: token i + k is `targets[i + k - 1]`, the target `targets[i + k]`,
counted only where position i + k is in position i's document (`shifted`). The loss of depth k is its NLL summed
over those positions and divided by the main loss's token count (the report's 1/T); `mtp_loss` is their mean
over depths and adds `model.mtp_loss_weight` times itself to the objective (ember/trainer/step.py). Sampling does
not run the modules.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from ember import remat
from ember.layers.linear import Linear, handed
from ember.layers.norm import RMSNorm
from ember.config.model import ModelConfig
from ember.quant.recipe import Recipe
from ember.names import EMBED


class PredictionModule(nnx.Module):
  """Depth `depth` (1-based): its layer is the model's layer `num_layers + depth - 1` for recipes and MoE-ness."""

  def __init__(self, model: ModelConfig, recipe: Recipe, depth: int, rngs: nnx.Rngs, *, make_layer: Callable):
    """`make_layer(model, recipe, index, rngs)`: the decoder's layer (ember/layers/decoder.py, which holds these
    modules)."""
    layer = model.num_layers + depth - 1
    norm = lambda: RMSNorm(model.d_model, eps=model.norm_eps, dtype=model.dtype, param_dtype=model.param_dtype)
    self.embed_norm, self.hidden_norm, self.out_norm = norm(), norm(), norm()
    self.proj = Linear((2 * model.d_model,), (model.d_model,), (None, EMBED), name="mtp_proj",
                       recipe=recipe.for_projection("mtp_proj", layer, model.num_layers), init_std=model.init_std,
                       dtype=model.dtype, param_dtype=model.param_dtype, rngs=rngs)
    self.layer = make_layer(model, recipe, layer, rngs)

  def __call__(self, hidden_BxLxD, embedded_BxLxD, segment_ids_BxL, positions_BxL, key=None, bias=None,
               moe_plan=None, taken=None):
    """(this depth's hidden state for the next depth, it normed for the LM head, the layer's aux). `moe_plan`, `taken`:
    what the step hands its MoE layer and its projections (the decoder layer's)."""
    joined = jnp.concatenate([self.embed_norm(embedded_BxLxD), self.hidden_norm(hidden_BxLxD)], axis=-1)
    projected_BxLxD = checkpoint_name(self.proj(joined, key, handed(taken, "proj")), remat.MTP_PROJ)
    x_BxLxD, aux = self.layer(projected_BxLxD, segment_ids_BxL, positions_BxL, key, bias, moe_plan,
                              handed(taken, "layer"))
    return x_BxLxD, self.out_norm(x_BxLxD), aux


def shifted(a_BxL: jax.Array, k: int, fill=0) -> jax.Array:
  """a[:, i + k] at position i (`fill` past the row's end)."""
  if k == 0:
    return a_BxL
  pad = jnp.full((a_BxL.shape[0], k), fill, a_BxL.dtype)
  return jnp.concatenate([a_BxL[:, k:], pad], axis=1)


def depth_inputs(targets_BxL, segment_ids_BxL, depth: int):
  """(the tokens depth `depth` embeds, its targets, its loss weights): tokens i + depth and i + depth + 1, weighted
  where position i + depth lies in position i's document."""
  same = (shifted(segment_ids_BxL, depth, fill=-1) == segment_ids_BxL) & (segment_ids_BxL > 0)
  return shifted(targets_BxL, depth - 1), shifted(targets_BxL, depth), same.astype(jnp.float32)
