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


def test_bench_runs_a_tiny_config(tmp_path, capsys):
  out = tmp_path / "bench.json"
  rc = bench.main(["bench", f"--config={ROOT}/configs/default.py:tiny", "--config.quant.recipe=fp8_current",
                   "--steps=3", "--warmup=1", f"--out={out}", "--quant_stats"])
  assert rc == 0
  result = json.loads(out.read_text())
  assert result["recipe"] == "fp8_current" and result["step_time_s"] > 0 and result["tokens_per_s"] > 0
  assert result["peak_source"] == "compiled" and result["peak_bytes"] > 0
  assert result["bf16_gemms"] > 0 and result["fp8_gemms"] == 0  # CPU: dequantized bf16 dots, no cuBLASLt.
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
