"""The large presets are the published models: their Hugging Face config.json (what `export_hf` writes) has the
published shapes, and a published config.json reads back as the preset or is refused in one line naming why."""

from __future__ import annotations

import pytest

import helpers
from ember.hf import layout

# From the published config.json files (meta-llama/Llama-3.1-405B, Qwen/Qwen3-235B-A22B), the shape keys.
PUBLISHED = {
    "llama3_405b": {"model_type": "llama", "hidden_size": 16384, "num_hidden_layers": 126, "num_attention_heads": 128,
                    "num_key_value_heads": 8, "intermediate_size": 53248, "vocab_size": 128256, "rope_theta": 500000.0,
                    "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
                    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    "qwen3_235b_a22b": {"model_type": "qwen3_moe", "hidden_size": 4096, "num_hidden_layers": 94,
                        "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
                        "moe_intermediate_size": 1536, "num_experts": 128, "num_experts_per_tok": 8,
                        "vocab_size": 151936, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "norm_topk_prob": True,
                        "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False,
                        "rope_scaling": None},
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_a_large_preset_exports_the_published_shapes(preset):
  m = helpers.settings(preset).model
  written = layout.hf_config(m, "bfloat16")
  published = PUBLISHED[preset]
  shapes = {k: v for k, v in published.items() if k != "rope_scaling"}
  assert {k: written[k] for k in shapes} == shapes


def test_qwen3_235b_a22b_reads_its_published_config():
  m = helpers.settings("qwen3_235b_a22b").model
  assert layout.config_mismatch(m, PUBLISHED["qwen3_235b_a22b"]) is None


def test_llama31_405b_reads_its_published_config_with_its_rope_scaling():
  """Llama 3.1's checkpoints carry the RoPE scaling of their 128k-token extension: the preset (its 8192-token
  pretraining, unscaled) is told so in one line naming the key, and reads the config with the scaling set; the
  export of that model writes the published RoPE parameters."""
  published = PUBLISHED["llama3_405b"]
  problem = layout.config_mismatch(helpers.settings("llama3_405b").model, published)
  assert problem == "RoPE's factor is 8.0, config.model.rope_scaling_factor is 0.0"
  scaled = helpers.settings("llama3_405b", **{"model.rope_scaling_factor": 8.0}).model
  assert layout.config_mismatch(scaled, published) is None
  written = layout.hf_config(scaled, "bfloat16")
  assert written["rope_parameters"] == written["rope_scaling"] == {**published["rope_scaling"], "rope_theta": 500000.0}
  other = dict(published, rope_scaling={"rope_type": "yarn", "factor": 4.0})
  assert layout.config_mismatch(scaled, other) == ("RoPE type 'yarn' is set; ember's RoPE is the default or Llama "
                                                   "3.1's (llama3)")
