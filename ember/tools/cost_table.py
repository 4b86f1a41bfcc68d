"""A markdown table of compile reports (`python -m ember.tools.compile ... --out=FILE.json`), one row each:
what the compiled step executes against the model's FLOPs, its time floor, its MFU and tokens/s ceilings, its
predicted step and tokens/s (ember/program/predict.py; "n/a" in a report from before it) and its peak memory on the
target; then, for reports of MoE models, one row each on their expert GEMMs: the
layout the layer ran (ember/layers/moe_dispatch.py), the rows each device's expert GEMMs hold and their executed
FLOPs by precision, read from the HLO.

  python -m ember.tools.cost_table reports/*.json
"""

from __future__ import annotations

import json
import sys

from ember import native_output
from ember.errors import ArgumentParser, ConfigError, EmberError, fail_and_exit
from ember.quant.recipe import GEMM_PRECISIONS
from ember.tools import cli

PRECISIONS = " / ".join(GEMM_PRECISIONS)
COLUMNS = ("model", "target", "recipe", "remat", "batch", f"GEMM TFLOP ({PRECISIONS})",
           "executed / model", "recompute TFLOP", "time floor (ms)", "MFU ceiling", "tokens/s/GPU ceiling",
           "predicted (ms)", "tokens/s/GPU predicted", "peak GiB")


def row(r: dict) -> list[str]:
  ex = r["executed_flops"]
  return [r["model"], r["target"], r["recipe"], r["remat_policy"], f"{r['batch_size']} x {r['seq_len']}",
          " / ".join(f"{ex[p] / 1e12:.0f}" for p in GEMM_PRECISIONS),
          f"{r['executed_over_model']:.2f}", f"{r['recompute_flops'] / 1e12:.0f}", f"{r['time_floor_s'] * 1e3:.0f}",
          f"{r['mfu_ceiling']:.1%}", f"{r['tokens_per_s_ceiling']:,.0f}",
          *((f"{r['predicted_step_s'] * 1e3:.0f}", f"{r['tokens_per_s_predicted']:,.0f}") if r.get("predicted_step_s")
            else ("n/a", "n/a")), f"{r['peak_bytes'] / 2**30:.1f}"]


MOE_COLUMNS = ("model", "target", "recipe", "exchange", "expert GEMMs", "rows / device", f"expert TFLOP ({PRECISIONS})", "largest per-expert copy of the rows", "executed / model", "time floor (ms)", "peak GiB")


def moe_row(r: dict) -> list[str]:
  moe = r["moe"]
  copy = moe.get("largest_expert_copy")
  return [r["model"], r["target"], r["recipe"], moe["dispatch"], moe["expert_gemm"], f"{moe['gemm_rows_per_rank']:,}",
          " / ".join(f"{moe['expert_gemm_flops'][p] / 1e12:.1f}" for p in GEMM_PRECISIONS),
          f"{copy['shape']} ({copy['bytes'] / 2**30:.2f} GiB)" if copy else "none", f"{r['executed_over_model']:.2f}",
          f"{r['time_floor_s'] * 1e3:.0f}", f"{r['peak_bytes'] / 2**30:.1f}"]


def _markdown(columns, rows) -> list[str]:
  return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)] + ["| " + " | ".join(r) + " |" for r in rows]


def table(reports: list[dict]) -> str:
  lines = _markdown(COLUMNS, [row(r) for r in reports])
  moe = [moe_row(r) for r in reports if r.get("moe")]
  if moe:
    lines += [""] + _markdown(MOE_COLUMNS, moe)
  return "\n".join(lines)


def main(argv: list[str]) -> int:
  parser = ArgumentParser(prog="python -m ember.tools.cost_table")
  parser.add_argument("reports", nargs="+", metavar="REPORT.json", help="ember.tools.compile --out files")
  try:
    args = cli.parse(parser, argv[1:])
    reports = []
    for path in args.reports:
      try:
        with open(path) as f:
          reports.append(json.load(f))
      except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not a compile report ({e})") from None
      if not isinstance(reports[-1], dict) or "executed_flops" not in reports[-1]:
        raise ConfigError(f"{path}: not a compile report (ember.tools.compile --out=FILE writes one)")
      if reports[-1].get("time_floor_s") is None:
        raise ConfigError(f"{path}: no time floor (a report for a GPU target is needed)")
  except EmberError as e:
    fail_and_exit(e)
  print(table(reports))
  return 0


if __name__ == "__main__":
  native_output.quiet(sys.argv)
  sys.exit(main(sys.argv))
