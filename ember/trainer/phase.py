"""One precision phase of a run (ember/trainer/precision.py), ready to step: its config, the train step
compiled ahead of time, the eval step, and the quantization-health watch. A run has one phase unless
`quant.schedule` switches; `Phase.enter` moves the state into the next phase's structure and compiles it.
"""

from __future__ import annotations

import time

from ember.config import Settings
from ember.data import build_tokenizer
from ember.layers import moe_dispatch
from ember.parallel import distributed
from ember.platform import target_compute_capability, target_platform
from ember.program.schedule import compile_scheduled
from ember.quant import gemm
from ember.trainer import precision, quant_stats
from ember.trainer import step as step_lib
from ember.trainer.metrics import console
from ember.trainer.perf import compiled_peak_bytes
from ember.trainer.state import state_shardings


def compile_step(step_fn, state, batch, cfg: Settings, mesh, plan: moe_dispatch.Plan | None = None):
  """(the train step compiled ahead of time for these arguments, its compiled peak estimate or None), logged with
  that estimate and `plan`, the MoE plan it was jitted with."""
  console("compiling the train step")
  t0 = time.time()
  scheduled = compile_scheduled(step_fn.lower(state, batch), None, mesh, cfg.train.schedule_by_prediction)
  compiled = scheduled.compiled
  peak = compiled_peak_bytes(compiled)
  memory = "no memory analysis" if peak is None else f"compiled peak {peak / 2**30:.2f} GiB/device"
  moe = ""
  if plan is not None:
    slots = f" ({plan.slots} rows a slot)" if plan.expert_gemm == moe_dispatch.CAPACITY else ""
    moe = f", MoE dispatch {plan.exchange}, expert GEMMs {plan.expert_gemm}{slots}, {plan.rows} rows a device"
  if cfg.data.source != "synthetic":  # The first batch is read by now: the data and its tokenizer work.
    console(f"tokenizer {cfg.data.tokenizer}: vocabulary {build_tokenizer(cfg.data).vocab_size} "
            f"(model.vocab_size {cfg.model.vocab_size})")
  schedule = ""
  if scheduled.predicted_s:
    xla, told = scheduled.predicted_s
    kept = "told the predicted times" if scheduled.by_prediction else "XLA's estimates"
    schedule = f", scheduled by {kept} (predicted {xla:.3f} s a step by XLA's estimates, {told:.3f} s told the times)"
  elif scheduled.waits_s is not None:
    schedule = (f", scheduled by XLA's estimates (predicted to wait {scheduled.waits_s * 1e3:.1f} ms a step on "
                "transfers: not worth a second compile)")
  console(f"compiled the train step in {time.time() - t0:.1f}s ({memory}; remat {cfg.remat.policy}, "
          f"recipe {cfg.quant.name}, mesh {dict(mesh.shape)}{moe}{schedule})")
  missing = missing_tensor_core_gemm(cfg, compiled.as_text) if target_platform() == "gpu" else None
  if missing:
    console(f"warning: recipe {cfg.quant.name}: the compiled step has no {missing} call, so its GEMMs run in "
            "another precision (XLA chose other kernels: check XLA_FLAGS against ember/xla_flags.py's "
            "REQUIRED_XLA_FLAGS)")
  return compiled, peak


def missing_tensor_core_gemm(cfg: Settings, hlo_text, compute_capability=None) -> str | None:
  """The library call the recipe's GEMMs should compile to on this GPU (quant/gemm.py's `tensor_core_gemm`)
  when the compiled step (`hlo_text()`, its optimised HLO) has none; None otherwise. It caught XLA's Triton
  GEMMs taking every FP8 GEMM of an H100's step."""
  call = gemm.tensor_core_gemm(cfg.quant, compute_capability or target_compute_capability())
  return call if call and f'custom_call_target="{call}"' not in hlo_text() else None


class Phase:
  """One precision phase (ember/trainer/precision.py): its config, compiled train step and eval step, and
  quantization-health watch. `enter` moves the state into another phase and compiles that one."""

  def __init__(self, phases: precision.Phases, index: int, mesh, tx, schedule):
    self.phases, self.index, self.cfg = phases, index, phases.cfg(index)
    self.mesh, self.tx, self.schedule = mesh, tx, schedule
    self.compiled = self.compiled_peak = self.eval_fn = self.quant_health = self.plan = None

  def enter(self, index: int, state, batch, step: int):
    """(the phase `index` compiled, `state` moved into its structure) before `step` (the loop's)."""
    phase = Phase(self.phases, index, self.mesh, self.tx, self.schedule)
    cfg = phase.cfg
    graphdef, shardings, abstract = state_shardings(cfg, self.mesh, self.tx)
    if index != self.index:
      state = precision.carry(state, self.cfg, cfg, abstract, shardings)
      console(f"precision schedule: {self.phases.describe(index)} from step {step + 1}")
    # Decided once: jitted with, logged, and named by the overflow warnings.
    plan = phase.plan = step_lib.moe_plan(cfg, self.mesh, cfg.train.micro_batch_size)
    step_fn = step_lib.jit_train_step(cfg, self.mesh, graphdef, self.tx, self.schedule, shardings, plan=plan)
    # The peak read once, here: each log step's record has it (a CPU's memory analysis takes tens of ms).
    phase.compiled, phase.compiled_peak = compile_step(step_fn, state, batch, cfg, self.mesh, plan)
    phase.eval_fn = step_lib.jit_eval_step(cfg, self.mesh, graphdef, shardings, plan)
    phase.quant_health = QuantHealth(cfg) if cfg.log.quant_stats_every else None
    return phase, state


class QuantHealth:
  """Every `log.quant_stats_every` steps (a logged step): the quantization health figures
  (ember/trainer/quant_stats.py) for that step's record, and their warnings, on the console and in the
  record (`quant_warnings`)."""

  def __init__(self, cfg: Settings):
    self.model, self.recipe = cfg.model, cfg.quant
    self.watch = quant_stats.Watch(self.recipe.name)

  def record(self, done: int, stats_tree) -> dict:
    """Every process calls it at the same step: the statistics of a pipelined step are split by stage, each
    stage's on its own processes, and are gathered whole on each."""
    record = quant_stats.summarize(distributed.fetched(stats_tree), self.model, self.recipe)
    warnings = self.watch.check(record, done)
    for w in warnings:
      console(f"warning: quantization: {w}")
    return {**record, "quant_warnings": warnings}
