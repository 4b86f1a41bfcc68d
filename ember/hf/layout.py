"""ember's parameters in Hugging Face's Llama / Mixtral / Qwen3 / Qwen3-MoE layouts, both ways: the one place
for the rule.

ember keeps projections fused and input-major (`y = x @ kernel`); Hugging Face keeps them split and
output-major (`y = x @ weight.T`). Per layer (HF names below `model.layers.{i}.`):

  ember                          shape              Hugging Face
  attn_norm.scale                [D]                input_layernorm.weight
  attn.qkv.kernel                [D, K, G+2, H]     self_attn.{q,k,v}_proj.weight: q head n = kv head
                                                    n // G, query slot n % G (repeat_kv's order);
                                                    q [N*H, D], k and v [K*H, D]
  attn.out.kernel                [N, H, D]          self_attn.o_proj.weight [D, N*H]
  mlp_norm.scale                 [D]                post_attention_layernorm.weight
  mlp.wi.kernel                  [D, 2, F]          mlp.gate_proj.weight ([:, 0]), mlp.up_proj.weight ([:, 1])
  mlp.wo.kernel                  [F, D]             mlp.down_proj.weight [D, F]
  moe.router                     [D, E]             block_sparse_moe.gate.weight [E, D]
  moe.wi.kernel                  [E, D, 2, F]       block_sparse_moe.experts.{e}.w1 (gate), .w3 (up) [F, D]
  moe.wo.kernel                  [E, F, D]          block_sparse_moe.experts.{e}.w2 [D, F]
  attn.q_norm.scale, k_norm      [H]                self_attn.q_norm.weight, self_attn.k_norm.weight (Qwen3)

The family follows the model (`family`): Llama (dense), Mixtral (MoE), Qwen3 (dense with `model.qk_norm`) and
Qwen3-MoE (MoE with `model.qk_norm`), whose router is `mlp.gate.weight` and experts
`mlp.experts.{e}.{gate,up,down}_proj.weight` (the names transformers' `save_pretrained` writes).

and embed.embedding [V, D] = model.embed_tokens.weight, final_norm.scale = model.norm.weight,
lm_head.kernel [D, V] = lm_head.weight [V, D] (absent when the embeddings are tied).

The rest agrees without conversion: RoPE's half-split layout is HF's `rotate_half` with the same
frequencies, RMSNorm is HF's, and ember's router (softmax over the top-k logits, or softmax, top-k,
renormalise) is Mixtral's softmax, top-k, renormalise, and Qwen3-MoE's with `norm_topk_prob`. What the
format cannot say is refused (`unsupported`): a shared expert, dense layers between MoE layers.

In ember's parameter tree, layers are stacked per segment: `decoder.layer_slots` says where each is.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np

from ember.config.model import ModelConfig
from ember.layers.decoder import layer_slots, stacked_layers, tree_leaves, within_layer
from ember.quant.recipe import Recipe

Get = Callable[[str, tuple], np.ndarray]  # (HF name, expected shape) -> array.


@dataclasses.dataclass(frozen=True)
class Rule:
  """One ember tensor and its HF tensors (for layer tensors, names below the layer's prefix)."""
  to_hf: Callable[[ModelConfig, np.ndarray], dict[str, np.ndarray]]
  from_hf: Callable[[ModelConfig, Get], np.ndarray]


def _qkv_to_hf(m: ModelConfig, w):
  d, g = w.shape[0], m.q_per_kv
  return {"self_attn.q_proj.weight": w[:, :, :g].reshape(d, -1).T,
          "self_attn.k_proj.weight": w[:, :, g].reshape(d, -1).T,
          "self_attn.v_proj.weight": w[:, :, g + 1].reshape(d, -1).T}


def _qkv_from_hf(m: ModelConfig, get: Get):
  d, k, g, h = m.d_model, m.num_kv_heads, m.q_per_kv, m.head_dim
  q = get("self_attn.q_proj.weight", (k * g * h, d)).T.reshape(d, k, g, h)
  key = get("self_attn.k_proj.weight", (k * h, d)).T.reshape(d, k, 1, h)
  value = get("self_attn.v_proj.weight", (k * h, d)).T.reshape(d, k, 1, h)
  return np.concatenate([q, key, value], axis=2)


def _norm(hf: str) -> Rule:
  return Rule(lambda m, w: {hf: w}, lambda m, get: get(hf, (m.d_model,)))


def _moe_rules(router: str, expert: str, gate: str, up: str, down: str) -> dict[tuple, Rule]:
  """An MoE family's router and expert rules: `expert` is the expert's prefix with `{e}`, gate / up / down its
  projections' names."""
  name = lambda e, proj: f"{expert.format(e=e)}.{proj}.weight"
  f_d = lambda m: (m.d_ff, m.d_model)
  return {
      ("moe", "router"): Rule(
          lambda m, w: {router: w.T}, lambda m, get: get(router, (m.num_experts, m.d_model)).T),
      ("moe", "wi", "kernel"): Rule(
          lambda m, w: {n: a for e in range(w.shape[0]) for n, a in ((name(e, gate), w[e, :, 0].T),
                                                                    (name(e, up), w[e, :, 1].T))},
          lambda m, get: np.stack([np.stack([get(name(e, gate), f_d(m)).T, get(name(e, up), f_d(m)).T], axis=1)
                                   for e in range(m.num_experts)])),
      ("moe", "wo", "kernel"): Rule(
          lambda m, w: {name(e, down): w[e].T for e in range(w.shape[0])},
          lambda m, get: np.stack([get(name(e, down), (m.d_model, m.d_ff)).T for e in range(m.num_experts)])),
  }


LAYER_RULES = {
    ("attn_norm", "scale"): _norm("input_layernorm.weight"),
    ("mlp_norm", "scale"): _norm("post_attention_layernorm.weight"),
    ("attn", "qkv", "kernel"): Rule(_qkv_to_hf, _qkv_from_hf),
    ("attn", "out", "kernel"): Rule(
        lambda m, w: {"self_attn.o_proj.weight": w.reshape(-1, w.shape[-1]).T},
        lambda m, get: get("self_attn.o_proj.weight", (m.d_model, m.num_heads * m.head_dim)).T.reshape(
            m.num_heads, m.head_dim, m.d_model)),
    ("mlp", "wi", "kernel"): Rule(
        lambda m, w: {"mlp.gate_proj.weight": w[:, 0].T, "mlp.up_proj.weight": w[:, 1].T},
        lambda m, get: np.stack([get("mlp.gate_proj.weight", (m.dense_width, m.d_model)).T,
                                 get("mlp.up_proj.weight", (m.dense_width, m.d_model)).T], axis=1)),
    ("mlp", "wo", "kernel"): Rule(
        lambda m, w: {"mlp.down_proj.weight": w.T},
        lambda m, get: get("mlp.down_proj.weight", (m.d_model, m.dense_width)).T),
}

_HEAD_NORMS = {("attn", f"{n}_norm", "scale"): Rule(
    lambda m, w, n=n: {f"self_attn.{n}_norm.weight": w},
    lambda m, get, n=n: get(f"self_attn.{n}_norm.weight", (m.head_dim,))) for n in ("q", "k")}
_MOE_RULES = {
    "mixtral": _moe_rules("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}", "w1", "w3", "w2"),
    "qwen3_moe": _moe_rules("mlp.gate.weight", "mlp.experts.{e}", "gate_proj", "up_proj", "down_proj"),
}


# --- DeepSeek-V3: multi-head latent attention, shared experts, the router's bias -----------------------------------

def rope_order(r: int) -> np.ndarray:
  """The HF column of each of ember's RoPE columns: DeepSeek rotates interleaved pairs (2i, 2i + 1), ember the
  half-split pairs (i, i + r / 2) (layers/rope.py) at the same frequencies, so ember's column i is HF's 2i and
  its column r / 2 + i HF's 2i + 1."""
  return np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2)])


def _rope_to_hf(w, r: int):
  """The last axis of `w`, whose last `r` entries are ember's RoPE columns, in HF's order (one gather: traced with
  `jax.eval_shape` too)."""
  n = w.shape[-1]
  return w[..., np.concatenate([np.arange(n - r), n - r + np.argsort(rope_order(r))])]


def _rope_from_hf(w, r: int):
  n = w.shape[-1]
  return w[..., np.concatenate([np.arange(n - r), n - r + rope_order(r)])]


def _q_name(m: ModelConfig) -> str:
  return "self_attn.q_b_proj.weight" if m.q_lora_rank else "self_attn.q_proj.weight"


def _ds_norm(hf: str, size) -> Rule:
  return Rule(lambda m, w: {hf: w}, lambda m, get: get(hf, (size(m),)))


_DEEPSEEK_RULES = {
    ("attn", "q_a", "kernel"): Rule(
        lambda m, w: {"self_attn.q_a_proj.weight": w.T},
        lambda m, get: get("self_attn.q_a_proj.weight", (m.q_lora_rank, m.d_model)).T),
    ("attn", "q_a_norm", "scale"): _ds_norm("self_attn.q_a_layernorm.weight", lambda m: m.q_lora_rank),
    ("attn", "q_b", "kernel"): Rule(
        lambda m, w: {_q_name(m): _rope_to_hf(w, m.qk_rope_head_dim).reshape(w.shape[0], -1).T},
        lambda m, get: _rope_from_hf(get(_q_name(m), (m.num_heads * m.qk_head_dim, m.q_lora_rank or m.d_model)).T
                                     .reshape(-1, m.num_heads, m.qk_head_dim), m.qk_rope_head_dim)),
    ("attn", "kv_a", "kernel"): Rule(
        lambda m, w: {"self_attn.kv_a_proj_with_mqa.weight": _rope_to_hf(w, m.qk_rope_head_dim).T},
        lambda m, get: _rope_from_hf(get("self_attn.kv_a_proj_with_mqa.weight",
                                         (m.kv_lora_rank + m.qk_rope_head_dim, m.d_model)).T, m.qk_rope_head_dim)),
    ("attn", "kv_a_norm", "scale"): _ds_norm("self_attn.kv_a_layernorm.weight", lambda m: m.kv_lora_rank),
    ("attn", "kv_b", "kernel"): Rule(
        lambda m, w: {"self_attn.kv_b_proj.weight": w.reshape(w.shape[0], -1).T},
        lambda m, get: get("self_attn.kv_b_proj.weight", (m.num_heads * (m.qk_nope_head_dim + m.v_head_dim),
                                                          m.kv_lora_rank)).T.reshape(m.kv_lora_rank, m.num_heads, -1)),
    ("attn", "out", "kernel"): Rule(
        lambda m, w: {"self_attn.o_proj.weight": w.reshape(-1, w.shape[-1]).T},
        lambda m, get: get("self_attn.o_proj.weight", (m.d_model, m.num_heads * m.v_head_dim)).T.reshape(
            m.num_heads, m.v_head_dim, m.d_model)),
    ("moe", "router_bias"): Rule(
        lambda m, w: {"mlp.gate.e_score_correction_bias": w},
        lambda m, get: get("mlp.gate.e_score_correction_bias", (m.num_experts,))),
    ("moe", "shared", "wi", "kernel"): Rule(
        lambda m, w: {"mlp.shared_experts.gate_proj.weight": w[:, 0].T, "mlp.shared_experts.up_proj.weight": w[:, 1].T},
        lambda m, get: np.stack([get(f"mlp.shared_experts.{p}_proj.weight", (m.shared_d_ff, m.d_model)).T
                                 for p in ("gate", "up")], axis=1)),
    ("moe", "shared", "wo", "kernel"): Rule(
        lambda m, w: {"mlp.shared_experts.down_proj.weight": w.T},
        lambda m, get: get("mlp.shared_experts.down_proj.weight", (m.d_model, m.shared_d_ff)).T),
}
# A multi-token-prediction module's own tensors (below its layer's prefix, `mtp_prefix`), as DeepSeek's checkpoints
# keep them: the module after the decoder's last layer is `model.layers.{num_layers}`. Its embedding and head are
# the model's (copies `MTP_SHARED` in the checkpoint).
_MTP_RULES = {
    ("embed_norm", "scale"): _norm("enorm.weight"),
    ("hidden_norm", "scale"): _norm("hnorm.weight"),
    ("out_norm", "scale"): _norm("shared_head.norm.weight"),
    ("proj", "kernel"): Rule(lambda m, w: {"eh_proj.weight": w.T},
                             lambda m, get: get("eh_proj.weight", (m.d_model, 2 * m.d_model)).T),
}
MTP_SHARED = ("embed_tokens.weight", "shared_head.head.weight")

# family -> (architecture, model_type).
FAMILIES = {"llama": ("LlamaForCausalLM", "llama"), "mixtral": ("MixtralForCausalLM", "mixtral"),
            "qwen3": ("Qwen3ForCausalLM", "qwen3"), "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
            "deepseek_v3": ("DeepseekV3ForCausalLM", "deepseek_v3")}
_MOE_RULES["deepseek_v3"] = _MOE_RULES["qwen3_moe"]  # The routed experts' tensors are named alike.
# Tensors a family keeps in float32 whatever the export's dtype (transformers' `_keep_in_fp32_modules_strict`):
# DeepSeek-V3's router kernel and its score-correction bias, whose small updates bf16 would round away.
FLOAT32_TENSORS = {"deepseek_v3": ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")}


def export_dtype(m: ModelConfig, name: str, dtype: np.dtype) -> np.dtype:
  """The dtype HF tensor `name` is exported in, for an export in `dtype`."""
  return np.dtype(np.float32) if name.endswith(FLOAT32_TENSORS.get(family(m), ())) else dtype


def family(m: ModelConfig) -> str:
  if m.is_mla:
    return "deepseek_v3"
  if m.qk_norm:
    return "qwen3_moe" if m.is_moe else "qwen3"
  return "mixtral" if m.is_moe else "llama"


def layer_rules(m: ModelConfig) -> dict[tuple, Rule]:
  """The rules of one layer's tensors in `m`'s family."""
  if family(m) == "deepseek_v3":
    return {**LAYER_RULES, **_MOE_RULES["deepseek_v3"], **_DEEPSEEK_RULES}
  return {**LAYER_RULES, **_MOE_RULES.get(family(m), {}), **(_HEAD_NORMS if m.qk_norm else {})}


def mtp_prefix(m: ModelConfig, depth: int) -> str:
  """The HF prefix of multi-token-prediction module `depth` (0-based)."""
  return layer_prefix(m.num_layers + depth)


def _prefixed(rule: Rule, prefix: str) -> Rule:
  """`rule` with every HF name below `prefix`."""
  return Rule(lambda m, w: {prefix + k: v for k, v in rule.to_hf(m, w).items()},
              lambda m, get: rule.from_hf(m, lambda name, shape: get(prefix + name, shape)))

TOP_RULES = {
    ("embed", "embedding"): Rule(
        lambda m, w: {"model.embed_tokens.weight": w},
        lambda m, get: get("model.embed_tokens.weight", (m.vocab_size, m.d_model))),
    ("final_norm", "scale"): _norm("model.norm.weight"),
    ("lm_head", "kernel"): Rule(
        lambda m, w: {"lm_head.weight": w.T}, lambda m, get: get("lm_head.weight", (m.vocab_size, m.d_model)).T),
}


def layer_prefix(layer: int) -> str:
  return f"model.layers.{layer}."


def unsupported(m: ModelConfig) -> str | None:
  """Why this architecture has no form in any family of `FAMILIES` (None if it has one)."""
  if family(m) == "deepseek_v3":
    return _unsupported_by_deepseek(m)
  deepseek = next((f"{key} = {value}" for key, value in (
      ("model.router_score", m.router_score), ("model.n_group", m.n_group), ("model.num_shared_experts",
      m.num_shared_experts), ("model.first_k_dense", m.first_k_dense), ("model.routed_scaling_factor",
      m.routed_scaling_factor)) if value not in ("softmax", 1, 0, 1.0)), None)
  if m.is_moe and deepseek:
    return f"DeepSeek-V3's routing ({deepseek}) without its latent attention has no Hugging Face family here"
  if m.shared_expert_d_ff:
    return "an MoE with a shared expert (model.shared_expert_d_ff > 0) has no Mixtral or Qwen3-MoE form"
  if m.is_moe and m.moe_every != 1:
    return f"dense layers between MoE layers (model.moe_every = {m.moe_every}) have no Mixtral or Qwen3-MoE form"
  if m.is_moe and family(m) == "mixtral" and not m.norm_topk_prob:
    return "top-k weights left unrenormalised (model.norm_topk_prob = false) have no Mixtral form: it renormalises"
  return None


def _unsupported_by_deepseek(m: ModelConfig) -> str | None:
  """What DeepseekV3ForCausalLM cannot say of an MLA model."""
  if not m.is_moe:
    return "a dense model with latent attention has no DeepseekV3 form (it has MoE layers past first_k_dense)"
  if m.moe_every != 1:
    return f"dense layers between MoE layers (model.moe_every = {m.moe_every}) have no DeepseekV3 form"
  if m.router_score != "sigmoid":
    return "DeepseekV3 routes by sigmoid scores: model.router_score must be sigmoid"
  if m.shared_expert_d_ff or not m.num_shared_experts:
    return "DeepseekV3's shared experts are model.num_shared_experts >= 1 of d_ff (not model.shared_expert_d_ff)"
  return None


# --- ember -> Hugging Face -------------------------------------------------------------------------


def to_hf(m: ModelConfig, recipe: Recipe, params: dict) -> dict[str, np.ndarray]:
  """HF tensors (name -> host array, in the parameters' dtype) from ember's parameter tree, in HF's order."""
  out = {}
  out.update(TOP_RULES[("embed", "embedding")].to_hf(m, np.asarray(params["embed"]["embedding"])))
  for slot in layer_slots(m, recipe):
    layer = params["segments"][slot.segment]["blocks"]["layers"][slot.j]
    for path, stacked in tree_leaves(layer):
      for name, w in layer_rules(m)[path].to_hf(m, np.asarray(stacked[slot.index])).items():
        out[layer_prefix(slot.layer) + name] = np.ascontiguousarray(w)
  out.update(TOP_RULES[("final_norm", "scale")].to_hf(m, np.asarray(params["final_norm"]["scale"])))
  if "lm_head" in params:
    out.update({k: np.ascontiguousarray(v) for k, v in
                TOP_RULES[("lm_head", "kernel")].to_hf(m, np.asarray(params["lm_head"]["kernel"])).items()})
  if family(m) == "deepseek_v3":
    for k, module in sorted(params.get("mtp", {}).items()):  # nnx.List's pure dict: {depth: module}.
      for path, w in tree_leaves(module):
        out.update({name: np.ascontiguousarray(a) for name, a in mtp_rule(m, ("mtp", k) + path).to_hf(m, w).items()})
      prefix = mtp_prefix(m, k)  # The shared embedding and head, copied as DeepSeek's checkpoints hold them.
      out[prefix + MTP_SHARED[0]] = out["model.embed_tokens.weight"]
      out[prefix + MTP_SHARED[1]] = out.get("lm_head.weight", out["model.embed_tokens.weight"])
  return out


def mtp_rule(m: ModelConfig, path: tuple) -> Rule:
  """The rule of a multi-token-prediction module's leaf at ("mtp", k, ...), its HF names in full."""
  k, rest = path[1], tuple(path[2:])
  rule = layer_rules(m)[rest[1:]] if rest[0] == "layer" else _MTP_RULES[rest]
  return _prefixed(rule, mtp_prefix(m, int(k)))


# --- Hugging Face -> ember -------------------------------------------------------------------------


def leaf_source(m: ModelConfig, recipe: Recipe, path: tuple) -> tuple[Rule, list[int] | None]:
  """For a leaf of ember's parameter tree: its rule and, for stacked layer leaves, the layer of each
  index of the leading axis (None for leaves outside the layers)."""
  if path[0] == "mtp":
    return mtp_rule(m, path), None
  layers = stacked_layers(m, recipe, path)
  return (TOP_RULES[tuple(path)] if layers is None else layer_rules(m)[within_layer(path)]), layers


# model.rope_* -> Hugging Face's "llama3" RoPE parameters (ember/layers/rope.py's rule is transformers' own).
_LLAMA3_ROPE = (("factor", "rope_scaling_factor"), ("low_freq_factor", "rope_low_freq_factor"),
                ("high_freq_factor", "rope_high_freq_factor"),
                ("original_max_position_embeddings", "rope_original_seq_len"))


def rope_parameters(m: ModelConfig) -> dict:
  """config.json's `rope_parameters` of the model: "default", or "llama3" with its scaling."""
  if not m.rope_scaling_factor:
    return {"rope_type": "default", "rope_theta": m.rope_theta}
  return {"rope_type": "llama3", "rope_theta": m.rope_theta, **{hf: getattr(m, ours) for hf, ours in _LLAMA3_ROPE}}


def _rope_mismatch(m: ModelConfig, rope: dict) -> str | None:
  """Why a directory's RoPE parameters are not the model's RoPE, or None."""
  kind = rope.get("rope_type") or rope.get("type") or "default"
  if kind not in ("default", "llama3"):
    return f"RoPE type {kind!r} is set; ember's RoPE is the default or Llama 3.1's (llama3)"
  if kind == "default":
    return None if not m.rope_scaling_factor else (
        f"RoPE has no scaling; config.model.rope_scaling_factor is {m.rope_scaling_factor!r} (set it to 0)")
  for hf, ours in _LLAMA3_ROPE:
    if hf in rope and not math.isclose(float(rope[hf]), float(getattr(m, ours)), rel_tol=1e-6):
      return f"RoPE's {hf} is {rope[hf]!r}, config.model.{ours} is {getattr(m, ours)!r}"
  return None


def hf_config(m: ModelConfig, dtype: str) -> dict:
  """config.json of the family's model (`FAMILIES`) with ember's shapes."""
  architecture, model_type = FAMILIES[family(m)]
  c = {
      "architectures": [architecture], "model_type": model_type,
      "vocab_size": m.vocab_size, "hidden_size": m.d_model, "intermediate_size": m.dense_width,
      "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
      "num_key_value_heads": m.num_kv_heads, "head_dim": m.head_dim, "hidden_act": "silu",
      "max_position_embeddings": m.seq_len, "rms_norm_eps": m.norm_eps,
      "rope_theta": m.rope_theta, "rope_parameters": rope_parameters(m),
      "tie_word_embeddings": m.tie_embeddings, "attention_bias": False, "attention_dropout": 0.0,
      "initializer_range": m.init_std, "use_cache": True, "dtype": dtype, "torch_dtype": dtype,
      # Document boundaries are segment ids; a tokenizer that ends documents with EOS names it (the export's).
      "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
  }
  if m.rope_scaling_factor:  # transformers before 5 reads the scaling from here.
    c["rope_scaling"] = rope_parameters(m)
  if family(m) == "deepseek_v3":
    c.update(num_key_value_heads=m.num_heads, head_dim=m.qk_rope_head_dim, moe_intermediate_size=m.d_ff,
             intermediate_size=m.dense_width, n_routed_experts=m.num_experts, num_experts_per_tok=m.experts_per_token,
             n_shared_experts=m.num_shared_experts, routed_scaling_factor=m.routed_scaling_factor,
             n_group=m.n_group, topk_group=m.topk_group, first_k_dense_replace=m.first_k_dense,
             norm_topk_prob=m.norm_topk_prob,
             q_lora_rank=m.q_lora_rank or None, kv_lora_rank=m.kv_lora_rank, qk_rope_head_dim=m.qk_rope_head_dim,
             qk_nope_head_dim=m.qk_nope_head_dim, v_head_dim=m.v_head_dim, rope_interleave=True,
             num_nextn_predict_layers=m.mtp_depth, pretraining_tp=1)
  elif family(m) == "qwen3_moe":  # Every layer MoE.
    c.update(num_experts=m.num_experts, num_experts_per_tok=m.experts_per_token, moe_intermediate_size=m.d_ff,
             norm_topk_prob=m.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False,
             router_aux_loss_coef=0.0, use_sliding_window=False, sliding_window=None)
  elif m.is_moe:
    c.update(num_local_experts=m.num_experts, num_experts_per_tok=m.experts_per_token, output_router_logits=False,
             sliding_window=None, router_jitter_noise=0.0)
  else:
    c.update(mlp_bias=False, pretraining_tp=1)
  return c


def _deepseek_mismatch(m: ModelConfig, hf: dict) -> str | None:
  """The first DeepSeek-V3 hyper-parameter of config.json that disagrees with ember's model."""
  if hf.get("norm_topk_prob", True) != m.norm_topk_prob:
    return f"norm_topk_prob is {hf.get('norm_topk_prob', True)!r}, config.model.norm_topk_prob is {m.norm_topk_prob!r}"
  if not hf.get("rope_interleave", True):
    return "rope_interleave is off; ember reads DeepSeek's interleaved RoPE layout"
  if hf.get("topk_method", "noaux_tc") != "noaux_tc" or hf.get("scoring_func", "sigmoid") != "sigmoid":
    return "topk_method / scoring_func are not DeepSeek-V3's (noaux_tc, sigmoid)"
  for key, mine, ours in (("q_lora_rank", m.q_lora_rank or None, "model.q_lora_rank"),
                          ("kv_lora_rank", m.kv_lora_rank, "model.kv_lora_rank"),
                          ("qk_rope_head_dim", m.qk_rope_head_dim, "model.qk_rope_head_dim"),
                          ("qk_nope_head_dim", m.qk_nope_head_dim, "model.qk_nope_head_dim"),
                          ("v_head_dim", m.v_head_dim, "model.v_head_dim"),
                          ("n_routed_experts", m.num_experts, "model.num_experts"),
                          ("n_shared_experts", m.num_shared_experts, "model.num_shared_experts"),
                          ("n_group", m.n_group, "model.n_group"), ("topk_group", m.topk_group, "model.topk_group"),
                          ("routed_scaling_factor", m.routed_scaling_factor, "model.routed_scaling_factor"),
                          ("first_k_dense_replace", m.first_k_dense, "model.first_k_dense")):
    if key in hf and hf[key] != mine:
      return f"{key} is {hf[key]!r}, config.{ours} is {mine!r}"
  return None


def config_mismatch(m: ModelConfig, hf: dict) -> str | None:
  """The first hyper-parameter of config.json that disagrees with ember's model (shapes are checked per tensor)."""
  model_type = hf.get("model_type")
  want_type = FAMILIES[family(m)][1]
  if model_type != want_type:
    kind = ("an MoE" if m.is_moe else "a dense") + (" QK-norm" if m.qk_norm else "")
    return f"model_type is {model_type!r}, {kind} ember model reads {want_type!r}"
  if want_type == "qwen3_moe" and hf.get("norm_topk_prob", False) != m.norm_topk_prob:
    return (f"norm_topk_prob is {hf.get('norm_topk_prob', False)!r}, config.model.norm_topk_prob is "
            f"{m.norm_topk_prob!r}")
  if want_type == "qwen3_moe" and (hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1):
    return "some layers are dense (mlp_only_layers, decoder_sparse_step): ember's Qwen3-MoE is MoE in every layer"
  if want_type == "deepseek_v3":
    problem = _deepseek_mismatch(m, hf)
    if problem:
      return problem
  rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}  # transformers reads rope_scaling first.
  theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
  problem = _rope_mismatch(m, rope)
  if problem:
    return problem
  eps = hf.get("rms_norm_eps", 1e-6)
  if abs(eps - m.norm_eps) > 1e-6 * max(abs(m.norm_eps), 1e-12):
    return f"rms_norm_eps is {eps!r}, config.model.norm_eps is {m.norm_eps!r}"
  if hf.get("sliding_window") and hf["sliding_window"] < m.seq_len:
    return f"sliding_window is {hf['sliding_window']}; ember's attention sees the whole sequence ({m.seq_len})"
  heads = [] if m.is_mla else [("num_key_value_heads", m.num_kv_heads, "model.num_kv_heads"),
                               ("head_dim", m.head_dim, "model.head_dim")]
  checks = [("num_attention_heads", m.num_heads, "model.num_heads"), *heads,
            ("rope_theta", m.rope_theta, "model.rope_theta"),
            ("tie_word_embeddings", m.tie_embeddings, "model.tie_embeddings")]
  values = {**hf, "rope_theta": theta, "head_dim": hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
            "num_key_value_heads": hf.get("num_key_value_heads") or hf["num_attention_heads"],
            "tie_word_embeddings": hf.get("tie_word_embeddings", False)}
  if m.is_moe:
    checks.append(("num_experts_per_tok", m.experts_per_token, "model.experts_per_token"))
  for key, mine, ours in checks:
    if key in values and values[key] != mine:
      return f"{key} is {values[key]!r}, config.{ours} is {mine!r}"
  if hf.get("hidden_act", "silu") != "silu":
    return f"hidden_act is {hf['hidden_act']!r}; ember's MLP is SwiGLU (silu)"
  if hf.get("attention_bias") or hf.get("mlp_bias"):
    return "attention or MLP biases are set; ember's projections have none"
  return None
