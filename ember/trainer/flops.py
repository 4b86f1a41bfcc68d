"""Model FLOPs per step from the shapes, and MFU against a per-device peak.

Counts the matmuls of projections (active experts only for MoE), causal attention's two batched
matmuls (half the square) and the LM head; training = 3x the forward (forward + two backward
GEMMs). Rematerialisation's recompute is *not* counted: MFU measures useful work.
"""

from __future__ import annotations

from ember.config import num_moe_layers

# Dense bf16 peak TFLOP/s per device, matched against `device_kind` (lower-case substrings).
PEAK_BF16_TFLOPS = (("h200", 989.0), ("h100", 989.0), ("gh200", 989.0), ("b200", 2250.0), ("gb200", 2250.0),
                    ("a100", 312.0))


def forward_flops_per_token(model_cfg) -> float:
  m = model_cfg
  hd = m.head_dim or m.d_model // m.num_heads
  attn_proj = m.d_model * (m.num_heads + 2 * m.num_kv_heads) * hd + m.num_heads * hd * m.d_model
  dense_mlp = 3 * m.d_model * m.d_ff
  moe_mlp = m.experts_per_token * 3 * m.d_model * m.d_ff + 3 * m.d_model * m.shared_expert_d_ff + m.d_model * m.num_experts
  layers_moe = num_moe_layers(m)
  layers_dense = m.num_layers - layers_moe
  matmul_params = m.num_layers * attn_proj + layers_dense * dense_mlp + layers_moe * moe_mlp + m.d_model * m.vocab_size
  attention = m.num_layers * 2 * 2 * m.num_heads * hd * m.seq_len / 2  # QK^T and AV, causal half.
  return 2 * matmul_params + attention


def train_flops_per_step(cfg) -> float:
  return 3 * forward_flops_per_token(cfg.model) * cfg.train.batch_size * cfg.model.seq_len


def peak_tflops(device_kind: str) -> float | None:
  kind = device_kind.lower()
  for key, tflops in PEAK_BF16_TFLOPS:
    if key in kind:
      return tflops
  return None
