"""The benchmark tool runs a config and reports its figures; GEMM kinds are read from HLO text."""

import json
import statistics

import pytest

from ember.tools import bench
from tests.helpers import ROOT


def test_gemm_counts_reads_cublas_fp8_calls():
  hlo = ("ENTRY %m () -> f32[8,8] {\n"
         "  %x = f8e4m3fn[8,8]{1,0} parameter(0)\n  %y = f8e4m3fn[8,8]{1,0} parameter(1)\n"
         "  %u = bf16[8,8]{1,0} parameter(2)\n  %v = f32[8,8]{1,0} parameter(3)\n"
         '  %a = (bf16[8,8]{1,0}, s8[0]{0}) custom-call(%x, %y), custom_call_target="__cublas$lt$matmul$f8"\n'
         '  %b = (bf16[8,8]{1,0}, s8[0]{0}) custom-call(%u, %u), custom_call_target="__cublas$gemm"\n'
         "  ROOT %c = f32[8,8]{1,0} dot(%v, %v), lhs_contracting_dims={1}, rhs_contracting_dims={0}\n}")
  counts = bench.gemm_counts(hlo)
  assert counts == {"fp8_gemms": 1, "mxfp8_gemms": 0, "nvfp4_gemms": 0, "bf16_gemms": 1, "f32_gemms": 1,
                    "emulated_gemms": 0, "attention": "xla"}


def test_the_floor_of_the_timed_program_on_the_gpu_it_ran_on():
  """The compile report's floor (ember.program.cost) of the HLO bench timed, with the peaks of the GPU named by its
  device_kind and that GPU's HBM bandwidth, per device of the step; nulls for a device ember has no facts for."""
  from ember import hardware
  from ember.config import derive
  from ember.trainer.perf import train_flops_per_step
  from tests.helpers import config

  hlo = ("ENTRY %m () -> bf16[4096,4096] {\n"
         "  %x = f8e4m3fn[4096,8192]{1,0} parameter(0)\n  %y = f8e4m3fn[8192,4096]{1,0} parameter(1)\n"
         '  %a = (bf16[4096,4096]{1,0}, s8[0]{0}) custom-call(%x, %y), custom_call_target="__cublas$lt$matmul$f8", '
         'backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"]}}}\n'
         "  ROOT %c = bf16[4096,4096]{1,0} get-tuple-element(%a), index=0\n}")
  cfg = derive(config("tiny"), 1)
  got = bench.measured_floor(hlo, cfg, "NVIDIA H100 80GB HBM3", 2, step_time_s=0.5)
  h100 = hardware.gpu("h100")
  fp8_gemm = max(2 * 4096 * 8192 * 4096 / h100.facts.peak_flops("fp8"),
                 (2 * 4096 * 8192 + 2 * 4096**2) / h100.hbm_bytes_per_s)  # Its FLOPs, or its bytes (1-byte inputs).
  assert got["time_floor_s"] == pytest.approx(fp8_gemm, rel=1e-6)
  assert got["step_over_floor"] == pytest.approx(0.5 / fp8_gemm)
  assert got["mfu_ceiling"] == pytest.approx(train_flops_per_step(cfg) / 2 / fp8_gemm / h100.facts.peak_flops("bf16"))
  assert got["time_floor_parts_s"]["memory"] == 0 and got["time_floor_parts_s"]["collectives"] == 0
  # The predicted step of the same program: the GEMM at the H100's achievable FP8 rate (4096 x 4096 in 128 x 256
  # tiles: 512 tiles in 4 waves of 132 SMs), or its bytes at its achievable bandwidth, plus a launch.
  rates = hardware.rates("h100")
  predicted = max(2 * 4096 * 8192 * 4096 / (h100.facts.peak_flops("fp8") * rates["gemm_fp8"] * 512 / (4 * 132)),
                  (2 * 4096 * 8192 + 2 * 4096**2) / (h100.hbm_bytes_per_s * rates["hbm"])) + rates["launch_s"]
  assert got["predicted_step_s"] == pytest.approx(predicted, rel=1e-6)
  assert got["step_over_predicted"] == pytest.approx(0.5 / predicted)
  assert bench.measured_floor(hlo, cfg, "cpu", 2, 0.5) == dict.fromkeys(got, None)
  assert bench.measured_floor(hlo, cfg, "NVIDIA A100-SXM4-80GB", 2, 0.5) == dict.fromkeys(got, None)  # No spec.


@pytest.mark.long
def test_bench_runs_a_tiny_config(tmp_path, capsys):
  out = tmp_path / "bench.json"
  rc = bench.main(["bench", f"--config={ROOT}/configs/default.py:tiny", "--config.quant.recipe=fp8_current",
                   "--steps=3", "--warmup=1", f"--out={out}", "--quant_stats"])
  assert rc == 0
  result = json.loads(out.read_text())
  assert result["recipe"] == "fp8_current" and result["step_time_s"] > 0 and result["tokens_per_s"] > 0
  assert result["peak_source"] == "compiled" and result["peak_bytes"] > 0
  assert result["bf16_gemms"] > 0 and result["fp8_gemms"] == 0  # CPU: dequantized bf16 dots, no cuBLASLt.
  assert result["time_floor_s"] is None and result["step_over_floor"] is None  # No GPU facts for a CPU.
  assert result["predicted_step_s"] is None and result["step_over_predicted"] is None
  assert result["schedules_predicted_s"] is None and result["scheduled_by_prediction"] is False  # Compiled once.
  assert result["missing_tensor_core_gemm"] is None
  # The reported step time is the median of the steps it measured (--steps=3 after the warmup).
  times, stats_times = result["step_times_s"], result["quant_stats_step_times_s"]
  assert len(times) == len(stats_times) == 3 and min(times + stats_times) > 0
  assert result["step_time_s"] == statistics.median(times)
  # --quant_stats: a second program, the step with the health statistics, measured on its own...
  assert result["health_figures"] == 0 and result["quant_stats_health_figures"] > 0
  assert stats_times != times
  # ...and the overhead is the ratio of the two programs' medians.
  assert result["quant_stats_step_time_s"] == statistics.median(stats_times)
  assert result["quant_stats_overhead"] == pytest.approx(statistics.median(stats_times) / statistics.median(times) - 1)
