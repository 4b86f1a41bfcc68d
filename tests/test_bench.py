"""The benchmark tool runs a config and reports its figures; GEMM kinds are read from HLO text."""

import json

from ember.tools import bench
from tests.helpers import ROOT


def test_gemm_counts_reads_cublas_fp8_calls():
  hlo = ('%a = (bf16[8,8]{1,0}, s8[0]{0}) custom-call(f8e4m3fn[8,8]{1,0} %x, f8e4m3fn[8,8]{1,0} %y), '
         'custom_call_target="__cublas$lt$matmul$f8"\n'
         '%b = (bf16[8,8]{1,0}, s8[0]{0}) custom-call(bf16[8,8]{1,0} %x, bf16[8,8]{1,0} %y), '
         'custom_call_target="__cublas$gemm"\n'
         '%c = f32[8,8]{1,0} dot(f32[8,8]{1,0} %x, f32[8,8]{1,0} %y), lhs_contracting_dims={1}')
  counts = bench.gemm_counts(hlo)
  assert counts["fp8_gemms"] == 1 and counts["dots"] == 1


def test_bench_runs_a_tiny_config(tmp_path, capsys):
  out = tmp_path / "bench.json"
  rc = bench.main(["bench", f"--config={ROOT}/configs/default.py:tiny", "--config.quant.recipe=fp8_current",
                   "--steps=2", "--warmup=1", f"--out={out}"])
  assert rc == 0
  result = json.loads(out.read_text())
  assert result["recipe"] == "fp8_current" and result["step_time_s"] > 0 and result["tokens_per_s"] > 0
  assert result["peak_source"] == "compiled" and result["peak_bytes"] > 0
  assert result["dots"] > 0 and result["fp8_gemms"] == 0  # CPU: no cuBLASLt.
