"""Compile the train step a config would run for a target, without running it: will it fit, what runs.

  python -m ember.tools.compile --config=configs/default.py:llama3_8b --config.quant.recipe=fp8_current \
      --target=h100x8 [--out=report.json]

Targets: `cpu` (the local devices) or `<gpu>x<count>` (`h100x8` one node, `h100x16` two; gpu in
ember/hardware/: h100, h200, b200). A GPU target needs JAX's CUDA plugin (launch/install_compile_plugin.sh), not a GPU.
Prints a short report; exits 0 when the step fits the target's device memory, 1 when it does not (one
line: "needs X GiB of Y"), 2 for bad input. The JSON fields are listed in ember/plan/compile.py.
"""

from __future__ import annotations

import sys

from ember import native_output
from ember.tools import target_env


def _flops(x: float) -> str:
  """FLOPs with a unit: "421.6 TFLOP", "3.2 GFLOP"."""
  for scale, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M")):
    if x >= scale:
      return f"{x / scale:,.1f} {unit}FLOP"
  return f"{x:,.0f} FLOP"


def _ms(seconds: float) -> str:
  return f"{seconds * 1e3:,.4g} ms"


TOP_TIMES = 10  # Rows of `time_by_op` printed.


def _over_100(mfu: float) -> str:
  """Why an MFU can pass 100%: it is the model's FLOPs against the dense bf16 peak, whatever the recipe."""
  return " (of the dense bf16 peak, as MFU is measured: FP8 and FP4 GEMMs run faster than it)" if mfu > 1 else ""


def _work_lines(r: dict) -> list[str]:
  """Executed work against the model's, the time floor and its ceilings, where the bytes are."""
  ex = r["executed_flops"]
  by_precision = ", ".join(f"{k} {_flops(v)}" for k, v in ex.items() if v) or "none"
  if r.get("emulated_flops"):
    by_precision += f"; {_flops(r['emulated_flops'])} of it block-scaled GEMMs emulated in bf16"
  ratio = "n/a" if r["executed_over_model"] is None else f"{r['executed_over_model']:.2f}"
  lines = [f"  work:        GEMMs ({by_precision}) + attention {_flops(r['attention_flops'])} = {ratio} x the "
           f"model's {_flops(r['model_flops'])} per device per step; remat recomputes {_flops(r['recompute_flops'])}"]
  if r["time_floor_s"] is not None:
    parts = r["time_floor_parts_s"]
    host = f" and host transfers {_ms(parts['host'])}" if parts.get("host") else ""
    lines.append(f"  time floor:  {_ms(r['time_floor_s'])} a step (roofline: compute {_ms(parts['compute'])} + memory "
                 f"{_ms(parts['memory'])}, overlapped with collectives {_ms(parts['collectives'])}{host}; serial "
                 f"{_ms(r['time_serial_s'])}): MFU at most {r['mfu_ceiling']:.1%}{_over_100(r['mfu_ceiling'])}, at most "
                 f"{r['tokens_per_s_ceiling']:,.0f} tokens/s per device")
  if r.get("predicted_step_s"):
    lines.append(f"  predicted:   {_ms(r['predicted_step_s'])} a step (scheduled program at the GPU's achievable rates, "
                 f"ember/hardware/rates.toml): MFU {r['mfu_predicted']:.1%}, {r['tokens_per_s_predicted']:,.0f} tokens/s "
                 f"per device")
    lines += [f"    {_ms(t['seconds']):>10}  {t['op']} ({t['pass']}, {t['kind']}{'' if t['exposed'] else ', hidden'})"
              for t in r["time_by_op"][:TOP_TIMES]]
  if r.get("pipeline"):
    p = r["pipeline"]
    bubble = "" if p["bubble_s"] is None else f", {_ms(p['bubble_s'])} of the floor"
    chunks = f" x {p['virtual_stages']} chunks" if p["virtual_stages"] > 1 else ""
    pads = p.get("padding_layers", 0)
    padding = f"; {pads} padding layer{'s' * (pads > 1)} (uneven stages)" if pads else ""
    lines.append(f"  pipeline:    {p['stages']} stages{chunks} ({p['schedule']}), {p['micro_batches']} micro-batches: "
                 f"bubble {p['bubble_fraction']:.1%} of the step {p['bubble_formula']}{bubble}; "
                 f"{p['stage_transfer_bytes'] / 2**20:,.1f} MiB a stage sends a step{padding}")
  if r.get("memory_by_op"):
    ops = ", ".join(f"{m['op']} ({m['pass']}) {m['bytes'] / 1e9:,.1f} GB" for m in r["memory_by_op"][:10])
    lines.append(f"  memory by op: {ops}")
  gib = 2**30
  for v in r["largest_values"][:3]:
    lines.append(f"  value:       {v['shape']} {v['bytes'] / gib:.2f} GiB x{v['count']}  {v['op_name']}")
  for c in r["largest_collectives"][:3]:
    lines.append(f"  collective:  {c['kind']} {c['shape']} {c['bytes'] / gib:.2f} GiB a step  {c['op_name']}")
  return lines


def _over_the_run_pool(r: dict) -> str:
  """A warning where the peak fits the GPU but not the share of it a run's allocator takes."""
  pool = r.get("run_memory_bytes")
  if not r["fits"] or pool is None or r["peak_bytes"] <= pool:
    return ""
  return (f"; but over the {pool / 2**30:.1f} GiB a run's allocator takes ({pool / r['device_memory_bytes']:.0%}: "
          "XLA_PYTHON_CLIENT_MEM_FRACTION, launch/xla_flags.sh): expect an out-of-memory error")


def _predicted(phase: dict) -> str:
  rate = phase.get("tokens_per_s_predicted")
  return "" if rate is None else f", {rate:,.0f} tokens/s predicted"


def format_report(r: dict) -> str:
  gib = 2**30
  memory = "unknown" if r["device_memory_bytes"] is None else f"{r['device_memory_bytes'] / gib:.1f} GiB"
  collectives = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sorted(r["collectives"].items())) or "none"
  g = r["gemms"]
  attention = r["attention"] + (f" ({r['attention_note']})" if r.get("attention_note") else "")
  phases = r.get("precision_phases")
  later = "" if not phases else ("; precision schedule (peak and fit: its largest phase's; the rest: the first's): "
                                 + ", ".join(f"{p['recipe']} from step {p['start']} (peak {p['peak_bytes'] / gib:.2f}"
                                             f" GiB{_predicted(p)})" for p in phases))
  return "\n".join([
      f"{r['model']} on {r['target']} ({r['num_devices']} x {r['device_kind']}), mesh {r['mesh']}, recipe "
      f"{r['recipe']}, remat {r['remat_policy']}, batch {r['batch_size']} x {r['seq_len']}{later}",
      f"  fits:        {'yes' if r['fits'] else 'NO'}: peak {r['peak_bytes'] / gib:.2f} GiB of {memory} per device"
      + _over_the_run_pool(r),
      f"  memory:      arguments {r['argument_bytes'] / gib:.2f} GiB (parameters, optimizer state, batch), outputs "
      f"{r['output_bytes'] / gib:.2f} GiB ({r['alias_bytes'] / gib:.2f} aliased), temporaries "
      f"{r['temp_bytes'] / gib:.2f} GiB, host {r['host_bytes'] / gib:.2f} GiB",
      f"  GEMMs:       {', '.join(f'{v} {k}' for k, v in g.items() if k != 'emulated')}"
      + (f" ({g['emulated']} of them block-scaled GEMMs emulated in bf16: no kernel on this GPU)" if g.get("emulated") else "")
      + " (each instruction once; a scan body once)",
      f"  attention:   {attention}",
      f"  collectives: {collectives} per device per step",
      *_host_lines(r.get("host_transfer_bytes")),
      *_work_lines(r),
      *_moe_lines(r.get("moe")),
      f"  compiled in {r['compile_s']:.1f} s; memory is an estimate: {r['memory_note']}",
  ])


def _host_lines(moved: dict | None) -> list[str]:
  """The host transfers' line, where the program has any (a policy's offloaded residuals)."""
  if not moved or not any(moved.values()):
    return []
  return [f"  host:        {moved['to_host'] / 2**30:,.1f} GiB to host memory and {moved['from_host'] / 2**30:,.1f} GiB "
          "back per device per step"]


def _moe_lines(moe: dict | None) -> list[str]:
  if not moe:
    return []
  copy = moe["largest_expert_copy"]
  return [f"  MoE:         dispatch {moe['dispatch']} over {moe['expert_parallel']} devices, expert GEMMs "
          f"{moe['expert_gemm']}, {moe['gemm_rows_per_rank']:,} rows per forward expert GEMM per device, expert GEMMs "
          f"{_flops(sum(moe['expert_gemm_flops'].values()))} a step; largest per-expert copy of the rows: "
          + (f"{copy['shape']} ({copy['bytes'] / 2**30:.2f} GiB)" if copy else "none")
          + "; rows exchanged: " + (", ".join(f"{t} {b / 2**30:,.1f} GiB" for t, b in
                                              moe.get("exchange_bytes_by_type", {}).items()) or "none")]


def main(argv: list[str]) -> int:
  target_env.prepare_environment(argv)
  from ember.errors import ArgumentParser, ConfigError, EmberError, fail_and_exit
  from ember.plan import target as target_lib
  from ember.plan.compile import compile_report
  from ember.tools import cli

  parser = ArgumentParser(prog="python -m ember.tools.compile")
  parser.add_argument("--target", required=True, help="cpu or <gpu>x<count>, e.g. h100x8")
  parser.add_argument("--out", default="", help="JSON file to write")
  parser.add_argument("--hlo_out", default="", help="file for the optimised HLO text")
  parser.add_argument("--plot", default="", help="PNG of where the step's time goes (ember/tools/figures.py)")
  try:
    own, config_argv = cli.split_config(argv)
    args = cli.parse(parser, own)
    target = target_lib.parse(args.target)
    if args.plot and not target.is_gpu:
      raise ConfigError(f"--plot: draws a GPU step's floor and predicted time, which --target={target.name} has not")
    cli.check_out_files({"--out": args.out, "--hlo_out": args.hlo_out, "--plot": args.plot})
    cfg = cli.settings(config_argv)
    report = compile_report(cfg, target, hlo_out=args.hlo_out)
    if args.out:
      cli.write_json("--out", args.out, report)
    if args.plot:
      from ember.tools import figures
      figures.time_split(report, args.plot)
  except EmberError as e:
    fail_and_exit(e)
  print(format_report(report))
  if not report["fits"]:
    gib = 2**30
    print(f"error: needs {report['peak_bytes'] / gib:.2f} GiB of {report['device_memory_bytes'] / gib:.2f} GiB per "
          f"device on {report['target']}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  native_output.quiet(sys.argv)
  sys.exit(main(sys.argv))
