"""The model's shape as a typed, frozen value: what the layers, the FLOP count and the exporters read.

Built once from a validated config (`ModelConfig.from_config(cfg)`: the `model` section and the
quantization recipe); every value derived from the model section (head_dim, which layers are MoE,
the layers per scan block, each projection's recipe under `quant.exclude`) is computed here and
nowhere else. Hashable, so layers and custom VJPs may close over it.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from ember.quant.recipe import Recipe


def resolved_head_dim(model_cfg) -> int:
  """`model.head_dim`, or d_model // num_heads when it is 0."""
  return int(model_cfg.head_dim) or int(model_cfg.d_model) // int(model_cfg.num_heads)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  name: str
  num_layers: int
  d_model: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  d_ff: int
  vocab_size: int
  seq_len: int
  rope_theta: float
  norm_eps: float
  tie_embeddings: bool
  param_dtype: jnp.dtype
  dtype: jnp.dtype
  attention: str  # auto | xla | cudnn
  init_std: float
  qk_norm: bool  # RMSNorm over head_dim on queries and keys, before RoPE (Qwen3).
  num_experts: int  # 0 = dense.
  experts_per_token: int
  moe_every: int
  shared_expert_d_ff: int
  router_softmax_first: bool
  capacity_factor: float
  moe_dispatch: str  # allgather | alltoall | ragged | auto (ember/layers/moe_dispatch.py).
  moe_ragged_buffer: float
  moe_expert_gemm: str  # ragged_dot | capacity | auto (ember/layers/moe_dispatch.py).
  moe_expert_buffer: float
  recipe: Recipe

  @classmethod
  def from_config(cls, cfg) -> "ModelConfig":
    m = cfg.model
    return cls(
        name=str(m.name), num_layers=int(m.num_layers), d_model=int(m.d_model), num_heads=int(m.num_heads),
        num_kv_heads=int(m.num_kv_heads), head_dim=resolved_head_dim(m), d_ff=int(m.d_ff),
        vocab_size=int(m.vocab_size), seq_len=int(m.seq_len), rope_theta=float(m.rope_theta),
        norm_eps=float(m.norm_eps), tie_embeddings=bool(m.tie_embeddings), param_dtype=jnp.dtype(m.param_dtype),
        dtype=jnp.dtype(m.dtype), attention=str(m.attention), init_std=float(m.init_std),
        qk_norm=bool(m.qk_norm), num_experts=int(m.num_experts), experts_per_token=int(m.experts_per_token),
        moe_every=int(m.moe_every),
        shared_expert_d_ff=int(m.shared_expert_d_ff), router_softmax_first=bool(m.router_softmax_first),
        capacity_factor=float(m.capacity_factor), moe_dispatch=str(m.moe_dispatch),
        moe_ragged_buffer=float(m.moe_ragged_buffer), moe_expert_gemm=str(m.moe_expert_gemm),
        moe_expert_buffer=float(m.moe_expert_buffer),
        recipe=dataclasses.replace(Recipe.from_config(cfg.quant),
                                   stats=int(cfg.log.get("quant_stats_every", 0)) > 0,
                                   wgrad_dtype=str(cfg.train.get("grad_reduce_dtype", "float32"))))

  # --- Attention ------------------------------------------------------------------------------------

  @property
  def q_per_kv(self) -> int:
    """Query heads per key/value head (grouped-query attention)."""
    return self.num_heads // self.num_kv_heads

  @property
  def out_init_std(self) -> float:
    """Init std of the projections that write into the residual stream (scaled by depth)."""
    return self.init_std / (2 * self.num_layers) ** 0.5

  # --- Layers and blocks ------------------------------------------------------------------------------

  @property
  def is_moe(self) -> bool:
    return self.num_experts > 0

  def is_moe_layer(self, index: int) -> bool:
    """Layer `index` is MoE when experts are on and it closes a group of `moe_every` layers."""
    return self.is_moe and index % self.moe_every == self.moe_every - 1

  @property
  def num_moe_layers(self) -> int:
    return sum(self.is_moe_layer(i) for i in range(self.num_layers))

  @property
  def block_size(self) -> int:
    """Layers per scan step: one for dense models, `moe_every` (dense..., MoE) when interleaved."""
    return self.moe_every if self.is_moe else 1

  @property
  def num_blocks(self) -> int:
    return self.num_layers // self.block_size

  def recipe_for(self, projection: str, layer: int | None = None) -> Recipe:
    """The recipe of projection kind `projection` in `layer` (None: the LM head), `quant.exclude` applied."""
    return self.recipe.for_projection(projection, layer, self.num_layers)
