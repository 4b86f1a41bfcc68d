"""What each remat policy saves, recomputes and costs, for one config.

  python -m ember.tools.remat_report --config=configs/default.py:1b --config.train.batch_size=1 \
      --config.model.seq_len=1024 [--policies=full,save_quantized] [--compile=false] [--target=h100x8] --out=remat.json

Per policy (default: every preset, plus `custom` when the config lists names):
  residual_bytes_per_layer, residuals   what one decoder block saves for its backward pass: the
      block's input and each named or unnamed residual, low-precision ones at the bits they take;
      per device (the per-device batch); per layer (a block of an interleaved MoE holds several);
  recomputed_quantize_ops_per_layer      low-precision casts of forward operands the backward pass
      of one layer recomputes (an NVFP4 quantize is two: scales to E4M3, data to E2M1);
  recomputed_gemms_per_layer             forward projection GEMMs it recomputes (the MLP's output
      projection never is: its output feeds only the residual sum);
  flops_per_step, recomputed_flops_per_step   the traced step's FLOPs, and those beyond policy `none`;
  peak_bytes                             XLA's peak device memory for the compiled step (`--compile`).
The JSON file holds the same figures; ember/plan/layer.py and ember/plan/step.py say how each is measured.
"""

from __future__ import annotations

import sys

from ember import native_output
from ember.tools import target_env

target_env.prepare_environment(sys.argv)  # Before JAX is imported (python -m ember.tools.remat_report --target=...).
if __name__ == "__main__":
  native_output.quiet(sys.argv)  # Before JAX is imported: the CUDA plugin's notices come as it loads.

import jax  # noqa: E402

from ember import remat  # noqa: E402
from ember.config import Settings  # noqa: E402
from ember.errors import ArgumentParser, ConfigError, EmberError, fail_and_exit  # noqa: E402
from ember.parallel.mesh import make_mesh  # noqa: E402
from ember.plan import compile as compile_plan  # noqa: E402
from ember.plan import layer as layer_plan  # noqa: E402
from ember.plan import step as step_plan  # noqa: E402
from ember.plan import target as target_lib  # noqa: E402
from ember.plan.units import format_bytes, format_flops  # noqa: E402
from ember.tools import cli  # noqa: E402
from ember.trainer.optimizer import make_optimizer  # noqa: E402

COLUMNS = (("policy", "policy"), ("residual_bytes_per_layer", "residuals/layer"),
           ("offloaded_bytes_per_layer", "offloaded/layer"), ("recomputed_quantize_ops_per_layer", "quantize ops"),
           ("recomputed_gemms_per_layer", "GEMMs"), ("recomputed_attention_matmuls_per_layer", "attn matmuls"),
           ("flops_per_step", "FLOPs/step"), ("recomputed_flops_per_step", "recomputed"), ("peak_bytes", "peak/device"),
           ("host_bytes", "host/device"), ("predicted_step_s", "predicted step"))


def policy_names(requested: str, cfg: Settings) -> list[str]:
  if not requested:
    custom = ["custom"] if cfg.remat.save_names or cfg.remat.offload_names else []
    return list(remat.PRESETS) + custom
  names = [n.strip() for n in requested.split(",") if n.strip()]
  if not names:
    raise ConfigError(f"--policies: {requested!r} names no policy")
  valid = tuple(remat.PRESETS) + ("custom",)
  for n in names:
    if n not in valid:
      raise ConfigError(f"--policies: unknown policy {n!r}; choose from {', '.join(valid)}")
  return names


def build_report(cfg: Settings, names, *, compile: bool = True, batch: int | None = None, mesh=None,
                 compiler_options: dict | None = None, target: str = "") -> dict:
  """The report for a validated, derived config (see the module doc); `mesh` and `compiler_options` a
  target's (default: the local devices)."""
  mesh = mesh if mesh is not None else make_mesh(cfg.mesh)
  tx, schedule = make_optimizer(cfg)
  presets = {n: remat.preset(cfg.remat, n) for n in names}
  layers = layer_plan.layer_report(cfg, presets, batch=batch)
  figures = {n: step_plan.step_figures(cfg, mesh, tx, schedule, p, compile=compile, compiler_options=compiler_options)
             for n, p in presets.items()}
  base = figures["none"].flops if "none" in figures else step_plan.step_figures(
      cfg, mesh, tx, schedule, remat.PRESETS["none"], compile=False).flops
  rows = []
  for n in names:
    f = figures[n]
    rows.append({"policy": n, **layers[n], "flops_per_step": f.flops, "recomputed_flops_per_step": f.flops - base,
                 "xla_flops_per_device": f.xla_flops, "peak_bytes": f.peak_bytes, "host_bytes": f.host_bytes,
                 "predicted_step_s": f.predicted_s, "peak_source": "compiled"})
  m = cfg.model
  about = {"model": m.name, "recipe": cfg.quant.name, "batch_size": cfg.train.batch_size, "seq_len": m.seq_len,
           "layer_batch_per_device": batch or layer_plan.per_device_batch(cfg), "devices": len(mesh.devices.flat),
           "backend": target or jax.default_backend(), "mesh": {k: int(v) for k, v in mesh.shape.items()}}
  return {"config": about, "policies": rows}


def _cell(key: str, value) -> str:
  if value is None:
    return "-"
  if key == "policy":
    return value
  if key.endswith("bytes") or key.endswith("bytes_per_layer"):
    return format_bytes(value)
  if "flops" in key:
    return format_flops(value)
  if key.endswith("_s"):
    return f"{value * 1e3:,.1f} ms"
  return f"{value:g}"


def format_table(report: dict) -> str:
  """The per-policy figures as an aligned text table (recomputed counts are per layer)."""
  rows = [[h for _, h in COLUMNS]] + [[_cell(k, r.get(k)) for k, _ in COLUMNS] for r in report["policies"]]
  widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
  lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
           for row in rows]
  lines.insert(1, "  ".join("-" * w for w in widths))
  c = report["config"]
  title = (f"remat report: model {c['model']}, recipe {c['recipe']}, batch {c['batch_size']} x seq {c['seq_len']}, "
           f"{c['devices']} {c['backend']} device(s); residuals for {c['layer_batch_per_device']} sequence(s) per "
           "device; recomputed counts per layer")
  return "\n".join([title, ""] + lines)


def format_residuals(report: dict) -> str:
  """Bytes per residual name and policy (one layer): which tensors each policy keeps."""
  names: dict[str, None] = {}
  table: dict[str, dict[str, float]] = {}
  for r in report["policies"]:
    for res in r["residuals"]:
      names.setdefault(res["name"], None)
      cell = table.setdefault(res["name"], {})
      cell[r["policy"]] = cell.get(r["policy"], 0.0) + res["bytes"]
  policies = [r["policy"] for r in report["policies"]]
  rows = [["residual"] + policies]
  rows += [[n] + [format_bytes(table[n].get(p)) if p in table[n] else "" for p in policies] for n in names]
  widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
  return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                   for row in rows)


def _parse(argv: list[str]):
  parser = ArgumentParser(prog="python -m ember.tools.remat_report")
  parser.add_argument("--policies", default="", help="comma-separated presets (default: all)")
  parser.add_argument("--out", required=True, help="JSON file to write")
  parser.add_argument("--compile", default="true", choices=("true", "false"),
                      help="compile the train step per policy for peak bytes (slow for big models)")
  parser.add_argument("--layer_batch", type=int, default=0, help="sequences per device for the residuals (0 = config)")
  parser.add_argument("--residuals", default="true", choices=("true", "false"), help="print the per-residual table")
  parser.add_argument("--target", default="cpu", help="compile for this target (cpu, h100x8, ...): peaks are its")
  args = cli.parse(parser, argv)
  cli.check_out_file("--out", args.out)
  return args


def main(argv: list[str]) -> int:
  try:
    own, config_argv = cli.split_config(argv)
    args = _parse(own)
    if args.layer_batch < 0:
      raise ConfigError(f"--layer_batch: sequences per device, at least 1 (0: the config's), got {args.layer_batch}")
    cfg = cli.settings(config_argv, unread=False)  # Its rows read each policy's keys (custom's lists too).
    target = target_lib.parse(args.target)
    with target_lib.targeting(target):
      cfg, mesh = compile_plan.prepare(cfg, target)
      names = policy_names(args.policies, cfg)
      report = build_report(cfg, names, compile=args.compile == "true", batch=args.layer_batch or None, mesh=mesh,
                            compiler_options=compile_plan.compiler_options(target, cfg, mesh), target=target.name)
    cli.write_json("--out", args.out, report)
  except EmberError as e:
    fail_and_exit(e)
  print(format_table(report))
  if args.residuals == "true":
    print("\nresidual bytes per layer, by name\n")
    print(format_residuals(report))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
