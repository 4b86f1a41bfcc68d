"""A grid of training runs, each in its own process: step time against peak memory.

  python -m ember.tools.sweep --config=configs/default.py:1b \
      --grid=remat.policy=full,save_quantized,minimal --grid=quant.recipe=bf16,fp8_current \
      --steps=20 --out=runs/sweep [--config.KEY=VALUE ...] [--timeout=1800]

Every combination of the grids runs `python train.py --config=... <overrides>` with its own
workdir `OUT/<combination>/`, so one combination's crash, out-of-memory or leaked device memory
never touches another, and each compiles from scratch like a real job. The sweep then reads that
run's metrics.jsonl and writes
  OUT/results.json, OUT/results.csv   per combination: the overrides, status (ok | oom | error),
      step_time_s (median over the logged intervals after the first, which holds the first step's
      one-off costs; compilation happens before the loop), tokens_per_s, peak_bytes (the device's
      own peak statistic where it keeps one, e.g. GPUs, else XLA's compiled estimate: peak_source
      says which), final_loss, the exit code and, on failure, the last line of the log;
  OUT/sweep.png                       step time against peak memory, one labelled point per run;
  OUT/curves.png                      the fidelity report: train loss and eval loss against step, one
      line per combination (eval needs `--config.train.eval_every_steps=N`), so a recipe comparison,
      e.g. --grid=quant.recipe=bf16,fp8_current,nvfp4, is one command;
  OUT/logs/<combination>.log          each run's output.
A run is `oom` when it dies with an out-of-memory error (XLA's RESOURCE_EXHAUSTED), `error` for any
other failure (a timeout too); the sweep records it and carries on. Exit status 0 when at least one run finished,
1 when none did (the results are written either way), 2 for bad input.

Unless overridden, runs log every step, skip evaluation and save no checkpoint
(`checkpoint.every_steps=-1`): the sweep measures training steps, nothing else.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import time

from ember import native_output, storage
from ember.errors import ArgumentParser, ConfigError, fail_and_exit
from ember.plan.units import format_bytes
from ember.tools import cli

# A run stopped by a signal saves and exits: non-zero here, so that it is not taken for a finished one.
DEFAULTS = {"log.every_steps": "1", "train.eval_every_steps": "0", "checkpoint.every_steps": "-1",
            "log.tensorboard": "False", "train.preempted_exit_status": "143"}
FIELDS = ("status", "step_time_s", "tokens_per_s", "peak_bytes", "peak_source", "final_loss", "final_eval_loss",
          "returncode", "error", "wall_time_s", "workdir")
_OOM = re.compile(r"RESOURCE_EXHAUSTED|[Oo]ut of memory|OutOfMemory|\bOOM\b")
TRAIN_PY = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "train.py")


def parse_grid(specs: list[str]) -> list[tuple[str, list[str]]]:
  """`KEY=V1,V2` strings -> [(key, values)], keys in the order given."""
  grid = []
  for spec in specs:
    key, sep, values = spec.partition("=")
    key = key.strip().removeprefix("config.")
    vals = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or not key or not vals:
      raise ConfigError(f"--grid={spec}: expected KEY=V1,V2,...")
    if any(key == k for k, _ in grid):
      raise ConfigError(f"--grid={spec}: key {key} appears twice")
    if key in SWEEP_KEYS:
      raise ConfigError(f"--grid={spec}: {key} is the sweep's own ({SWEEP_KEYS[key]})")
    grid.append((key, vals))
  return grid


# Keys a run's command sets itself, whatever a grid or an override would say.
SWEEP_KEYS = {"steps": "--steps", "workdir": "each run's is OUT/<combination>"}


def refuse_fixed(fixed: dict[str, str], own: dict[str, str], tool: str) -> None:
  """ConfigError for a `--config.KEY` override of a key the tool sets for each run itself (`own`: key -> what
  sets it), which would be overwritten without a word."""
  for key in own.keys() & fixed.keys():
    raise ConfigError(f"--config.{key}: {tool} sets it for each run ({own[key]})")


def combinations(grid) -> list[dict[str, str]]:
  keys = [k for k, _ in grid]
  return [dict(zip(keys, values)) for values in itertools.product(*(v for _, v in grid))]


def combo_name(overrides: dict[str, str]) -> str:
  """A directory name for one combination: `remat.policy=full,quant.recipe=bf16`, made filesystem-safe."""
  return re.sub(r"[^A-Za-z0-9._=,+-]", "_", ",".join(f"{k}={v}" for k, v in overrides.items()))


def command(config: str, fixed: dict[str, str], overrides: dict[str, str], steps: int, workdir: str) -> list[str]:
  keys = {**DEFAULTS, **fixed, **overrides, "steps": str(steps), "workdir": workdir}
  return [sys.executable, TRAIN_PY, f"--config={config}"] + [f"--config.{k}={v}" for k, v in keys.items()]


def run_settings(cmd: list[str]) -> dict[str, str]:
  """What a train.py command runs, spelled one way: its flags and values, the config file and the workdir by
  their absolute paths (two spellings of one run are equal)."""
  out = {}
  for arg in cmd[2:]:
    key, _, value = arg.partition("=")
    if key == "--config":
      path, colon, preset = value.partition(":")
      value = os.path.abspath(path) + colon + preset
    elif key == "--config.workdir":
      value = os.path.abspath(value)
    out[key] = value
  return out


def logged_settings(out: str, name: str) -> dict[str, str] | None:
  """`run_settings` of the run `run_one` ran as `name` in OUT (OUT/logs/<name>.json), or None."""
  try:
    with open(os.path.join(out, "logs", f"{name}.json")) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def summarize(records: list[dict]) -> dict:
  """Figures of one finished run from its metrics records (train records only, eval ones skipped)."""
  train = [r for r in records if r.get("loss") is not None and r.get("step_time_s")]
  if not train:
    return {}
  timed = train[1:] or train  # The first interval holds the first step's one-off costs.
  step_time = statistics.median(r["step_time_s"] for r in timed)
  tokens_per_step = train[-1]["tokens_per_s"] * train[-1]["step_time_s"]
  evals = [r["eval_loss"] for r in records if r.get("eval_loss") is not None]
  return {"step_time_s": step_time, "tokens_per_s": tokens_per_step / step_time,
          "peak_bytes": train[-1].get("peak_bytes"), "peak_source": train[-1].get("peak_source"),
          "final_loss": train[-1]["loss"], "final_eval_loss": evals[-1] if evals else None}


def classify(returncode: int, output: str) -> str:
  """ok, oom or error from a run's exit status and what it printed (`_printed`: not the command echoed, whose
  paths and values may hold any word). A bad config (exit 2) is an error whatever it says."""
  if returncode == 0:
    return "ok"
  return "oom" if returncode != 2 and _OOM.search(output) else "error"


def _printed(log_text: str) -> str:
  """A run's log less the lines that echo its command: the log's first line and train.py's `starting (...)`."""
  lines = log_text.splitlines()[1:]
  return "\n".join(line for line in lines if "] ember: starting (" not in line)


def _last_line(text: str) -> str:
  lines = [l.strip() for l in text.splitlines() if l.strip()]
  return lines[-1][:300] if lines else ""


def run_one(config: str, fixed: dict, overrides: dict, steps: int, out: str, timeout: float | None,
            name: str | None = None) -> dict:
  """One run in its own process, its workdir OUT/<name> (default: the overrides spelled out), its log
  OUT/logs/<name>.log (its first line the command); the result: status, figures (`summarize`), where it ran."""
  from ember.trainer.metrics import read_records
  name = name or combo_name(overrides)
  os.makedirs(os.path.dirname(os.path.join(out, "logs", f"{name}.log")), exist_ok=True)
  workdir = os.path.join(out, name)
  log_path = os.path.join(out, "logs", f"{name}.log")
  cmd = command(config, fixed, overrides, steps, workdir)
  storage.write_atomic(os.path.join(out, "logs", f"{name}.json"), json.dumps(run_settings(cmd)))  # What ran there.
  t0 = time.time()
  with open(log_path, "w") as log:
    log.write(" ".join(cmd) + "\n")
    log.flush()
    try:
      rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
      timed_out = False
    except subprocess.TimeoutExpired:
      rc, timed_out = -9, True
  with open(log_path) as f:
    text = _printed(f.read())
  result = {"overrides": overrides, "status": "error" if timed_out else classify(rc, text), "returncode": rc,
            "workdir": workdir, "wall_time_s": time.time() - t0, "error": None}
  if result["status"] == "ok":
    records = read_records(os.path.join(workdir, "metrics.jsonl"))
    figures = summarize(records)
    last = max((r["step"] for r in records if r.get("loss") is not None), default=0)
    if not figures:
      result.update(status="error", error="the run logged no training step")
    elif last != steps:  # Stopped early, and exited 0 all the same (train.preempted_exit_status set so).
      result.update(status="error", error=f"stopped at step {last} of {steps}")
    result.update(figures)
  else:
    result["error"] = f"timed out after {timeout:g}s" if timed_out else _last_line(text)
  return result


def write_results(out: str, grid, results: list[dict]) -> None:
  # Each file replaced whole: a sweep killed while writing keeps what it measured before.
  storage.write_atomic(os.path.join(out, "results.json"),
                       json.dumps({"grid": {k: v for k, v in grid}, "results": results}, indent=1))
  keys = [k for k, _ in grid]
  rows = io.StringIO(newline="")
  w = csv.writer(rows)
  w.writerow(keys + list(FIELDS))
  for r in results:
    w.writerow([r["overrides"][k] for k in keys] + ["" if r.get(k) is None else r.get(k) for k in FIELDS])
  storage.write_atomic(os.path.join(out, "results.csv"), rows.getvalue())
  plot(os.path.join(out, "sweep.png"), grid, results)
  plot_curves(os.path.join(out, "curves.png"), grid, results)


def _labeller(grid):
  varied = [k for k, v in grid if len(v) > 1] or [k for k, _ in grid]
  return varied, lambda r: ", ".join(str(r["overrides"][k]) for k in varied)


def plot_curves(path: str, grid, results: list[dict]):
  """Train loss and eval loss against step, one line per run that logged any (failed runs too, up to where
  they stopped). Returns the (closed) Figure it saved: its axes are the train and the eval panel."""
  import matplotlib.pyplot as plt

  from ember.tools import figures  # Matplotlib (Agg) and `save`, imported where a figure is drawn.
  from ember.trainer.metrics import read_records
  varied, label = _labeller(grid)
  fig, (train_ax, eval_ax) = plt.subplots(1, 2, figsize=(13, 5))
  any_eval = False
  for r in results:
    records = read_records(os.path.join(r["workdir"], "metrics.jsonl"))
    train = [(x["step"], x["loss"]) for x in records if x.get("loss") is not None]
    evals = [(x["step"], x["eval_loss"]) for x in records if x.get("eval_loss") is not None]
    name = label(r) + ("" if r["status"] == "ok" else f" ({r['status']})")
    if train:
      line, = train_ax.plot(*zip(*train), label=name, linewidth=1)
      if evals:
        eval_ax.plot(*zip(*evals), marker="o", markersize=3, label=name, color=line.get_color())
        any_eval = True
  train_ax.set(xlabel="step", ylabel="train loss", title=f"train loss by {', '.join(varied)}")
  eval_ax.set(xlabel="step", ylabel="eval loss", title="eval loss")
  if not any_eval:
    eval_ax.text(0.5, 0.5, "no eval records\n(--config.train.eval_every_steps=N)", ha="center", va="center",
                 transform=eval_ax.transAxes)
  for ax in (train_ax, eval_ax):
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize=8)
  fig.tight_layout()
  figures.save(fig, path)
  return fig


def plot(path: str, grid, results: list[dict]) -> None:
  """Step time against peak memory, one labelled point per finished run; failures listed below."""
  import matplotlib.pyplot as plt

  from ember.tools import figures  # Matplotlib (Agg) and `save`, imported where a figure is drawn.
  varied, label = _labeller(grid)
  done = [r for r in results if r["status"] == "ok" and r.get("peak_bytes") is not None]
  fig, ax = plt.subplots(figsize=(8, 5.5))
  for r in done:
    x, y = r["peak_bytes"] / 2**20, r["step_time_s"] * 1e3
    ax.scatter([x], [y], s=30)
    ax.annotate(label(r), (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
  sources = sorted({r.get("peak_source") or "?" for r in done})
  ax.set_xlabel(f"peak memory per device, MiB ({' / '.join(sources) or 'no run finished'})")
  ax.set_ylabel("step time, ms (median)")
  ax.set_title(f"sweep over {', '.join(varied)}")
  ax.grid(True, alpha=0.3)
  failed = [f"{label(r)}: {r['status']}" for r in results if r["status"] != "ok"]
  if failed:
    fig.text(0.01, 0.01, "not plotted: " + "; ".join(failed), fontsize=7, wrap=True)
    fig.subplots_adjust(bottom=0.16)
  figures.save(fig, path)


def sweep(config: str, grid, steps: int, out: str, fixed: dict | None = None, timeout: float | None = None,
          log=print) -> list[dict]:
  os.makedirs(os.path.join(out, "logs"), exist_ok=True)
  results = []
  combos = combinations(grid)
  for i, overrides in enumerate(combos):
    log(f"[{i + 1}/{len(combos)}] {combo_name(overrides)}")
    r = run_one(config, fixed or {}, overrides, steps, out, timeout)
    results.append(r)
    figures = (f"{r['step_time_s'] * 1e3:.1f} ms/step, peak {format_bytes(r['peak_bytes'])} ({r['peak_source']})"
               if r["status"] == "ok" else r["error"])
    log(f"    {r['status']}: {figures}")
    write_results(out, grid, results)  # After every run, so a killed sweep keeps what it measured.
  return results


def check(config: str, grid, fixed: dict[str, str], steps: int, out: str) -> None:
  """Every combination's config, validated as train.py would before starting any run (the devices aside:
  the mesh's sizes are each run's to check), so a bad key, value or path is one line and exit 2 rather
  than a sweep of failed runs. A combination's workdir is its run's to check (it may be taken)."""
  from ember import config as config_lib
  for overrides in combinations(grid):
    argv = command(config, fixed, overrides, steps, out)[1:]
    try:
      config_lib.validate(config_lib.load(argv), num_devices=None, unread=False)  # Each run warns in its log.
    except ConfigError as e:
      named = any(f"config.{k}" in str(e) for k in overrides)  # Else the same error fails every run.
      raise ConfigError(f"{e} (the run {combo_name(overrides)})" if named else str(e)) from None


def check_fresh(grid, out: str) -> None:
  """No combination's workdir holds an earlier run: resumed, it would skip its compile and time other steps, or
  be finished already."""
  for overrides in combinations(grid):
    workdir = os.path.join(out, combo_name(overrides))
    if os.path.exists(os.path.join(workdir, "metrics.jsonl")) or os.path.isdir(os.path.join(workdir, "checkpoints")):
      raise ConfigError(f"--out: {workdir} holds an earlier run; a sweep times fresh runs: choose another --out "
                        "or remove it")


def _parse(argv: list[str]):
  parser = ArgumentParser(prog="python -m ember.tools.sweep")
  parser.add_argument("--config", required=True, help="config file[:arg], as for train.py")
  parser.add_argument("--grid", action="append", default=[], help="KEY=V1,V2,... (repeatable)")
  parser.add_argument("--steps", type=int, required=True, help="training steps per run")
  parser.add_argument("--out", required=True, help="output directory")
  parser.add_argument("--timeout", type=float, default=None, help="seconds per run (default: none)")
  args, fixed = cli.parse_with_overrides(parser, argv, "--grid, --steps, --out")
  if not args.grid:
    raise ConfigError("--grid: give at least one KEY=V1,V2,...")
  grid = parse_grid(args.grid)
  refuse_fixed(fixed, {**SWEEP_KEYS, **{k: f"--grid={k}=..." for k, _ in grid}}, "the sweep")
  if args.steps < 1:
    raise ConfigError(f"--steps: must be >= 1, got {args.steps}")
  if args.timeout is not None and not args.timeout > 0:
    raise ConfigError(f"--timeout: must be > 0 seconds, got {args.timeout:g}")
  cli.make_out_dir("--out", args.out)
  return args, grid, fixed


def main(argv: list[str]) -> int:
  try:
    args, grid, fixed = _parse(argv[1:])
    check(args.config, grid, fixed, args.steps, args.out)
    check_fresh(grid, args.out)
  except ConfigError as e:
    fail_and_exit(e)
  results = sweep(args.config, grid, args.steps, args.out, fixed, args.timeout)
  ok = sum(r["status"] == "ok" for r in results)
  print(f"{ok}/{len(results)} runs finished; results in {os.path.join(args.out, 'results.csv')}")
  return 0 if ok else 1


if __name__ == "__main__":
  native_output.quiet(sys.argv)
  sys.exit(main(sys.argv))
