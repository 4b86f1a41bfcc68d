"""Throughput and memory figures of a run, in one place (the loop's progress line, `bench`, the planners).

FLOPs come from the shapes: the matmuls of projections (active experts only for MoE), causal
attention's two batched matmuls (half the square) and the LM head; training = 3x the forward
(forward + two backward GEMMs). Rematerialisation's recompute is *not* counted: MFU measures
useful work. Peak memory is the device's own statistic where it keeps one (GPUs), else XLA's
estimate for the compiled program.
"""

from __future__ import annotations

import dataclasses

import jax

from ember import hardware
from ember.config.model import ModelConfig
from ember.config import Settings



def forward_flops_per_token(model: ModelConfig) -> float:
  """A token's forward FLOPs: every projection (the active experts' alone), causal attention's two batched matmuls
  (half the square) and the LM head, for the decoder's layers and each multi-token-prediction module (its
  projection of [embedding; hidden], its layer, and the shared head once more), as Megatron counts them."""
  m = model
  layers = m.num_layers + m.mtp_depth
  moe_layers = sum(m.is_moe_layer(i) for i in range(layers))
  moe_mlp = m.experts_per_token * m.expert_params + 3 * m.d_model * m.shared_d_ff + m.d_model * m.num_experts
  matmul_params = (layers * attention_params(m) + (layers - moe_layers) * 3 * m.d_model * m.dense_width
                   + moe_layers * moe_mlp + m.mtp_depth * 2 * m.d_model * m.d_model)
  return 2 * matmul_params + attention_flops_per_token(m) + head_flops_per_token(m)


def attention_flops_per_token(m: ModelConfig) -> float:
  """Causal attention's QK^T and AV of a token, every layer (the prediction modules' too): half the square."""
  v = m.v_head_dim if m.is_mla else m.head_dim
  return (m.num_layers + m.mtp_depth) * 2 * m.num_heads * (m.qk_head_dim + v) * m.seq_len / 2


def head_flops_per_token(m: ModelConfig) -> float:
  """The LM head's forward FLOPs of a token: once, and once more per multi-token-prediction depth."""
  return (1 + m.mtp_depth) * 2 * m.d_model * m.vocab_size


def attention_params(m: ModelConfig) -> int:
  """One layer's attention projection weights: MLA's query path (through its latent or whole), latent
  down-projection with the RoPE key, its expansion into keys and values, and the output; else Q, K, V and O."""
  if not m.is_mla:
    return m.d_model * (m.num_heads + 2 * m.num_kv_heads) * m.head_dim + m.num_heads * m.head_dim * m.d_model
  n, qk = m.num_heads, m.qk_head_dim
  query = m.q_lora_rank * (m.d_model + n * qk) if m.q_lora_rank else m.d_model * n * qk
  latent = m.d_model * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * n * (m.qk_nope_head_dim + m.v_head_dim)
  return query + latent + n * m.v_head_dim * m.d_model


def train_flops_per_step(cfg: Settings) -> float:
  return 3 * forward_flops_per_token(cfg.model) * cfg.train.batch_size * cfg.model.seq_len


def work_per_device(cfg: Settings, num_devices: int) -> dict[str, float]:
  """A step's model FLOPs and tokens per device: what the roofline and the prediction turn into MFU and tokens/s."""
  return {"model_flops": train_flops_per_step(cfg) / num_devices,
          "tokens": cfg.train.batch_size * cfg.model.seq_len / num_devices}


def peak_tflops(device_kind: str) -> float | None:
  """The device's dense bf16 peak (ember/hardware/facts.toml), which MFU is measured against whatever the
  recipe; None for a device not in the table."""
  facts = hardware.facts_for_kind(device_kind)
  return facts.mfu_peak_flops / 1e12 if facts else None


@dataclasses.dataclass(frozen=True)
class Throughput:
  """The figures of one step time, for a config on `num_devices` devices of `device_kind`."""
  step_time_s: float
  tokens_per_s: float
  tflops_per_device: float
  mfu: float | None  # None where the device's peak is unknown.

  @classmethod
  def of(cls, cfg: Settings, step_time_s: float, num_devices: int, device_kind: str) -> "Throughput":
    tflops = train_flops_per_step(cfg) / step_time_s / num_devices / 1e12
    peak = peak_tflops(device_kind)
    return cls(step_time_s, cfg.train.batch_size * cfg.model.seq_len / step_time_s, tflops,
               None if peak is None else tflops / peak)

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


def memory_peak(m) -> int:
  """XLA's peak device bytes from a memory analysis: its buffer-assignment peak (what XLA's GPU compiler
  itself plans against) where that is a real peak, else arguments + outputs + temporaries - aliased.
  XLA:CPU reports a "peak" below its own temporary allocation (it leaves loop temporaries out): the
  sum is the figure there."""
  total = int(m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)
  peak = int(getattr(m, "peak_memory_in_bytes", 0) or 0)
  return peak if peak >= m.temp_size_in_bytes and peak > 0 else total


def host_bytes(m) -> int:
  """Host memory a compiled program uses per device (residuals offloaded by a remat policy), from its
  memory analysis."""
  return int(sum(getattr(m, f"host_{k}_size_in_bytes", 0) for k in ("argument", "output", "temp")))


def compiled_peak_bytes(compiled) -> int | None:
  """XLA's estimate of a compiled program's peak device memory (`memory_peak`); None where there is none."""
  try:
    return memory_peak(compiled.memory_analysis())
  except Exception:  # Backends without a memory analysis.
    return None


def peak_bytes(compiled_peak: int | None) -> tuple[int | None, str]:
  """(peak device bytes, source): the device's own statistic ("device") where it keeps one, else
  `compiled_peak`, the compiled program's estimate ("compiled": `compiled_peak_bytes`, read once per program; a
  CPU's memory analysis takes tens of milliseconds)."""
  stats = jax.local_devices()[0].memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    return int(stats["peak_bytes_in_use"]), "device"
  return compiled_peak, "compiled"
