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
from ember.model_config import ModelConfig



def forward_flops_per_token(model: ModelConfig) -> float:
  m, hd = model, model.head_dim
  attn_proj = m.d_model * (m.num_heads + 2 * m.num_kv_heads) * hd + m.num_heads * hd * m.d_model
  dense_mlp = 3 * m.d_model * m.d_ff
  moe_mlp = m.experts_per_token * m.expert_params + 3 * m.d_model * m.shared_expert_d_ff + m.d_model * m.num_experts
  layers_moe = m.num_moe_layers
  layers_dense = m.num_layers - layers_moe
  matmul_params = m.num_layers * attn_proj + layers_dense * dense_mlp + layers_moe * moe_mlp + m.d_model * m.vocab_size
  attention = m.num_layers * 2 * 2 * m.num_heads * hd * m.seq_len / 2  # QK^T and AV, causal half.
  return 2 * matmul_params + attention


def train_flops_per_step(cfg) -> float:
  return 3 * forward_flops_per_token(cfg.model) * cfg.train.batch_size * cfg.model.seq_len


def work_per_device(cfg, num_devices: int) -> dict[str, float]:
  """A step's model FLOPs and tokens per device: what the roofline and the prediction turn into MFU and tokens/s."""
  return {"model_flops": train_flops_per_step(cfg) / num_devices,
          "tokens": cfg.train.batch_size * cfg.model.seq_len / num_devices}


def peak_tflops(device_kind: str) -> float | None:
  """The device's dense bf16 peak (ember/hardware/facts.toml), which MFU is measured against whatever the
  recipe; None for a device not in the table."""
  facts = hardware.facts_for_kind(device_kind)
  return facts.tflops["bf16"] if facts else None


@dataclasses.dataclass(frozen=True)
class Throughput:
  """The figures of one step time, for a config on `num_devices` devices of `device_kind`."""
  step_time_s: float
  tokens_per_s: float
  tflops_per_device: float
  mfu: float | None  # None where the device's peak is unknown.

  @classmethod
  def of(cls, cfg, step_time_s: float, num_devices: int, device_kind: str) -> "Throughput":
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


def peak_bytes(compiled) -> tuple[int | None, str]:
  """(peak device bytes, source): the device's own statistic ("device") where it keeps one, else the
  compiled program's estimate ("compiled")."""
  stats = jax.local_devices()[0].memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    return int(stats["peak_bytes_in_use"]), "device"
  return compiled_peak_bytes(compiled), "compiled"
