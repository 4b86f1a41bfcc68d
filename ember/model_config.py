"""The model's shape as a typed, frozen value: what the layers, the FLOP count and the exporters read.

The typed `model` section of the config (ember/settings.py builds it once, with the quantization recipe);
every value derived from the model section (head_dim, which layers are MoE,
the layers per scan block, each projection's recipe under `quant.exclude`) is computed here and
nowhere else. Hashable, so layers and custom VJPs may close over it.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from ember.errors import bad_key
from ember.keys import key
from ember.names import MOE_DISPATCHERS, MOE_EXPERT_GEMMS
from ember.quant.recipe import Recipe


DTYPES = ("float32", "bfloat16", "float16")



@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The config's `model` section, typed (each field declares its key: ember/keys.py), and the recipe."""
  name: str = key("str")
  num_layers: int = key("int", ">=1")
  d_model: int = key("int", ">=1")
  num_heads: int = key("int", ">=1")
  num_kv_heads: int = key("int", ">=1")
  head_dim: int = key("int", ">=0")  # The key's 0 (= d_model // num_heads) is resolved by the builder.
  d_ff: int = key("int", ">=1")
  vocab_size: int = key("int", ">=0")  # The key's 0 (= the tokenizer's, padded to 128) is resolved by the builder.
  seq_len: int = key("int", ">=1")
  rope_theta: float = key("float", ">0")
  norm_eps: float = key("float", ">=0")
  tie_embeddings: bool = key("bool")
  param_dtype: jnp.dtype = key("str", choices=DTYPES)
  dtype: jnp.dtype = key("str", choices=DTYPES)
  attention: str = key("str", choices=("auto", "xla", "cudnn"))
  init_std: float = key("float", ">=0")
  qk_norm: bool = key("bool")  # RMSNorm over head_dim on queries and keys, before RoPE (Qwen3).
  scan_layers: bool = key("bool")  # One scan over each segment's layers, or one block after another (decoder.py).
  num_experts: int = key("int", ">=0")  # 0 = dense.
  experts_per_token: int = key("int", ">=1")
  moe_every: int = key("int", ">=1")
  shared_expert_d_ff: int = key("int", ">=0")
  router_softmax_first: bool = key("bool")
  capacity_factor: float = key("float", ">=0")
  moe_dispatch: str = key("str", choices=MOE_DISPATCHERS)  # ember/layers/moe_dispatch.py.
  moe_ragged_buffer: float = key("float", ">0")
  moe_expert_gemm: str = key("str", choices=MOE_EXPERT_GEMMS)  # ember/layers/moe_dispatch.py.
  moe_expert_buffer: float = key("float", ">0")
  load_balance_weight: float = key("float", ">=0")
  router_z_weight: float = key("float", ">=0")
  router_bias_update_rate: float = key("float", ">=0")  # 0 = no router bias (layers/moe.py, RouterBias).
  recipe: Recipe = dataclasses.field(default_factory=Recipe)  # The `quant` section (with its log and train
  # options), which every projection reads through `recipe_for`.

  def __post_init__(self):
    """The section's own rules (the typed values are already of their kind and within their bounds)."""
    object.__setattr__(self, "param_dtype", jnp.dtype(self.param_dtype))
    object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
    if self.num_heads % self.num_kv_heads:
      bad_key("model.num_kv_heads", f"{self.num_kv_heads} kv heads do not divide model.num_heads={self.num_heads}")
    if self.head_dim % 2:
      bad_key("model.head_dim", f"rotary embeddings need an even head_dim, got {self.head_dim}")
    if self.num_experts:
      if self.experts_per_token > self.num_experts:
        bad_key("model.experts_per_token",
              f"must be in [1, num_experts={self.num_experts}], got {self.experts_per_token}")
      if self.num_layers % self.moe_every:
        bad_key("model.moe_every",
                f"model.num_layers={self.num_layers} is not a multiple of moe_every={self.moe_every}")

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
  def expert_params(self) -> int:
    """One routed expert's kernel parameters: the fused gate/up projection [d_model, 2, d_ff] and wo [d_ff, d_model]."""
    return 3 * self.d_model * self.d_ff

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
