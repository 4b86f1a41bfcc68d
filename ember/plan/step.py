"""The whole train step under a remat policy, traced and compiled on abstract sharded inputs.

`trace_train_step` traces the real step (ember/trainer/step.py, jitted as the loop jits it) without
allocating anything; `step_figures` reads its FLOPs off the jaxpr (scan trip counts applied), XLA's peak
bytes per device off the compiled program and, on GPUs ember/hardware/ knows, the program's predicted step
(ember/program/predict.py).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from ember import remat
from ember.config import Settings
from ember.names import BATCH_KEYS
from ember.parallel.sharding import batch_sharding, use_rules
from ember.plan.jaxpr import jaxpr_flops
from ember.program import hlo, predict
from ember.program.cost import Machine
from ember.program.schedule import compile_scheduled
from ember.trainer.perf import compiled_peak_bytes, host_bytes
from ember.trainer.state import state_shardings
from ember.trainer.step import jit_train_step


def abstract_batch(cfg: Settings, mesh) -> tuple[dict, NamedSharding]:
  """A global batch as shapes on its sharding (nothing allocated)."""
  sharding = batch_sharding(cfg.mesh.rules_dict, mesh)
  shape = (cfg.train.batch_size, cfg.model.seq_len)
  return {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding) for k in BATCH_KEYS}, sharding


def live_bytes(cfg: Settings, mesh, tx) -> int:
  """Per device, what the train step holds from its start to its end: the train state (donated: the new state
  takes its buffers) and the batch; XLA's scheduler keeps it out of the memory it plans with
  (target.scheduler_memory_options)."""
  with use_rules(mesh, cfg.mesh.rules):
    _, shardings, abstract = state_shardings(cfg, mesh, tx)
  batch, batch_sharding_ = abstract_batch(cfg, mesh)
  per_device = lambda a, s: math.prod(s.shard_shape(a.shape)) * jnp.dtype(a.dtype).itemsize
  state = jax.tree.leaves(jax.tree.map(per_device, abstract, shardings))
  return int(sum(state) + sum(per_device(b, batch_sharding_) for b in batch.values()))


def trace_train_step(cfg: Settings, mesh, tx, schedule, preset: remat.Preset, plan=None):
  """The real train step (`trainer.step.train_step`, policy overridden), jitted as the loop jits it
  and traced on abstract sharded inputs: `.jaxpr`, `.lower()`, `.lower(lowering_platforms=...)`. `plan`: the MoE
  plan it runs, where the caller reports it (default: `trainer.step.moe_plan`'s)."""
  with use_rules(mesh, cfg.mesh.rules):
    graphdef, shardings, abstract = state_shardings(cfg, mesh, tx)
    batch, _ = abstract_batch(cfg, mesh)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    step = jit_train_step(cfg, mesh, graphdef, tx, schedule, shardings, policy=preset, plan=plan)
    return step.trace(abstract, batch)


@dataclasses.dataclass(frozen=True)
class StepFigures:
  flops: float  # Whole step (all devices), from the traced jaxpr: forward, recompute, backward, update.
  peak_bytes: int | None  # Per device: XLA's memory analysis of the compiled step (None: not compiled).
  xla_flops: float | None  # XLA's cost_analysis() of the compiled per-device program (loop bodies once).
  host_bytes: int | None = None  # Per device: host memory the compiled program uses (offloaded residuals).
  predicted_s: float | None = None  # The compiled step's predicted time (ember/program/predict.py) on GPUs it knows.


def step_figures(cfg: Settings, mesh, tx, schedule, preset: remat.Preset, *, compile: bool = True,
                 compiler_options: dict | None = None) -> StepFigures:
  """FLOPs of the traced step and, compiled (with `compiler_options`, a target's), its peak bytes and, on GPUs
  ember/hardware/ knows, its predicted time."""
  traced = trace_train_step(cfg, mesh, tx, schedule, preset)
  flops = jaxpr_flops(traced.jaxpr.jaxpr)
  if not compile:
    return StepFigures(flops, None, None)
  compiled = compile_scheduled(traced.lower(), compiler_options, mesh, cfg.train.schedule_by_prediction).compiled
  try:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    xla_flops = float(cost["flops"]) if cost and "flops" in cost else None
  except Exception:
    xla_flops = None
  try:
    host = host_bytes(compiled.memory_analysis())
  except Exception:  # Backends without a memory analysis.
    host = None
  machine = Machine.of_mesh(mesh)
  predicted = None if machine is None else predict.predict(predict.Walk(hlo.Program(compiled.as_text())),
                                                           machine).step_s
  return StepFigures(flops, compiled_peak_bytes(compiled), xla_flops, host, predicted)
