"""The decoder: embedding, scanned blocks of layers, final norm, LM head.

Layers are stacked (a leading `layers` axis on every parameter, created with `nnx.vmap`) and run
under `jax.lax.scan`, so XLA compiles one block body whatever the depth. `jax.checkpoint` with the
remat preset's policy wraps that body (ember/remat.py), so the backward pass keeps one block's
activations alive at a time.

A *block* is the repeating unit: one layer for dense models, `moe_every` layers (dense..., MoE)
when layers are interleaved. Consecutive blocks that quantize identically form a *segment*, one
scan each: `quant.exclude` patterns that name particular layers (`layers.0.*`) split the stack
into segments instead of branching inside the scanned body.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from ember import remat
from ember.config import is_moe_layer
from ember.layers.attention import Attention
from ember.layers.embed import Embed
from ember.layers.linear import Linear
from ember.layers.mlp import MLP
from ember.layers.norm import RMSNorm
from ember.parallel.sharding import shard
from ember.quant.recipe import Recipe

# Sub-paths of every projection a layer may hold, for `quant.exclude` matching.
_PROJECTION_PATHS = ("attn.qkv", "attn.out", "mlp.wi", "mlp.wo", "moe.moe_wi", "moe.moe_wo", "moe.shared.shared_wi",
                     "moe.shared.shared_wo")
AUX_KEYS = ("moe_load_balance_loss", "moe_router_z_loss", "moe_dropped_tokens", "moe_routed_tokens")


def zero_aux() -> dict[str, jax.Array]:
  return {k: jnp.zeros((), jnp.float32) for k in AUX_KEYS}


def block_size(model_cfg) -> int:
  return model_cfg.moe_every if model_cfg.num_experts else 1


class DecoderLayer(nnx.Module):
  def __init__(self, cfg, index: int, recipe: Recipe, rngs: nnx.Rngs):
    m = cfg.model
    dtype, param_dtype = jnp.dtype(m.dtype), jnp.dtype(m.param_dtype)
    path = f"layers.{index}"
    self.attn_norm = RMSNorm(m.d_model, eps=m.norm_eps, dtype=dtype, param_dtype=param_dtype)
    self.attn = Attention(cfg, path=f"{path}.attn", recipe=recipe, rngs=rngs)
    self.mlp_norm = RMSNorm(m.d_model, eps=m.norm_eps, dtype=dtype, param_dtype=param_dtype)
    self.is_moe = is_moe_layer(m, index)
    if self.is_moe:
      from ember.layers.moe import MoE  # The MoE layer is only imported by MoE models.
      self.moe = MoE(cfg, path=f"{path}.moe", recipe=recipe, rngs=rngs)
    else:
      self.mlp = MLP(cfg, m.d_ff, path=f"{path}.mlp", recipe=recipe, rngs=rngs)

  def __call__(self, x_BxLxD, segment_ids_BxL, positions_BxL, key=None):
    x_BxLxD = checkpoint_name(x_BxLxD, remat.LAYER_INPUT)
    h_BxLxD = x_BxLxD + self.attn(self.attn_norm(x_BxLxD), segment_ids_BxL, positions_BxL, key)
    if self.is_moe:
      y_BxLxD, aux = self.moe(self.mlp_norm(h_BxLxD), segment_ids_BxL, key)
    else:
      y_BxLxD, aux = self.mlp(self.mlp_norm(h_BxLxD), key), zero_aux()
    return shard(h_BxLxD + y_BxLxD, ("batch", "length", "embed")), aux


class Block(nnx.Module):
  """`block_size` consecutive layers starting at `first`: the body of one scan step."""

  def __init__(self, cfg, first: int, recipe: Recipe, rngs: nnx.Rngs):
    self.layers = nnx.List([DecoderLayer(cfg, first + j, recipe, rngs) for j in range(block_size(cfg.model))])

  def __call__(self, x, segment_ids, positions, key=None):
    aux = zero_aux()
    for j, layer in enumerate(self.layers):
      layer_key = None if key is None else jax.random.fold_in(key, j)
      x, a = layer(x, segment_ids, positions, layer_key)
      aux = jax.tree.map(jnp.add, aux, a)
    return x, aux


class Segment(nnx.Module):
  """Blocks `block_ids` stacked along a leading `layers` axis and run by one scan."""

  def __init__(self, cfg, block_ids: Sequence[int], recipe: Recipe, rngs: nnx.Rngs):
    self.block_ids = tuple(block_ids)
    first = self.block_ids[0] * block_size(cfg.model)

    @nnx.split_rngs(splits=len(self.block_ids))
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(rngs):
      return Block(cfg, first, recipe, rngs)

    self.blocks = make(rngs)

  def __call__(self, x, segment_ids, positions, key, policy: remat.Preset):
    graphdef, state = nnx.split(self.blocks)

    def body(carry, xs):
      x, aux = carry
      block_state, block_id = xs
      block_key = None if key is None else jax.random.fold_in(key, block_id)
      y, a = nnx.merge(graphdef, block_state)(x, segment_ids, positions, block_key)
      return (y, jax.tree.map(jnp.add, aux, a)), None

    ids = jnp.asarray(self.block_ids, jnp.int32)
    (x, aux), _ = jax.lax.scan(remat.checkpoint(body, policy), (x, zero_aux()), (state, ids))
    return x, aux


def segments_of(cfg, recipe: Recipe) -> list[list[int]]:
  """Groups consecutive blocks whose projections resolve to the same recipes under `quant.exclude`."""
  size = block_size(cfg.model)

  def signature(b):
    return tuple(recipe.for_path(f"layers.{b * size + j}.{p}").name for j in range(size) for p in _PROJECTION_PATHS)

  groups: list[list[int]] = []
  for b in range(cfg.model.num_layers // size):
    if groups and signature(groups[-1][0]) == signature(b):
      groups[-1].append(b)
    else:
      groups.append([b])
  return groups


class Transformer(nnx.Module):
  """Decoder-only LM. `__call__` returns the final normed hidden states; `head` maps them to logits
  (the loss applies it chunk by chunk so full [batch, length, vocab] logits never exist)."""

  def __init__(self, cfg, rngs: nnx.Rngs, policy: remat.Preset = remat.PRESETS["full"]):
    m = cfg.model
    if m.num_layers % block_size(m):
      raise ValueError(f"model.num_layers={m.num_layers} is not a multiple of model.moe_every={m.moe_every}")
    recipe = Recipe.from_config(cfg.quant)
    dtype, param_dtype = jnp.dtype(m.dtype), jnp.dtype(m.param_dtype)
    self.policy = policy
    self.embed = Embed(m.vocab_size, m.d_model, init_std=m.init_std, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.segments = nnx.List([Segment(cfg, ids, recipe, rngs) for ids in segments_of(cfg, recipe)])
    self.final_norm = RMSNorm(m.d_model, eps=m.norm_eps, dtype=dtype, param_dtype=param_dtype)
    self.tie_embeddings = m.tie_embeddings
    if not m.tie_embeddings:
      # The chunked loss calls the head once per chunk, and delayed scaling's history update
      # assumes one call per step, so a quantized LM head uses current scaling.
      head_recipe = dataclasses.replace(recipe, name="fp8_current") if recipe.delayed else recipe
      self.lm_head = Linear((m.d_model,), (m.vocab_size,), ("embed", "vocab"), name="lm_head", path="lm_head",
                            recipe=head_recipe, init_std=m.init_std, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def __call__(self, tokens_BxL, segment_ids_BxL, positions_BxL, key=None, policy: remat.Preset | None = None):
    x = self.embed(tokens_BxL)
    aux = zero_aux()
    for segment in self.segments:
      x, a = segment(x, segment_ids_BxL, positions_BxL, key, policy or self.policy)
      aux = jax.tree.map(jnp.add, aux, a)
    return self.final_norm(x), aux

  def head(self, h_BxCxD, key=None):
    """Logits (float32) for a chunk of final hidden states."""
    if self.tie_embeddings:
      table = self.embed.embedding[...].astype(h_BxCxD.dtype)
      logits = jnp.einsum("bcd,vd->bcv", h_BxCxD, table, preferred_element_type=jnp.float32)
    else:
      logits = self.lm_head(h_BxCxD, key).astype(jnp.float32)
    return shard(logits, ("batch", "length", "vocab"))
