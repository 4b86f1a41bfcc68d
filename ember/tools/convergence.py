"""Does low precision train as well as bf16? Each variant trained with each seed on the same data, each run in
its own process; each variant's late-training loss gap to bf16, with its standard error across seeds.

  python -m ember.tools.convergence --config=configs/default.py:small --steps=1000 --seeds=3 \
      --out=runs/convergence [--variants=bf16,fp8_current,...] [--variant='NAME:KEY=VALUE;KEY=VALUE'] \
      [--late=0.1] [--config.KEY=VALUE ...] [--timeout=SECONDS]

A variant is a name and the config keys it sets (`VARIANTS` below, or `--variant` for your own, e.g. the exclude
the precision probe recommends: `--variant='nvfp4_probe:quant.recipe=nvfp4;quant.exclude=("lm_head","layers[0]")'`).
`bf16` is the reference and always runs. Seed s runs every variant with `seed=s`: the same initial parameters and
the same batches, so the only difference within a seed is the arithmetic.

A run's late loss is its mean train loss over the last `--late` fraction of its steps (the logged steps there:
every step, as the sweep logs). Its gap is late / late(bf16, same seed) - 1, paired by seed; a variant's gap is the
mean over seeds and its standard error the seeds' standard deviation over sqrt(seeds). Writes
  OUT/convergence.json   every run's late loss and status, each variant's gap, standard error and overrides;
  OUT/convergence.md     the table;
  OUT/convergence.png    the train loss (mean over seeds, smoothed) by variant, and the gaps with their errors;
  OUT/<variant>/seed<s>/ each run's workdir, OUT/logs/ their output.
A variant with a failed run reports the seeds that finished. A run whose metrics already reach --steps (an earlier
invocation's, into the same --out) is kept and not run again: a stopped comparison goes on where it stopped.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys

from ember import native_output, storage
from ember.errors import ArgumentParser, ConfigError, fail_and_exit
from ember.quant.recipe import SCHEMES, UNQUANTIZED
from ember.tools import cli, sweep

REFERENCE = UNQUANTIZED


def _variants() -> dict[str, dict[str, str]]:
  """The variants that answer the question, by name: every recipe of the table; a format whose published
  recipe keeps some projections in bf16 (NVFP4: NVIDIA, "Pretraining Large Language Models with NVFP4", 2025,
  the LM head and the last blocks; here the last layer, a quarter of `small`'s four) twice, `NAME_paper` with
  that exclusion and `NAME_all` quantizing every projection."""
  out = {}
  for name, scheme in SCHEMES.items():
    if scheme.published_exclude is None:
      out[name] = {"quant.recipe": name}
    else:
      out[f"{name}_paper"] = {"quant.recipe": name, "quant.exclude": repr(scheme.published_exclude)}
      out[f"{name}_all"] = {"quant.recipe": name, "quant.exclude": "()"}
  return out


VARIANTS = _variants()


def parse_variant(spec: str) -> tuple[str, dict[str, str]]:
  """`NAME:KEY=VALUE;KEY=VALUE` -> (name, {key: value})."""
  name, sep, body = spec.partition(":")
  pairs = [p.strip() for p in body.split(";") if p.strip()]
  if not sep or not name.strip() or not pairs or any("=" not in p for p in pairs):
    raise ConfigError(f"--variant={spec}: expected NAME:KEY=VALUE[;KEY=VALUE...]")
  return name.strip(), {k.strip().removeprefix("config."): v.strip() for k, v in (p.split("=", 1) for p in pairs)}


def late_loss(records: list[dict], steps: int, late: float) -> float | None:
  """The mean train loss over the steps after (1 - late) * steps; None without any."""
  first = steps - max(1, round(late * steps))
  losses = [r["loss"] for r in records if r.get("loss") is not None and r.get("step", 0) > first]
  return statistics.fmean(losses) if losses else None


def gaps(late: dict[str, dict[int, float | None]]) -> dict[str, dict]:
  """Per variant: the gap to the reference (mean over the seeds both finished), its standard error, the seeds."""
  ref = late[REFERENCE]
  out = {}
  for name, by_seed in late.items():
    paired = [by_seed[s] / ref[s] - 1 for s in by_seed if by_seed[s] is not None and ref.get(s) is not None]
    out[name] = {"gap": statistics.fmean(paired) if paired else None,
                 "standard_error": statistics.stdev(paired) / math.sqrt(len(paired)) if len(paired) > 1 else None,
                 "seeds": len(paired),
                 "late_loss": statistics.fmean(v for v in by_seed.values() if v is not None)
                 if any(v is not None for v in by_seed.values()) else None}
  return out


def _runs(config: str, variants: dict[str, dict], seeds: list[int], steps: int, out: str, fixed: dict):
  """(variant, seed, run name, its overrides) of every run, each checked against what OUT holds: a run of another
  command there (another config, override or step count) is an error, its losses not this comparison's."""
  runs = []
  for seed, (name, overrides) in ((s, v) for s in seeds for v in variants.items()):
    run_name, run_overrides = f"{name}/seed{seed}", {**overrides, "seed": str(seed)}
    earlier = sweep.logged_settings(out, run_name)
    now = sweep.run_settings(sweep.command(config, fixed, run_overrides, steps, os.path.join(out, run_name)))
    if earlier is not None and earlier != now:
      differ = ", ".join(f"{k.removeprefix('--')}={earlier.get(k)}" for k in sorted(earlier.keys() | now.keys())
                         if earlier.get(k) != now.get(k))
      raise ConfigError(f"--out: {os.path.join(out, run_name)} holds a run of another command ({differ}); choose "
                        "another --out or remove it")
    runs.append((name, seed, run_name, run_overrides))
  return runs


def _finished(out: str, name: str, steps: int) -> dict | None:
  """A run an earlier invocation finished (its metrics reach `steps`; `_runs` checked it is this command's): kept,
  not run again, so an interrupted comparison goes on where it stopped and more seeds or variants add to it.
  Delete its directory to rerun it."""
  from ember.trainer.metrics import read_records
  workdir = os.path.join(out, name)
  if not any(r.get("step") == steps and r.get("loss") is not None
             for r in read_records(os.path.join(workdir, "metrics.jsonl"))):
    return None
  return {"status": "ok", "error": None, "workdir": workdir, "wall_time_s": None}


def run(config: str, variants: dict[str, dict], seeds: list[int], steps: int, out: str, fixed: dict,
        late: float, timeout: float | None, log=print) -> dict:
  from ember.trainer.metrics import read_records
  os.makedirs(out, exist_ok=True)
  planned = _runs(config, variants, seeds, steps, out, fixed)
  runs, late_by = [], {name: {} for name in variants}
  for i, (name, seed, run_name, run_overrides) in enumerate(planned):
    log(f"[{i + 1}/{len(planned)}] {name}, seed {seed}")
    r = _finished(out, run_name, steps) or sweep.run_one(config, fixed, run_overrides, steps, out, timeout,
                                                         name=run_name)
    loss = late_loss(read_records(os.path.join(r["workdir"], "metrics.jsonl")), steps, late) \
        if r["status"] == "ok" else None
    late_by[name][seed] = loss
    runs.append({"variant": name, "seed": seed, "status": r["status"], "late_loss": loss, "error": r["error"],
                 "workdir": r["workdir"], "wall_time_s": r["wall_time_s"]})
    log(f"    {r['status']}: " + (f"late loss {loss:.4f}" if loss is not None else str(r["error"])))
  report = {"config": config, "steps": steps, "seeds": seeds, "late_fraction": late, "fixed": fixed,
            "variants": {name: {"overrides": variants[name], **g} for name, g in gaps(late_by).items()},
            "runs": runs}
  storage.write_atomic(os.path.join(out, "convergence.json"), json.dumps(report, indent=1))
  storage.write_atomic(os.path.join(out, "convergence.md"), table(report) + "\n")
  plot(os.path.join(out, "convergence.png"), report)
  return report


def table(report: dict) -> str:
  pct = lambda x: "n/a" if x is None else f"{100 * x:+.2f}%"
  lines = [f"| variant | late loss | gap to {REFERENCE} | standard error | seeds | steps |", "|---|---:|---:|---:|---:|---:|"]
  for name, v in report["variants"].items():
    loss = "n/a" if v["late_loss"] is None else f"{v['late_loss']:.4f}"
    se = "n/a" if v["standard_error"] is None else f"{100 * v['standard_error']:.2f}%"
    lines.append(f"| {name} | {loss} | {pct(v['gap']) if name != REFERENCE else '(reference)'} | "
                 f"{se if name != REFERENCE else ''} | {v['seeds']} | {report['steps']} |")
  return "\n".join(lines)


def plot(path: str, report: dict) -> None:
  """Left: each variant's train loss against step, mean over its seeds, smoothed over 5% of the steps. Right: the
  gaps to the reference with one standard error."""
  import matplotlib.pyplot as plt

  from ember.tools import figures  # Matplotlib (Agg) and `save`, imported where a figure is drawn.
  import numpy as np
  from ember.trainer.metrics import read_records
  fig, (curves, bars) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})
  window = max(1, report["steps"] // 20)
  for name in report["variants"]:
    series = []
    for r in (r for r in report["runs"] if r["variant"] == name and r["status"] == "ok"):
      losses = {x["step"]: x["loss"] for x in read_records(os.path.join(r["workdir"], "metrics.jsonl"))
                if x.get("loss") is not None}
      series.append([losses.get(s, np.nan) for s in range(1, report["steps"] + 1)])
    if series:
      mean = np.nanmean(np.asarray(series, np.float64), axis=0)
      smooth = np.convolve(mean, np.ones(window) / window, mode="valid")
      curves.plot(np.arange(window, report["steps"] + 1), smooth, label=name, linewidth=1.2)
  curves.set(xlabel="step", ylabel=f"train loss (mean over seeds, {window}-step average)",
             title=f"{report['config']}: train loss by variant")
  late_start = report["steps"] * (1 - report["late_fraction"])
  curves.axvspan(late_start, report["steps"], color="grey", alpha=0.1, label="late window")
  names = [n for n, v in report["variants"].items() if n != REFERENCE and v["gap"] is not None]
  bars.bar(names, [100 * report["variants"][n]["gap"] for n in names],
           yerr=[100 * (report["variants"][n]["standard_error"] or 0) for n in names], capsize=4, color="tab:orange")
  bars.axhline(0, color="black", linewidth=0.8)
  bars.set(ylabel=f"late loss gap to {REFERENCE}, % (one standard error)",
           title=f"{len(report['seeds'])} seeds, last {report['late_fraction']:.0%} of {report['steps']} steps")
  bars.tick_params(axis="x", labelrotation=30)
  for ax in (curves, bars):
    ax.grid(True, alpha=0.3)
  curves.legend(fontsize=8)
  fig.tight_layout()
  figures.save(fig, path)


def _parse(argv: list[str]):
  parser = ArgumentParser(prog="python -m ember.tools.convergence")
  parser.add_argument("--config", required=True, help="config file[:arg], as for train.py")
  parser.add_argument("--steps", type=int, required=True, help="training steps per run")
  parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1, each run by every variant")
  parser.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
  parser.add_argument("--variant", action="append", default=[], help="NAME:KEY=VALUE[;KEY=VALUE] (repeatable)")
  parser.add_argument("--late", type=float, default=0.1, help="the late window: this fraction of the last steps")
  parser.add_argument("--out", required=True, help="output directory")
  parser.add_argument("--timeout", type=float, default=None, help="seconds per run (default: none)")
  args, fixed = cli.parse_with_overrides(parser, argv, "--steps, --seeds, --variants, --variant, --late, --out")
  if args.steps < 1:
    raise ConfigError(f"--steps: must be >= 1, got {args.steps}")
  if args.seeds < 1:
    raise ConfigError(f"--seeds: must be >= 1, got {args.seeds}")
  if not 0 < args.late <= 1:
    raise ConfigError(f"--late: a fraction of the steps in (0, 1], got {args.late:g}")
  names = [n.strip() for n in args.variants.split(",") if n.strip()]
  unknown_names = [n for n in names if n not in VARIANTS]
  if unknown_names:
    raise ConfigError(f"--variants: unknown {unknown_names[0]!r}; choose from {', '.join(VARIANTS)} or add "
                      "--variant=NAME:KEY=VALUE")
  variants = {REFERENCE: VARIANTS[REFERENCE], **{n: VARIANTS[n] for n in names}}
  for spec in args.variant:
    name, overrides = parse_variant(spec)
    if name in variants:
      raise ConfigError(f"--variant={spec}: the name {name!r} is taken")
    variants[name] = overrides
  # A key every variant sets (a key some set is the user's in the others).
  varied = {k: "every variant" for k in set.intersection(*(set(o) for o in variants.values()))}
  sweep.refuse_fixed(fixed, {**sweep.SWEEP_KEYS, "seed": "--seeds", **varied}, "the comparison")
  cli.make_out_dir("--out", args.out)
  for name, overrides in variants.items():  # Every run's config checked before any runs.
    try:
      sweep.check(args.config, [(k, [v]) for k, v in overrides.items()], fixed, args.steps, args.out)
    except ConfigError as e:
      raise ConfigError(f"{e} (variant {name})") from None
  return args, variants, fixed


def main(argv: list[str]) -> int:
  try:
    args, variants, fixed = _parse(argv[1:])
    # Its only ConfigError comes before any run starts: `_runs`, checking what --out holds.
    report = run(args.config, variants, list(range(args.seeds)), args.steps, args.out, fixed, args.late,
                 args.timeout)
  except ConfigError as e:
    fail_and_exit(e)
  print(table(report))
  print(f"in {os.path.join(args.out, 'convergence.md')} and convergence.png")
  return 0


if __name__ == "__main__":
  native_output.quiet(sys.argv)
  sys.exit(main(sys.argv))
