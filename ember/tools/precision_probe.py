"""Which projections a recipe hurts most, at a checkpoint, and the `quant.exclude` that keeps them in bf16.

  python -m ember.tools.precision_probe --checkpoint=runs/default_small --recipe=nvfp4 [--batches=2]
      [--target_error=0.1] [--out=probe.json]

Prints, per layer and projection kind, the gradient error, the forward output error and the forward weight
error under the recipe
against a float32 unquantized reference on the same held-out batches, the whole model's gradient error,
and the `quant.exclude` value that brings it under `--target_error` (ember/plan/probe.py says how each is
measured). Runs on one device; the same numbers on a rerun.
"""

from __future__ import annotations

import sys

from ember import native_output


def main(argv: list[str]) -> int:
  from ember.errors import ArgumentParser, ConfigError, EmberError, fail_and_exit
  from ember.quant.recipe import QUANTIZED_RECIPES, SCHEMES
  from ember.tools import cli

  stateless = [r for r in QUANTIZED_RECIPES if not SCHEMES[r].delayed]
  parser = ArgumentParser(prog="python -m ember.tools.precision_probe")
  parser.add_argument("--checkpoint", required=True, help="workdir, checkpoints/ directory or step directory")
  parser.add_argument("--recipe", required=True, choices=stateless, help="the recipe to probe")
  parser.add_argument("--batches", type=int, default=2, help="held-out batches the errors are averaged over")
  parser.add_argument("--target_error", type=float, default=0.1, help="whole-model gradient error to get under")
  parser.add_argument("--out", default="", help="JSON file to write")
  try:
    args = cli.parse(parser, argv[1:])
    if args.batches < 1:
      raise ConfigError(f"--batches: {args.batches} must be at least 1")
    if not args.target_error > 0:
      raise ConfigError(f"--target_error: {args.target_error} must be > 0")
    cli.check_out_files({"--out": args.out})
    report = probe(args.checkpoint, args.recipe, batches=args.batches, target_error=args.target_error)
    if args.out:
      cli.write_json("--out", args.out, report)
  except EmberError as e:
    fail_and_exit(e)
  print(format_table(report))
  return 0


def probe(checkpoint: str, recipe: str, *, batches: int, target_error: float) -> dict:
  from ember.inference.checkpoint import load_model
  from ember.plan import probe as probe_lib
  from ember.quant.recipe import UNQUANTIZED
  from ember.trainer.metrics import progress
  from ember.trainer.state import split_model
  from flax import nnx

  trained, _, model = load_model(checkpoint, what="--checkpoint", recipe=UNQUANTIZED, one_device=True)
  _, params, quant_state, _ = split_model(model)
  p = probe_lib.Probe(trained, nnx.to_pure_dict(params), nnx.to_pure_dict(quant_state), batches, log=progress)
  found, whole, exclude, error = probe_lib.recommend(p, recipe, target_error)
  return {"checkpoint": checkpoint, "recipe": recipe, "batches": batches,
          "projections": [{"layer": f.layer, "kind": f.kind, "grad_error": f.grad_error,
                           "output_error": f.output_error, "weight_error": f.weight_error} for f in found],
          "whole_model_grad_error": whole, "target_error": target_error, "exclude": list(exclude),
          "exclude_grad_error": error}


def format_table(report: dict) -> str:
  lines = [f"{'layer':>5}  {'kind':<10} {'grad error':>10} {'output error':>12} {'weight error':>12}"]
  for row in sorted(report["projections"], key=lambda r: (r["layer"] is None, r["layer"] or 0, r["kind"])):
    layer = "head" if row["layer"] is None else str(row["layer"])
    lines.append(f"{layer:>5}  {row['kind']:<10} {row['grad_error']:>10.2%} {row['output_error']:>12.2%} "
                 f"{row['weight_error']:>12.2%}")
  lines.append(f"\nwhole-model gradient error under {report['recipe']}: {report['whole_model_grad_error']:.2%}")
  exclude = ", ".join(repr(e) for e in report["exclude"])
  lines.append(f"--config.quant.exclude=\"({exclude},)\" brings it to {report['exclude_grad_error']:.2%} "
               f"(target {report['target_error']:.2%})")
  return "\n".join(lines)


if __name__ == "__main__":
  native_output.quiet(sys.argv)
  sys.exit(main(sys.argv))
