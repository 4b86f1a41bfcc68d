"""Compile the train step a config would run for a target, without running it: will it fit, what runs.

  python -m ember.tools.compile --config=configs/default.py:llama3_8b --config.quant.recipe=fp8_current \
      --target=h100x8 [--out=report.json]

Targets: `cpu` (the local devices) or `<gpu>x<count>` (`h100x8` one node, `h100x16` two; gpu in
ember/plan/targets/). A GPU target needs JAX's CUDA plugin (launch/install_compile_plugin.sh), not a GPU.
Prints a short report; exits 0 when the step fits the target's device memory, 1 when it does not (one
line: "needs X GiB of Y"), 2 for bad input. The JSON fields are listed in ember/plan/compile.py.
"""

from __future__ import annotations

import sys

from ember.tools import target_env


def format_report(r: dict) -> str:
  gib = 2**30
  memory = "unknown" if r["device_memory_bytes"] is None else f"{r['device_memory_bytes'] / gib:.1f} GiB"
  collectives = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sorted(r["collectives"].items())) or "none"
  g = r["gemms"]
  attention = r["attention"] + (f" ({r['attention_note']})" if r.get("attention_note") else "")
  return "\n".join([
      f"{r['model']} on {r['target']} ({r['num_devices']} x {r['device_kind']}), mesh {r['mesh']}, recipe "
      f"{r['recipe']}, remat {r['remat_policy']}, batch {r['batch_size']} x {r['seq_len']}",
      f"  fits:        {'yes' if r['fits'] else 'NO'}: peak {r['peak_bytes'] / gib:.2f} GiB of {memory} per device",
      f"  memory:      arguments {r['argument_bytes'] / gib:.2f} GiB (parameters, optimizer state, batch), outputs "
      f"{r['output_bytes'] / gib:.2f} GiB ({r['alias_bytes'] / gib:.2f} aliased), temporaries "
      f"{r['temp_bytes'] / gib:.2f} GiB, host {r['host_bytes'] / gib:.2f} GiB",
      f"  GEMMs:       {g['fp8']} fp8, {g['bf16']} bf16, {g['f32']} f32 (each instruction once; a scan body once)",
      f"  attention:   {attention}",
      f"  collectives: {collectives} per device per step",
      *([f"  MoE:         dispatch {r['moe']['dispatch']} over {r['moe']['expert_parallel']} devices, "
         f"{r['moe']['gemm_rows_per_rank']:,} grouped-GEMM rows per device"] if r.get("moe") else []),
      f"  compiled in {r['compile_s']:.1f} s; memory is an estimate: {r['memory_note']}",
  ])


def main(argv: list[str]) -> int:
  target_env.prepare_environment(argv)
  import argparse
  import json

  from ember import config as config_lib
  from ember.errors import ConfigError, EmberError, fail_and_exit
  from ember.plan import target as target_lib
  from ember.plan.compile import compile_report

  parser = argparse.ArgumentParser(prog="python -m ember.tools.compile", allow_abbrev=False)
  parser.add_argument("--target", required=True, help="cpu or <gpu>x<count>, e.g. h100x8")
  parser.add_argument("--out", default="", help="JSON file to write")
  parser.add_argument("--hlo_out", default="", help="file for the optimised HLO text")
  try:
    args, unknown = parser.parse_known_args([a for a in argv[1:] if not a.startswith("--config")])
    if unknown:
      raise ConfigError(f"{unknown[0]}: unknown command-line argument")
    target = target_lib.parse(args.target)
    cfg = config_lib.load([argv[0]] + [a for a in argv[1:] if a.startswith("--config")])
    report = compile_report(cfg, target, hlo_out=args.hlo_out)
  except EmberError as e:
    fail_and_exit(e)
  except SystemExit as e:  # argparse: a missing --target.
    return 2 if e.code else 0
  if args.out:
    with open(args.out, "w") as f:
      json.dump(report, f, indent=1)
  print(format_report(report))
  if not report["fits"]:
    gib = 2**30
    print(f"error: needs {report['peak_bytes'] / gib:.2f} GiB of {report['device_memory_bytes'] / gib:.2f} GiB per "
          f"device on {report['target']}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
