"""`python -m ember.tools.remat_report`: the contract's JSON fields and the printed table."""

import json
import os
import subprocess
import sys

import pytest

from ember.tools import remat_report
from tests.helpers import ROOT
from tests.xla_cpu import FAST_CPU_CODEGEN

FIELDS = {"policy", "residual_bytes_per_layer", "residuals", "recomputed_quantize_ops_per_layer", "flops_per_step",
          "peak_bytes"}
# One CPU device, cheaper code generation (memory analysis and FLOPs are unchanged).
ENV = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_CPU_CODEGEN)


@pytest.mark.long
def test_report_writes_the_contract_json_and_a_table(tmp_path):
  out = tmp_path / "remat.json"
  proc = subprocess.run([sys.executable, "-m", "ember.tools.remat_report", "--config=configs/default.py:tiny",
                         "--config.quant.recipe=fp8_current", "--config.data.source=synthetic",
                         "--policies=none,save_quantized", f"--out={out}"],
                        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr
  report = json.loads(out.read_text())
  rows = {r["policy"]: r for r in report["policies"]}
  assert list(rows) == ["none", "save_quantized"]
  for r in rows.values():
    assert FIELDS <= set(r), set(r)
    assert r["peak_bytes"] > 0 and r["flops_per_step"] > 0
    assert r["residual_bytes_per_layer"] == sum(x["bytes"] for x in r["residuals"])
    for x in r["residuals"]:
      assert {"name", "dtype", "shape", "bytes"} <= set(x)
  sq, none = rows["save_quantized"], rows["none"]
  assert sq["recomputed_quantize_ops_per_layer"] == 0 and sq["recomputed_gemms_per_layer"] == 3
  assert sq["flops_per_step"] > none["flops_per_step"]  # The recompute.
  assert sq["recomputed_flops_per_step"] == sq["flops_per_step"] - none["flops_per_step"]
  assert sq["peak_bytes"] < none["peak_bytes"]
  assert sq["residual_bytes_per_layer"] < none["residual_bytes_per_layer"]
  # The table: a header, a rule, one line per policy; then bytes per residual name.
  lines = proc.stdout.splitlines()
  header = next(i for i, l in enumerate(lines) if l.startswith("policy"))
  assert "residuals/layer" in lines[header] and "peak/device" in lines[header]
  assert lines[header + 2].split()[0] == "none" and lines[header + 3].split()[0] == "save_quantized"
  assert any(l.startswith("quantized.wo.x ") for l in lines)


def test_unknown_policy_exits_2(tmp_path, capsys):
  with pytest.raises(SystemExit) as exit_:
    remat_report.main(["remat_report", f"--config={ROOT}/configs/default.py:tiny", "--policies=full,fastest",
                       f"--out={tmp_path}/r.json"])
  assert exit_.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err == ["error: --policies: unknown policy 'fastest'; choose from " + ", ".join(
      list(remat_report.remat.PRESETS) + ["custom"])]
