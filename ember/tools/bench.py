"""Benchmark one config: step time, throughput, MFU, peak memory, and which GEMMs XLA chose.

  python -m ember.tools.bench --config=configs/default.py:1b --config.quant.recipe=fp8_current \
      --steps=20 [--warmup=3] [--out=bench.json] [--hlo_out=step.hlo.txt]

It compiles the real train step once, runs `warmup` steps, then times `steps` steps one by one
(each ends with a device sync) and prints one JSON object: the measured step times and their median,
tokens/s, TFLOP/s per device, MFU, the peak device memory (the device's own statistics where it has them,
the compiled estimate otherwise: `peak_source` says which), and a count of the GEMM kinds in the
optimised HLO. On a GPU, `fp8_gemms` > 0 shows that FP8 matmuls reached cuBLASLt's FP8 kernels, and
`missing_tensor_core_gemm` names the library call the GPU's low-precision tensor cores would run the recipe's
GEMMs through when the program has none (null otherwise). `health_figures` counts the quantization health
figures the step returned (0 unless log.quant_stats_every).
Synthetic data, so input reading never limits the figure.

On a GPU ember knows (ember/hardware/) and within one process, the JSON also holds the compile report's time floor
for the very program it timed (`ember.program.cost` on its optimised HLO and that GPU's peaks and bandwidths):
`time_floor_s`, `time_floor_parts_s`, `mfu_ceiling`, and `step_over_floor`, the measured step over that floor:
how far the real kernels are from the roofline; and the predicted step of that program (ember/program/predict.py at
the GPU's rates in ember/hardware/rates.toml): `predicted_step_s`, `mfu_predicted` and `step_over_predicted`,
the measured step over the prediction. The step timed is the one the run compiles (ember/program/schedule.py):
`schedules_predicted_s` holds the predictions of XLA's schedule and of the one told the predicted times, and
`scheduled_by_prediction` says whether the latter is the program timed (so that a GPU can tell whether it pays:
time it again with `--config.train.schedule_by_prediction=false`); `schedule_waits_s` is what XLA's schedule waits
on its transfers, predicted (under half a percent of the step, the step is compiled once and the first two are
null). Elsewhere these are null (false).

`--quant_stats` measures the step twice, without and with the quantization health statistics
(`log.quant_stats_every`, ember/quant/health.py), and adds the second program's step times, their
median, the count of health figures it returned and its relative cost: `quant_stats_step_times_s`,
`quant_stats_step_time_s`, `quant_stats_health_figures`, `quant_stats_overhead`.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import jax
import numpy as np

from ember import native_output, storage
from ember import hardware
from ember.config import Settings
from ember.data.pipeline import data_iterator, global_batch
from ember.errors import ArgumentParser, ConfigError, EmberError, fail_and_exit, out_of_memory_exit
from ember.parallel.sharding import batch_sharding, use_rules
from ember.plan.auto_remat import resolve
from ember.platform import target_platform
from ember.program import cost, hlo, predict
from ember.program.schedule import compile_scheduled
from ember.tools import cli
from ember.trainer import quant_stats
from ember.trainer import step as step_lib
from ember.trainer.loop import prepare
from ember.trainer.optimizer import make_optimizer
from ember.trainer.perf import Throughput, compiled_peak_bytes, peak_bytes, work_per_device
from ember.trainer.phase import missing_tensor_core_gemm
from ember.trainer.state import create_train_state

def gemm_counts(program: str | hlo.Program) -> dict[str, object]:
  """The compiled step's GEMMs by precision and its attention kernel (ember/program/hlo.py's rules);
  `fp8_gemms` > 0 on a GPU shows that FP8 matmuls reached cuBLASLt's FP8 kernels."""
  p = program if isinstance(program, hlo.Program) else hlo.Program(program)
  return {**{f"{precision}_gemms": n for precision, n in hlo.gemm_census(p).items()},
          "attention": hlo.attention(p)["kernel"]}


def measured_floor(program: str | hlo.Program, cfg: Settings, device_kind: str, num_devices: int,
                   step_time_s: float) -> dict:
  """The time floor and the predicted step of a timed program on the GPU it ran on (`device_kind`), and the
  measured step over each; nulls for a device ember has no facts for, or a job of several processes (whose
  devices' nodes it cannot tell)."""
  facts = hardware.facts_for_kind(device_kind)
  if facts is None or facts.name not in hardware.GPUS or jax.process_count() > 1:  # No spec: no HBM bandwidth.
    return {"time_floor_s": None, "time_floor_parts_s": None, "mfu_ceiling": None, "step_over_floor": None,
            "predicted_step_s": None, "mfu_predicted": None, "step_over_predicted": None}
  machine = cost.Machine.one_node(facts.name, num_devices)
  p = program if isinstance(program, hlo.Program) else hlo.Program(program)
  per_device = work_per_device(cfg, num_devices)
  floor = cost.roofline(p, hlo.gemms(p), hlo.attention_calls(p), machine=machine, **per_device)
  predicted = predict.predicted_step(p, machine, **per_device)
  return {k: floor[k] for k in ("time_floor_s", "time_floor_parts_s", "mfu_ceiling")} | {
      "step_over_floor": step_time_s / floor["time_floor_s"] if floor["time_floor_s"] else None,
      "predicted_step_s": predicted["predicted_step_s"], "mfu_predicted": predicted["mfu_predicted"],
      "step_over_predicted": step_time_s / predicted["predicted_step_s"] if predicted["predicted_step_s"] else None}


# Timed on synthetic data: the step, not the input pipeline.
SYNTHETIC = ("--config.data.source=synthetic", "--config.data.mixture=()")


def run(cfg: Settings, *, steps: int, warmup: int, hlo_out: str | None = None) -> dict:
  cfg, mesh = prepare(cfg)
  cfg = resolve(cfg, mesh)
  tx, schedule = make_optimizer(cfg)
  with use_rules(mesh, cfg.mesh.rules):
    graphdef, state, shardings = create_train_state(cfg, mesh, tx)
    step_fn = step_lib.jit_train_step(cfg, mesh, graphdef, tx, schedule, shardings)
    sharding = batch_sharding(cfg.mesh.rules_dict, mesh)
    it = data_iterator(cfg, "train", sharding)
    try:
      batch = global_batch(next(it), sharding, cfg.train.batch_size)
    finally:
      it.close()
    t0 = time.time()
    scheduled = compile_scheduled(step_fn.lower(state, batch), None, mesh, cfg.train.schedule_by_prediction)
    compiled = scheduled.compiled
    compile_s = time.time() - t0
    text = compiled.as_text()
    if hlo_out:
      storage.write_atomic(hlo_out, text)
    times = []
    for i in range(warmup + steps):
      t = time.perf_counter()
      state, metrics = compiled(state, batch)
      jax.block_until_ready(metrics["loss"])
      if i >= warmup:
        times.append(time.perf_counter() - t)
  perf = Throughput.of(cfg, statistics.median(times), jax.device_count(), jax.devices()[0].device_kind)
  memory, source = peak_bytes(compiled_peak_bytes(compiled))
  program = hlo.Program(text)  # Parsed once for the GEMM counts and the floor.
  # The quant/... health figures the measured step returned (0 without log.quant_stats_every).
  health = (len(quant_stats.summarize(jax.device_get(metrics["quant_stats"]), cfg.model, cfg.quant))
            if "quant_stats" in metrics else 0)
  return {
      "model": cfg.model.name, "recipe": cfg.quant.name, "remat": cfg.remat.policy,
      "device": jax.devices()[0].device_kind, "devices": jax.device_count(), "mesh": dict(mesh.shape),
      "batch_size": cfg.train.batch_size, "seq_len": cfg.model.seq_len, "compile_s": compile_s,
      **perf.to_dict(), "step_times_s": times, "step_time_iqr_s": float(np.subtract(*np.percentile(times, [75, 25]))),
      "health_figures": health, "peak_bytes": memory, "peak_source": source, "final_loss": float(metrics["loss"]),
      **gemm_counts(program),
      **measured_floor(program, cfg, jax.devices()[0].device_kind, jax.device_count(), perf.step_time_s),
      # On a GPU, the tensor-core GEMM call the recipe should reach and the program lacks (trainer/phase.py).
      "missing_tensor_core_gemm": missing_tensor_core_gemm(cfg, lambda: text) if target_platform() == "gpu" else None,
      # On a GPU ember has rates for: the predicted steps of XLA's schedule and of the one told the predicted times,
      # whether the program timed is the latter, and what XLA's waits on transfers (ember/program/schedule.py).
      "schedules_predicted_s": scheduled.predicted_s, "scheduled_by_prediction": scheduled.by_prediction,
      "schedule_waits_s": scheduled.waits_s,
  }


def with_quant_stats(config_argv: list[str], *, steps: int, warmup: int, hlo_out: str | None = None) -> dict:
  """`run` without and with quantization health statistics; the first's figures plus the second's step times,
  their median and its health figures."""
  off, on = (cli.settings(config_argv, *SYNTHETIC, f"--config.log.quant_stats_every={n}") for n in (0, 1))
  result = run(off, steps=steps, warmup=warmup, hlo_out=hlo_out)
  stats = run(on, steps=steps, warmup=warmup)
  result["quant_stats_step_times_s"] = stats["step_times_s"]
  result["quant_stats_step_time_s"] = stats["step_time_s"]
  result["quant_stats_health_figures"] = stats["health_figures"]
  result["quant_stats_overhead"] = stats["step_time_s"] / result["step_time_s"] - 1
  return result


def main(argv: list[str]) -> int:
  parser = ArgumentParser(prog="python -m ember.tools.bench")
  parser.add_argument("--steps", type=int, default=10, help="timed steps")
  parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
  parser.add_argument("--out", default="", help="JSON file to write")
  parser.add_argument("--hlo_out", default="", help="file for the optimised HLO text")
  parser.add_argument("--quant_stats", type=cli.boolean, nargs="?", const=True, default=False,
                      help="also time the step with the quantization health statistics")
  try:
    own, config_argv = cli.split_config(argv)
    args = cli.parse(parser, own)
    if args.steps < 1:
      raise ConfigError(f"--steps: must be at least 1, got {args.steps}")
    if args.warmup < 0:
      raise ConfigError(f"--warmup: must be at least 0, got {args.warmup}")
    cli.check_out_files({"--out": args.out, "--hlo_out": args.hlo_out})  # Before the work, not after it.
    timing = dict(steps=args.steps, warmup=args.warmup, hlo_out=args.hlo_out or None)
    if args.quant_stats:
      result = with_quant_stats(config_argv, **timing)
    else:
      result = run(cli.settings(config_argv, *SYNTHETIC), **timing)
    print(json.dumps(result, indent=2))
    if args.out:
      cli.write_json("--out", args.out, result)
  except EmberError as e:
    fail_and_exit(e)
  except Exception as e:  # XLA's out of memory: one line, exit 4, as train.py.
    return out_of_memory_exit(e)
  return 0


if __name__ == "__main__":
  native_output.quiet(sys.argv)
  sys.exit(main(sys.argv))
