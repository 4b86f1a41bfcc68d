"""The model's shape as a typed, frozen value: what the layers, the FLOP count and the exporters read.

The typed `model` section of the config (ember/config/settings.py builds it once): the model's shape only, the
same in every precision phase (the recipe is the phase's, handed to the layers beside it). Every value derived
from the model section (head_dim, which layers are MoE, the layers per scan block, the scan segments a recipe's
`quant.exclude` cuts it into) is computed here and nowhere else. Hashable, so layers and custom VJPs may close
over it.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from ember.errors import bad_key
from ember.keys import key
from ember.names import LAYER_PROJECTIONS, MOE_DISPATCHERS, MOE_EXPERT_GEMMS
from ember.quant.recipe import Recipe


DTYPES = ("float32", "bfloat16", "float16")
ROUTER_SCORES = ("softmax", "sigmoid")
# Multi-head latent attention's sizes beside kv_lora_rank (which turns it on); read by nothing else.
MLA_DIMS = ("q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The config's `model` section, typed (each field declares its key: ember/keys.py)."""
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
  # Llama 3.1's RoPE scaling (Hugging Face's rope_type "llama3", ember/layers/rope.py); factor 0 = none.
  rope_scaling_factor: float = key("float", ">=0")
  rope_low_freq_factor: float = key("float", ">0")
  rope_high_freq_factor: float = key("float", ">0")
  rope_original_seq_len: int = key("int", ">=1")
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
  norm_topk_prob: bool = key("bool")  # layers/moe.py's `route`.
  capacity_factor: float = key("float", ">=0")
  moe_dispatch: str = key("str", choices=MOE_DISPATCHERS)  # ember/layers/moe_dispatch.py.
  moe_ragged_buffer: float = key("float", ">0")
  moe_expert_gemm: str = key("str", choices=MOE_EXPERT_GEMMS)  # ember/layers/moe_dispatch.py.
  moe_expert_buffer: float = key("float", ">0")
  load_balance_weight: float = key("float", ">=0")
  router_z_weight: float = key("float", ">=0")
  router_bias_update_rate: float = key("float", ">=0")  # 0 = no router bias (layers/moe.py, RouterBias).
  # DeepSeek-V3's MoE (layers/moe.py, `route`): sigmoid scores, top-k within the best `topk_group` of `n_group`
  # expert groups, the chosen weights renormalised and scaled; `num_shared_experts` always-on experts of d_ff;
  # the first `first_k_dense` layers dense, of `dense_d_ff`.
  router_score: str = key("str", choices=ROUTER_SCORES)
  n_group: int = key("int", ">=1")
  topk_group: int = key("int", ">=1")
  routed_scaling_factor: float = key("float", ">0")
  num_shared_experts: int = key("int", ">=0")
  first_k_dense: int = key("int", ">=0")
  dense_d_ff: int = key("int", ">=0")  # 0 = d_ff.
  seq_load_balance_weight: float = key("float", ">=0")  # DeepSeek-V3's sequence-wise balance loss (0 = off).
  # Multi-head latent attention (layers/mla.py): on where kv_lora_rank > 0.
  q_lora_rank: int = key("int", ">=0")  # 0 = a full-rank query projection.
  kv_lora_rank: int = key("int", ">=0")
  qk_rope_head_dim: int = key("int", ">=0")
  qk_nope_head_dim: int = key("int", ">=0")
  v_head_dim: int = key("int", ">=0")
  # Multi-token prediction (layers/mtp.py): modules predicting 2, 3, ... tokens ahead, their loss weighted.
  mtp_depth: int = key("int", ">=0")
  mtp_loss_weight: float = key("float", ">=0")

  def __post_init__(self):
    """The section's own rules (the typed values are already of their kind and within their bounds)."""
    object.__setattr__(self, "param_dtype", jnp.dtype(self.param_dtype))
    object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
    if self.num_heads % self.num_kv_heads:
      bad_key("model.num_kv_heads", f"{self.num_kv_heads} kv heads do not divide model.num_heads={self.num_heads}")
    if self.head_dim % 2:
      bad_key("model.head_dim", f"rotary embeddings need an even head_dim, got {self.head_dim}")
    if self.rope_scaling_factor and self.rope_high_freq_factor <= self.rope_low_freq_factor:
      bad_key("model.rope_high_freq_factor", f"{self.rope_high_freq_factor} must exceed model.rope_low_freq_factor="
              f"{self.rope_low_freq_factor} (the band between them is mixed)")
    if self.num_experts:
      if self.experts_per_token > self.num_experts:
        bad_key("model.experts_per_token",
              f"must be in [1, num_experts={self.num_experts}], got {self.experts_per_token}")
      if self.num_layers % self.moe_every:
        bad_key("model.moe_every",
                f"model.num_layers={self.num_layers} is not a multiple of moe_every={self.moe_every}")
      self._check_routing()
    if self.first_k_dense and self.first_k_dense >= self.num_layers:
      bad_key("model.first_k_dense", f"{self.first_k_dense} dense layers leave no MoE layer of "
              f"model.num_layers={self.num_layers}")
    if self.first_k_dense % self.block_size:
      bad_key("model.first_k_dense", f"{self.first_k_dense} is not a multiple of model.moe_every={self.moe_every}")
    if self.shared_expert_d_ff and self.num_shared_experts:
      bad_key("model.num_shared_experts", "set it or model.shared_expert_d_ff, not both (the shared width is "
              "num_shared_experts x d_ff)")
    if self.is_mla:
      self._check_mla()

  def _check_routing(self):
    if not self.norm_topk_prob and not self.router_softmax_first and self.router_score == "softmax":
      bad_key("model.norm_topk_prob", "false needs model.router_softmax_first or router_score='sigmoid': a softmax "
              "over the top-k logits (Mixtral's router) sums to 1 by construction")
    group = self.num_experts // self.n_group
    if self.num_experts % self.n_group:
      bad_key("model.n_group", f"{self.n_group} groups do not divide model.num_experts={self.num_experts}")
    if self.topk_group > self.n_group:
      bad_key("model.topk_group", f"{self.topk_group} groups chosen of model.n_group={self.n_group}")
    if self.n_group > 1 and group < 2:
      bad_key("model.n_group", f"a group is scored by its two best experts: {self.n_group} groups of "
              f"{self.num_experts} experts hold {group}")
    if self.experts_per_token > self.topk_group * group:
      bad_key("model.experts_per_token", f"{self.experts_per_token} experts do not fit in model.topk_group="
              f"{self.topk_group} groups of {group}")

  def _check_mla(self):
    for name in MLA_DIMS[1:]:  # All but q_lora_rank, whose 0 is a full query projection.
      if not getattr(self, name):
        bad_key(f"model.{name}", "multi-head latent attention (model.kv_lora_rank > 0) needs it > 0")
    if self.qk_rope_head_dim % 2:
      bad_key("model.qk_rope_head_dim", f"rotary embeddings need an even size, got {self.qk_rope_head_dim}")
    if self.v_head_dim > self.qk_nope_head_dim + self.qk_rope_head_dim:
      bad_key("model.v_head_dim", f"{self.v_head_dim} exceeds a query's size, qk_nope_head_dim + qk_rope_head_dim = "
              f"{self.qk_nope_head_dim + self.qk_rope_head_dim} (the attention kernels pad values to it)")
    if self.qk_norm:
      bad_key("model.qk_norm", "multi-head latent attention normalises its latents, not per-head queries and keys")

  # --- Attention ------------------------------------------------------------------------------------

  @property
  def q_per_kv(self) -> int:
    """Query heads per key/value head (grouped-query attention)."""
    return self.num_heads // self.num_kv_heads

  def kv_copies(self, tensor: int) -> int:
    """How many of `tensor` ranks share each kv head: 1 where `tensor` divides the kv heads; where it is a multiple
    of them, each rank holds whole copies of its group's key and value weights and computes its own (Megatron's
    replicated kv groups; layers/attention.py `kv_view`). `tensor_refusal` says which counts can split the heads."""
    return 1 if self.is_mla or self.num_kv_heads % tensor == 0 else tensor // self.num_kv_heads

  def tensor_refusal(self, tensor: int) -> str | None:
    """Why `tensor` ranks cannot split this model's heads, MLP units and vocabulary between them; None where they
    can."""
    if tensor == 1:
      return None
    if self.num_heads % tensor:
      return f"{tensor} does not divide model.num_heads={self.num_heads}"
    if not self.is_mla and self.num_kv_heads % tensor and tensor % self.num_kv_heads:
      return (f"{tensor} neither divides model.num_kv_heads={self.num_kv_heads} nor is a multiple of it (each rank "
              f"holds its kv heads, or whole copies of one)")
    for name, units in (("d_ff", self.d_ff), ("dense_d_ff", self.dense_width), ("shared_expert_d_ff", self.shared_d_ff),
                        ("vocab_size", self.vocab_size)):
      if units % tensor:
        what = "vocabulary's" if name == "vocab_size" else "MLP's"
        return f"{tensor} does not divide the {what} {units} units (model.{name})"
    return None

  @property
  def out_init_std(self) -> float:
    """Init std of the projections that write into the residual stream (scaled by depth)."""
    return self.init_std / (2 * self.num_layers) ** 0.5

  @property
  def is_mla(self) -> bool:
    """Multi-head latent attention (layers/mla.py) instead of grouped-query attention."""
    return self.kv_lora_rank > 0

  @property
  def qk_head_dim(self) -> int:
    """A query's and a key's size per head: MLA's no-RoPE and RoPE parts, else head_dim."""
    return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim

  @property
  def cache_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """What sampling caches per token and layer: (k, v) of every kv head, or MLA's (latent, RoPE key)."""
    if self.is_mla:
      return (self.kv_lora_rank,), (self.qk_rope_head_dim,)
    return ((self.num_kv_heads, self.head_dim),) * 2

  # --- Layers and blocks ------------------------------------------------------------------------------

  @property
  def is_moe(self) -> bool:
    return self.num_experts > 0

  def is_moe_layer(self, index: int) -> bool:
    """Layer `index` is MoE when experts are on, it is past the first `first_k_dense` and it closes a group of
    `moe_every` layers. A multi-token-prediction module's layer (index num_layers + k) is like the last layer."""
    index = min(index, self.num_layers - 1)
    return self.is_moe and index >= self.first_k_dense and index % self.moe_every == self.moe_every - 1

  @property
  def stat_layers(self) -> int:
    """The layers whose statistics a train step reports per layer: the decoder's, then the multi-token-prediction
    modules' (layers/mtp.py)."""
    return self.num_layers + self.mtp_depth

  @property
  def num_routed_layers(self) -> int:
    """MoE layers among `stat_layers`: what the balance losses are averaged over."""
    return sum(self.is_moe_layer(i) for i in range(self.stat_layers))

  @property
  def dense_width(self) -> int:
    """The SwiGLU width of a dense layer."""
    return self.dense_d_ff or self.d_ff

  @property
  def shared_d_ff(self) -> int:
    """The always-on shared experts' width in an MoE layer (0 = none)."""
    return self.shared_expert_d_ff or self.num_shared_experts * self.d_ff

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

  def segments(self, recipe: Recipe) -> list[list[int]]:
    """The decoder's scan segments (ember/layers/decoder.py) under `recipe`: runs of consecutive blocks of the
    same layers (dense or MoE: `first_k_dense`) whose projections resolve to the same recipes under
    `quant.exclude`."""
    def signature(b):
      layers = range(b * self.block_size, (b + 1) * self.block_size)
      return (tuple(self.is_moe_layer(i) for i in layers),
              tuple(recipe.for_projection(p, i, self.num_layers).name for i in layers for p in LAYER_PROJECTIONS))

    groups: list[list[int]] = []
    for b in range(self.num_blocks):
      if groups and signature(groups[-1][0]) == signature(b):
        groups[-1].append(b)
      else:
        groups.append([b])
    return groups

  def staged_segment(self, recipe: Recipe) -> int:
    """The scan segment (of `segments(recipe)`) a pipeline splits into stages: the longest, the last of equals. The
    segments before it run on the first stage ahead of its layers (`first_k_dense` layers, a `quant.exclude` of
    the first layers), those after it on the last stage after them (an exclude of the last layers), each on every
    stage's parameters (ember/trainer/pipelined.py)."""
    return self.scan_segments(recipe)[1]

  def scan_segments(self, recipe: Recipe) -> tuple[list[list[int]], int]:
    """(`segments(recipe)`, `staged_segment(recipe)`): both from one pass over the layers."""
    segments = self.segments(recipe)
    lengths = [len(s) for s in segments]
    return segments, len(lengths) - 1 - lengths[::-1].index(max(lengths))

  def pipeline_blocks(self, recipe: Recipe) -> tuple[int, int, int]:
    """(blocks before the staged segment, its own, after it): what a pipeline's first stage runs ahead of the
    staged segment's rows, the rows, and what its last stage runs after them (`staged_segment`)."""
    segments, at = self.scan_segments(recipe)
    return sum(map(len, segments[:at])), len(segments[at]), sum(map(len, segments[at + 1:]))
