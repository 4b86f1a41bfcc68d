"""Pick the layout to run a config with on a GPU cluster: the mesh inside and across nodes, the micro-batch and the
remat preset, by compiling the most promising ones for the target (ember/plan/planner.py says how).

  python -m ember.tools.plan --config=configs/default.py:llama3_70b --config.quant.recipe=fp8_current \
      --target=h100x64 [--budget_gb=72] [--top=6] [--out=plan.json]

Prints one line per compiled layout, a table ranked by the predicted tokens/s (ember/program/predict.py), with the
roofline ceiling beside it, and the winner's flags
(append them to the training command). `--budget_gb`: per-device memory the compiled peak must stay within
(default: the GPU's memory less 10%). Exits 0 with a winner, 1 when no compiled layout fits the budget, 2 for
bad input. `--out` JSON: `best` and `candidates` (ranked), each with its `flags`, `tokens_per_s_predicted`,
`mfu_predicted`, `predicted_step_s`, `exposed_collectives_s`, `tokens_per_s_ceiling`, `mfu_ceiling`, `peak_bytes`
and the quick `estimate` that chose it for compiling; a candidate whose compile failed has its `error`; and
`xla_flags`, the XLA flags the compiles ran under beyond ember's own (launch/xla_flags.sh's, when sourced first).
"""

from __future__ import annotations

import math
import sys

from ember import native_output
from ember.tools import target_env


def format_table(result: dict) -> str:
  gib = 2**30
  lines = [f"{'rank':>4} {'tokens/s/GPU':>12} {'MFU':>6} {'ceiling':>8} {'peak GiB':>8} {'est tok/s':>10}  layout"]
  for k, r in enumerate(result["candidates"], 1):
    if "fits" not in r:
      lines.append(f"{'-':>4} {'':>12} {'':>6} {'':>8} {'':>8} {r['estimate']['tokens_per_s']:>10,.0f}  "
                   f"{r['layout']}: {r['error']}")
      continue
    lines.append(f"{k:>4} {r['tokens_per_s_predicted']:>12,.0f} {r['mfu_predicted']:>6.1%} "
                 f"{r['tokens_per_s_ceiling']:>8,.0f} {r['peak_bytes'] / gib:>8.1f}{'' if r['fits'] else '!'} "
                 f"{r['estimate']['tokens_per_s']:>10,.0f}  {r['layout']}")
  best = result["best"]
  lines.append("(tokens/s/GPU and MFU: the predicted step; ceiling: the roofline's tokens/s; '!': over the budget; "
               "est: the quick estimate that chose the layout for compiling)")
  lines.append(f"best on {result['target']}: {best['tokens_per_s_predicted']:,.0f} tokens/s per GPU predicted "
               f"({best['tokens_per_s_ceiling']:,.0f} at most), peak {best['peak_bytes'] / gib:.1f} GiB of "
               f"{result['budget_bytes'] / gib:.1f}")
  lines.append("  " + " ".join(best["flags"]))
  # A compile's schedule, and so its prediction, depends on the XLA flags: the run should take the same ones.
  xla = " ".join(result["xla_flags"]) or "none beyond ember's own"
  lines.append(f"compiled under XLA flags: {xla} (launch under the same: docs/performance.md, \"XLA's scheduling "
               f"flags, layout by layout\")")
  return "\n".join(lines)


def main(argv: list[str]) -> int:
  target_env.prepare_environment(argv)
  from ember.errors import ArgumentParser, ConfigError, EmberError, fail_and_exit
  from ember.plan import planner
  from ember.plan import target as target_lib
  from ember.tools import cli

  parser = ArgumentParser(prog="python -m ember.tools.plan")
  parser.add_argument("--target", required=True, help="<gpu>x<count>, e.g. h100x64")
  parser.add_argument("--budget_gb", type=float, default=0.0, help="per-device memory budget, GiB (default: 90%% of "
                                                                    "the GPU's)")
  parser.add_argument("--top", type=int, default=planner.TOP, help="layouts compiled")
  parser.add_argument("--out", default="", help="JSON file to write")
  parser.add_argument("--plot", default="", help="PNG of the layouts' predicted tokens/s (ember/tools/figures.py)")
  try:
    own, config_argv = cli.split_config(argv)
    args = cli.parse(parser, own)
    if not (math.isfinite(args.budget_gb) and args.budget_gb >= 0):
      raise ConfigError(f"--budget_gb: must be a finite number of GiB >= 0 (0: the GPU's), got {args.budget_gb:g}")
    if args.top < 1:
      raise ConfigError(f"--top: must be at least 1, got {args.top}")
    target = target_lib.parse(args.target)
    cli.check_out_files({"--out": args.out, "--plot": args.plot})
    cfg = cli.settings(config_argv)
    try:
      result = planner.plan(cfg, target, budget_gb=args.budget_gb or None, top=args.top,
                            log=lambda s: print(s, file=sys.stderr, flush=True))
    except planner.NoLayoutFits as e:
      if args.out and e.result is not None:  # What was compiled, for the next attempt (`best` null).
        cli.write_json("--out", args.out, e.result)
      print(f"error: {e}", file=sys.stderr)
      return 1
    if args.out:
      cli.write_json("--out", args.out, result)
    if args.plot:
      from ember.tools import figures
      figures.layouts(result, args.plot)
  except EmberError as e:
    fail_and_exit(e)
  print(format_table(result))
  return 0


if __name__ == "__main__":
  native_output.quiet(sys.argv)
  sys.exit(main(sys.argv))
