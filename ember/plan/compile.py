"""Compile the train step a config would run for a target, without running it, and report what the
compiled program does: memory against the target's, the GEMM census, the attention kernel, the
collectives, the compile time, what it costs (ember/program/cost.py: executed FLOPs by precision against
the model's, the largest values and collectives, the time floor on the target) and the predicted step
(ember/program/predict.py: `predicted_step_s`, `tokens_per_s_predicted`, `mfu_predicted`, `time_by_op`).

The step is the loop's own (ember/trainer/step.py, jitted the loop's way) on the config's mesh built
from the target's devices, with the remat policy resolved as the loop would (`auto` chooses under the
target's memory unless `remat.memory_budget_gb` says otherwise).
"""

from __future__ import annotations

import dataclasses
import os
import time

import jax.numpy as jnp
from jax.sharding import Mesh

from ember import config as config_lib
from ember import storage
from ember.config import Settings
from ember.layers import moe_dispatch
from ember.parallel import pipeline, sharding
from ember.parallel.mesh import make_mesh
from ember.plan import auto_remat
from ember.plan import step as step_plan
from ember.plan.layer import per_device_batch, sequence_shards
from ember.plan.target import COMPILER_OPTIONS, Target, run_memory_fraction, scheduler_memory_options, targeting
from ember.plan.units import GiB
from ember.program import cost, hlo, predict
from ember.program.schedule import Scheduled, compile_scheduled
from ember.trainer import step as step_lib
from ember.trainer.optimizer import make_optimizer
from ember.trainer.perf import host_bytes, memory_peak, work_per_device

ESTIMATE_NOTE = ("XLA's memory estimate for the compiled program: no autotuning on a compile-only target and "
                 "cuDNN workspaces unknown; the XLA options used are in xla_flags")


def prepare(cfg: Settings, target: Target) -> tuple[Settings, Mesh]:
  """(settings, mesh) of validated settings on the target's devices; `auto` with no budget gets the memory a run's
  allocator takes of the target's (`run_memory_fraction`), the planner's budget."""
  devices = target.devices()
  memory = target.device_memory_bytes
  if cfg.remat.policy == "auto" and not cfg.remat.memory_budget_gb and memory:
    budget = memory * run_memory_fraction() / GiB
    cfg = dataclasses.replace(cfg, remat=dataclasses.replace(cfg.remat, memory_budget_gb=budget))
  cfg = config_lib.on_devices(cfg, len(devices))
  return cfg, make_mesh(cfg.mesh, devices)


def compiler_options(target: Target, cfg: Settings, mesh) -> dict | None:
  """The options a compile of the step of `cfg` on `mesh` for `target` takes: COMPILER_OPTIONS, the scheduler's
  memory limit of a run (target.scheduler_memory_options), and those its jit takes (step.step_compiler_options:
  listed so that the report names them); None for the local devices."""
  if not target.is_gpu:
    return None
  options = dict(COMPILER_OPTIONS) | step_lib.step_compiler_options(cfg, mesh)
  if target.device_memory_bytes:
    tx, _ = make_optimizer(cfg)
    options.update(scheduler_memory_options(target.device_memory_bytes, step_plan.live_bytes(cfg, mesh, tx)))
  return options


def compile_report(cfg: Settings, target: Target, *, hlo_out: str = "", beat_s: float | None = None) -> dict:
  """The contract report (ember.tools.compile's JSON) for validated settings on `target`; `hlo_out`: a file
  for the optimised HLO text; `beat_s`: a predicted step to beat (the planner's best so far), below which no
  schedule of this step's kernels could bring it compiles it once (ember/program/schedule.py)."""
  with targeting(target):
    cfg, mesh = prepare(cfg, target)
    options = compiler_options(target, cfg, mesh)
    cfg = auto_remat.resolve(cfg, mesh, compiler_options=options)
    plan = step_lib.moe_plan(cfg, mesh, cfg.train.micro_batch_size)  # Traced with and reported.
    t0 = time.perf_counter()
    scheduled = _compile(cfg, mesh, plan, options, beat_s)
    compiled = scheduled.compiled
    compile_s = time.perf_counter() - t0
    text = compiled.as_text()
    program = hlo.Program(text)
    attention = hlo.attention(program)
    attention_note = _why_not_cudnn(cfg, mesh) if target.is_gpu and attention["kernel"] != "cudnn" else None
    later = [_later_phase(cfg, i, mesh, options) for i in range(1, len(cfg.phases))]
  if hlo_out:
    storage.write_atomic(hlo_out, text)
  memory = compiled.memory_analysis()
  peak = max([memory_peak(memory)] + [phase["peak_bytes"] for phase in later])
  device_memory = target.device_memory_bytes
  report = {
      "target": target.name, "device_kind": target.device_kind, "num_devices": len(mesh.devices.flat),
      "fits": device_memory is None or peak <= device_memory, "device_memory_bytes": device_memory,
      # What a run's allocator takes of it (XLA_PYTHON_CLIENT_MEM_FRACTION, launch/xla_flags.sh).
      "run_memory_bytes": None if device_memory is None else int(device_memory * run_memory_fraction()),
      "peak_bytes": peak, "argument_bytes": int(memory.argument_size_in_bytes),
      "output_bytes": int(memory.output_size_in_bytes), "alias_bytes": int(memory.alias_size_in_bytes),
      "temp_bytes": int(memory.temp_size_in_bytes), "host_bytes": host_bytes(memory),
      "gemms": hlo.gemm_census(program), "attention": attention["kernel"],
      "attention_kernels": {"forward": attention["forward"], "backward": attention["backward"]},
      "collectives": hlo.collectives(program), "remat_policy": cfg.remat.policy, "recipe": cfg.quant.name,
      "compile_s": round(compile_s, 2), "xla_flags": {"compiler_options": options or {},
                                                     "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
                                                     # Kept the schedule told the predicted times: (XLA's,
                                                     # that one) predicted, where both were compiled; what
                                                     # the first one waits on transfers, where predicted.
                                                     "scheduled_by_prediction": scheduled.by_prediction,
                                                     "schedules_predicted_s": scheduled.predicted_s,
                                                     "schedule_waits_s": scheduled.waits_s},
      "mesh": {k: int(v) for k, v in mesh.shape.items()}, "model": cfg.model.name,
      "batch_size": cfg.train.batch_size, "seq_len": cfg.model.seq_len, "memory_note": ESTIMATE_NOTE,
  }
  if attention_note:
    report["attention_note"] = attention_note
  num_devices = len(mesh.devices.flat)
  per_device = work_per_device(cfg, num_devices)
  m = cost.Machine.of_mesh(mesh)  # A target's nodes are its processes, as a run's.
  report.update(cost.step_cost(program, machine=m, **per_device))
  report.update(predict.predicted_step(program, m, **per_device))
  if later:
    first = {"start": 0, "recipe": cfg.quant.name, "peak_bytes": memory_peak(memory),
             "tokens_per_s_predicted": report["tokens_per_s_predicted"]}
    report["precision_phases"] = [first] + later
  if cfg.model.num_experts:
    report["moe"] = moe_figures(plan, program)
  if pipeline.stages(mesh) > 1:
    report["pipeline"] = pipeline_figures(cfg, mesh, report)
    report["pipeline_bubble_fraction"] = report["pipeline"]["bubble_fraction"]
  return report


def _compile(cfg: Settings, mesh, plan, options, beat_s: float | None = None) -> Scheduled:
  tx, schedule = make_optimizer(cfg)
  lowered = step_plan.trace_train_step(cfg, mesh, tx, schedule, cfg.remat.preset, plan).lower()
  return compile_scheduled(lowered, options, mesh, cfg.train.schedule_by_prediction, beat_s)


def _later_phase(cfg: Settings, index: int, mesh, options) -> dict:
  """Precision phase `index` of a schedule compiled as the run compiles it at its switch: its start, recipe, peak
  and predicted throughput. The report's other figures are the first phase's; its `peak_bytes` and `fits` are
  every phase's, since the run holds each in turn."""
  start, recipe = cfg.phases[index]
  phase = cfg.at_phase(index)
  program = _compile(phase, mesh, step_lib.moe_plan(phase, mesh, phase.train.micro_batch_size), options).compiled
  predicted = predict.predicted_step(hlo.Program(program.as_text()), cost.Machine.of_mesh(mesh),
                                     **work_per_device(phase, len(mesh.devices.flat)))
  return {"start": start, "recipe": recipe.name, "peak_bytes": memory_peak(program.memory_analysis()),
          "tokens_per_s_predicted": predicted["tokens_per_s_predicted"]}


def pipeline_figures(cfg: Settings, mesh, report: dict) -> dict:
  """A pipelined step's schedule: its stages, chunks a stage and micro-batches, the idle share of the step
  (`bubble_fraction`, ember/parallel/pipeline.py: the compiled program runs the schedule's idle passes on zeros in
  lockstep, so the floor and the prediction above include them, and `bubble_s` is their share of the floor), the
  activation bytes a stage sends a step (`pipeline.stage_transfers`), the chunks' residuals a stage keeps at
  most (`in_flight`) and the padding rows of uneven stages (`padding_layers`, pipeline.padded_blocks: they run as
  layers, so `executed_over_model` counts them). Every stage runs one program, so each holds the same peak
  (`peak_bytes`)."""
  stages, micro, virtual = pipeline.stages(mesh), cfg.train.grad_accum_steps, cfg.pipeline.virtual_stages
  schedule = cfg.pipeline.schedule
  m = cfg.model
  batch_shards = sharding.shards(sharding.token_axes(cfg.mesh.rules_dict, mesh), dict(mesh.shape))
  activation = cfg.train.micro_batch_size * m.seq_len * m.d_model * jnp.dtype(m.dtype).itemsize / batch_shards
  fraction = pipeline.bubble_fraction(micro, stages, schedule, virtual)
  floor = report.get("time_floor_s")
  return {"schedule": schedule, "stages": stages, "virtual_stages": virtual, "micro_batches": micro,
          "ticks": pipeline.loop_length(micro, stages, schedule, virtual), "bubble_fraction": fraction,
          "bubble_formula": "(S - 1) / (M V + S - 1)", "bubble_s": None if floor is None else floor * fraction,
          "in_flight": pipeline.in_flight(micro, stages, schedule, virtual),
          "stage_transfer_bytes": pipeline.stage_transfers(micro, stages, schedule, virtual) * activation,
          "padding_layers": (cfg.stacked_blocks - m.num_blocks) * m.block_size}


def moe_figures(p: moe_dispatch.Plan, program: hlo.Program) -> dict:
  """The token exchange of an MoE step traced with plan `p`: the dispatcher that runs, and the expert GEMMs' rows
  per device and FLOPs read from the compiled program, with the largest per-expert copy of the routed rows."""
  gemms = cost.expert_gemms(program)
  copy = cost.largest_expert_copy(program, local_experts=p.num_local, rows=gemms["gemm_rows_per_rank"])
  return {"dispatch": p.exchange, "expert_gemm": p.expert_gemm, "expert_parallel": p.expert_parallel,
          "local_experts": p.num_local, "tokens_per_shard": p.tokens, "planned_rows": p.rows,
          "planned_slots": p.slots, **gemms, "largest_expert_copy": copy,
          "exchange_bytes_by_type": exchange_bytes_by_type(program)}


def exchange_bytes_by_type(program: hlo.Program) -> dict[str, float]:
  """Bytes per device per step the step's all-to-alls of rows move, by element type (the MoE exchange: the copies
  in the recipe's format where it allows, layers/moe_dispatch.py's `Wire`)."""
  out: dict[str, float] = {}
  for c in hlo.collective_ops(program):
    element = hlo.dtype_of(c.shape)
    if c.kind in ("all-to-all", "ragged-all-to-all") and element.startswith(("bf", "f")):  # Rows, not counts.
      out[element] = out.get(element, 0.0) + c.bytes_per_step
  return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _why_not_cudnn(cfg: Settings, mesh) -> str:
  """Why the step's attention is XLA's on a GPU target: the config asks for it, or cuDNN's reason."""
  if cfg.model.attention == "xla":
    return "model.attention=xla"
  from ember.layers.attention import cudnn_refusal
  m = cfg.model
  tensor = int(mesh.shape["tensor"])  # Heads are split over it.
  # MLA's keys and values: one per head (values padded); fewer kv heads than `tensor` ranks: copies of them.
  kv_heads = m.num_heads if m.is_mla else m.num_kv_heads * m.kv_copies(tensor)
  reason = cudnn_refusal(per_device_batch(cfg, mesh), m.seq_len, m.num_heads // tensor, kv_heads // tensor,
                         m.qk_head_dim, m.dtype, sequence_shards(cfg, mesh))
  return f"cuDNN refuses these shapes: {reason}" if reason else "cuDNN accepts the shapes; XLA kept its own attention"
