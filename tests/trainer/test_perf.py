"""FLOPs from the shapes of a hand-computed config, the MFU peak table, and throughput figures."""

import math

from ember.config import derive
from ember.trainer import perf
from tests.helpers import config


def test_flops_of_a_hand_computed_config():
  """tiny: 2 layers, d 64, 4 heads of 16, 2 kv heads, d_ff 128, vocab 256, seq 64; batch 8."""
  cfg = derive(config("tiny"), 1)
  d, layers, heads, kv, hd, ff, vocab, seq = 64, 2, 4, 2, 16, 128, 256, 64
  qkv = d * (heads + 2 * kv) * hd  # 64 * 8 * 16 = 8192
  out = heads * hd * d  # 4096
  mlp = 3 * d * ff  # 24576
  head = d * vocab  # 16384
  matmul = 2 * (layers * (qkv + out + mlp) + head)  # 2 * (2 * 36864 + 16384) = 180224
  attention = layers * 2 * 2 * heads * hd * seq / 2  # 16384
  assert matmul == 180224 and attention == 16384
  assert perf.forward_flops_per_token(cfg.model) == 196608
  assert perf.train_flops_per_step(cfg) == 3 * 196608 * 8 * 64


def test_moe_flops_count_routed_experts_and_router():
  cfg = derive(config("tiny_moe"), 1)  # 4 experts, top 2, every layer.
  m = cfg.model
  d, ff, layers = 64, 128, 2
  dense = derive(config("tiny", **{"model.seq_len": 64}), 1)
  delta = perf.forward_flops_per_token(m) - perf.forward_flops_per_token(dense.model)
  assert delta == 2 * layers * ((2 - 1) * 3 * d * ff + d * 4)


def test_peak_table_and_mfu():
  assert perf.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
  assert perf.peak_tflops("NVIDIA H200") == 989.0
  assert perf.peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
  assert perf.peak_tflops("NVIDIA B200") == 2250.0
  assert perf.peak_tflops("cpu") is None
  cfg = derive(config("tiny"), 1)
  t = perf.Throughput.of(cfg, step_time_s=0.5, num_devices=2, device_kind="NVIDIA H100 80GB HBM3")
  assert t.tokens_per_s == 8 * 64 / 0.5
  assert math.isclose(t.tflops_per_device, 3 * 196608 * 8 * 64 / 0.5 / 2 / 1e12)
  assert math.isclose(t.mfu, t.tflops_per_device / 989.0)
  assert perf.Throughput.of(cfg, 0.5, 1, "cpu").mfu is None
