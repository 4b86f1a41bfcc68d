"""The training loop: prepare, restore, compile once, step, log, evaluate, checkpoint, stop cleanly.

The device never waits for the host: the jitted step runs ahead asynchronously and metrics are
fetched once per log interval (that fetch is also where step time is measured). SIGTERM (a
preemption notice; with several processes JAX's preemption service agrees on the step) ends the
loop after the current step with a synchronous checkpoint, and the process exits 0. Every
resource (data iterators and their threads, the checkpoint manager, writers) is closed on the way
out, error or not, so a failed run ends with its one error line and nothing else.

`remat.policy=auto` is resolved before the loop starts (ember/plan/auto_remat.py, called by
train.py and the tools): the loop only ever runs a preset.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import ember
from ember import config as config_lib
from ember import remat
from ember.data import build_tokenizer, records
from ember.data.sharded import data_iterator, global_batch, source_shares
from ember.errors import ConfigError
from ember.hf import load as hf_load
from ember.names import RECORD_SOURCES
from ember.layers import moe_dispatch
from ember.model_config import ModelConfig
from ember.parallel import distributed
from ember.parallel.mesh import make_mesh
from ember.parallel.sharding import use_rules
from ember.platform import target_platform
from ember.trainer import moe_counts, precision, quant_stats
from ember.trainer import step as step_lib
from ember.trainer.checkpointing import Checkpointer, restore_from
from ember.trainer.metrics import MetricsWriter, console, progress_line
from ember.trainer.moe_counts import MoeCounts
from ember.trainer.optimizer import make_optimizer
from ember.trainer.perf import Throughput, compiled_peak_bytes, peak_bytes
from ember.trainer.state import create_train_state, state_around, state_shardings


def prepare(cfg):
  """Joins the multi-process job, validates and derives the config, builds the mesh: (cfg, mesh)."""
  distributed.initialize(cfg.distributed)
  config_lib.validate(cfg, jax.device_count(), jax.process_count())
  cfg = config_lib.derive(cfg, jax.device_count())
  if cfg.data.source != "synthetic":
    vocab = build_tokenizer(cfg.data).vocab_size
    if vocab > cfg.model.vocab_size:
      raise ConfigError(f"config.model.vocab_size: {cfg.model.vocab_size} is smaller than the tokenizer's "
                        f"vocabulary ({vocab})")
  return cfg, make_mesh(cfg.mesh)


def _make_workdir(workdir: str) -> None:
  """config.validate checks the path without creating it; creating it can still fail where the permission
  bits allow it (a virtual or read-only file system such as /proc): one line, exit 2."""
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as e:
    raise ConfigError(f"config.workdir: cannot create {os.path.abspath(workdir)}: {e.strerror or e}") from None


def train(cfg, mesh=None) -> dict:
  """Runs (or resumes) the job the config describes; returns a summary of the final figures.

  `cfg` is raw (prepared here) unless `mesh` is given, in which case it is the prepared config."""
  t_start = time.time()
  if mesh is None:
    cfg, mesh = prepare(cfg)
  if cfg.remat.policy == "auto":
    raise ConfigError("config.remat.policy: 'auto' must be resolved before training (ember.plan.auto_remat.resolve; "
                      "train.py does it)")
  _make_workdir(cfg.workdir)
  policy = remat.preset(cfg.remat)
  tx, schedule = make_optimizer(cfg.train)
  with contextlib.ExitStack() as resources, use_rules(mesh, cfg.mesh.rules):
    train_it = data_iterator(cfg, "train")
    resources.callback(train_it.close)
    metrics = MetricsWriter(cfg.workdir, tensorboard=cfg.log.tensorboard)
    resources.callback(metrics.close)
    preemption = distributed.Preemption().install()
    resources.callback(preemption.uninstall)
    ckpt = Checkpointer(os.path.join(cfg.workdir, "checkpoints"), every_steps=cfg.checkpoint.every_steps,
                        keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_save)
    resources.callback(ckpt.close)

    phases = precision.Phases(cfg)
    targets = lambda step: state_shardings(phases.cfg(phases.state_phase(step)), mesh, tx, policy)[1:]
    state = _restore_or_init(cfg, ckpt, mesh, tx, policy, targets, metrics, train_it)
    _check_phase(ckpt, phases, int(state.step))
    batch_sharding = step_lib.batch_sharding(cfg, mesh)
    shares = source_shares(cfg)
    batch = _next_batch(train_it, batch_sharding, shares)
    meta = {"config": cfg.to_dict(), "ember_version": ember.__version__, "mesh": dict(mesh.shape),
            "process_count": jax.process_count()}
    phase = _Phase(phases, phases.state_phase(int(state.step)), mesh, tx, schedule, policy, batch_sharding)
    progress = _Progress(cfg, start=int(state.step), shares=shares)
    profiler = _Profiler(cfg)
    last = {"step": int(state.step)}
    for step in range(int(state.step), cfg.steps):
      if phases.at(step) != phase.index or phase.compiled is None:
        phase, state = phase.enter(phases.at(step), state, batch)
        progress.compiled, progress.cfg = phase.compiled, phase.cfg
      profiler.before(step)
      state, step_metrics = phase.compiled(state, batch)
      progress.moe.add(step, step_metrics)
      done = step + 1
      profiler.after(done)
      stopping = preemption.reached(done) and done < cfg.steps
      health = phase.quant_health is not None and done % cfg.log.quant_stats_every == 0
      if done % cfg.log.every_steps == 0 or done == cfg.steps or stopping or health:
        extra = phase.quant_health.record(done, step_metrics["quant_stats"]) if health else {}
        last.update(progress.log(done, step_metrics, metrics, quant_phase=phase.index, extra=extra))
      if cfg.train.eval_every_steps and (done % cfg.train.eval_every_steps == 0 or done == cfg.steps):
        last["eval_loss"] = evaluate(cfg, state, phase.eval_fn, batch_sharding)
        metrics.write({"step": done, "eval_loss": last["eval_loss"]})
        console(f"step {done:>6}/{cfg.steps}  eval_loss {last['eval_loss']:.4f}")
      if ckpt.should_save(done, cfg.steps) or stopping:
        ckpt.save(done, state, train_it, seed=cfg.seed, metadata={**meta, "quant_phase": phase.index},
                  force_sync=stopping)
      if stopping:
        console(f"preempted (SIGTERM): saved a checkpoint at step {done} in {ckpt.directory} and stopped")
        break
      if done < cfg.steps:
        batch = _next_batch(train_it, batch_sharding, shares)
  last["wall_time_s"] = time.time() - t_start
  return last


def _next_batch(it, sharding, shares):
  """The next global batch; a mixture's per-token sources are counted here and stay on the host."""
  rows = next(it)
  shares.count(rows)
  return global_batch(rows, sharding)


def _compile(step_fn, state, batch, cfg, mesh):
  """The train step compiled ahead of time for these arguments (logged with its memory estimate)."""
  t0 = time.time()
  compiled = step_fn.lower(state, batch).compile()
  peak = compiled_peak_bytes(compiled)
  memory = "no memory analysis" if peak is None else f"compiled peak {peak / 2**30:.2f} GiB/device"
  moe = ""
  if cfg.model.num_experts:
    n = int(mesh.shape["expert"])
    dispatch, layout = moe_dispatch.choose(cfg.model.moe_dispatch, cfg.model.moe_expert_gemm, expert_parallel=n,
                                           num_local=cfg.model.num_experts // n, platform=target_platform())
    moe = f", MoE dispatch {dispatch}, expert GEMMs {layout}"
  console(f"compiled the train step in {time.time() - t0:.1f}s ({memory}; remat {cfg.remat.policy}, "
          f"recipe {cfg.quant.recipe}, mesh {dict(mesh.shape)}{moe})")
  return compiled


class _Phase:
  """One precision phase (ember/trainer/precision.py): its config, compiled train step and eval step, and
  quantization-health watch. `enter` moves the state into another phase and compiles that one."""

  def __init__(self, phases: precision.Phases, index: int, mesh, tx, schedule, policy, batch_sharding):
    self.phases, self.index, self.cfg = phases, index, phases.cfg(index)
    self.mesh, self.tx, self.schedule, self.policy, self.batch_sharding = mesh, tx, schedule, policy, batch_sharding
    self.compiled = self.eval_fn = self.quant_health = None

  def enter(self, index: int, state, batch):
    """(the phase `index` compiled, `state` moved into its structure)."""
    phase = _Phase(self.phases, index, self.mesh, self.tx, self.schedule, self.policy, self.batch_sharding)
    cfg = phase.cfg
    graphdef, shardings, abstract = state_shardings(cfg, self.mesh, self.tx, self.policy)
    if index != self.index:
      state = precision.carry(state, self.cfg, cfg, abstract, shardings)
      console(f"precision schedule: {self.phases.describe(index)} from step {int(state.step) + 1}")
    phase.compiled = _compile(step_lib.jit_train_step(cfg, self.mesh, graphdef, self.tx, self.schedule, shardings),
                              state, batch, cfg, self.mesh)
    phase.eval_fn = jax.jit(functools.partial(step_lib.eval_step, graphdef=graphdef, cfg=cfg),
                            in_shardings=(shardings, self.batch_sharding))
    phase.quant_health = _QuantHealth(cfg) if cfg.log.quant_stats_every else None
    return phase, state


class _Progress:
  """Turns the metrics fetched once per log interval into a record: step time since the last log,
  throughput, MFU, ETA and peak memory; writes it and prints the progress line."""

  def __init__(self, cfg, *, start: int, shares):
    self.cfg, self.compiled, self.shares = cfg, None, shares
    kinds = {cfg.data.source} if not cfg.data.mixture else {source for _, source, *_ in cfg.data.mixture}
    self.reads_records = bool(kinds & set(RECORD_SOURCES))
    self.t_last, self.step_last = time.time(), start
    self.moe = MoeCounts()  # Summed over every step of a log interval.

  def log(self, done: int, step_metrics, writer: MetricsWriter, quant_phase: int = 0, extra=None) -> dict:
    host = jax.device_get({k: v for k, v in step_metrics.items() if k != "quant_stats" and k not in moe_counts.KEYS})
    now = time.time()
    step_time = (now - self.t_last) / max(done - self.step_last, 1)
    self.t_last, self.step_last = now, done
    perf = Throughput.of(self.cfg, step_time, jax.device_count(), jax.devices()[0].device_kind)
    record = {"step": done, **{k: float(v) for k, v in host.items()}, **perf.to_dict(),
              "eta_s": step_time * (self.cfg.steps - done)}
    moe, moe_warnings = self.moe.take(done)
    record.update(moe)
    record["peak_bytes"], record["peak_source"] = peak_bytes(self.compiled)
    if self.cfg.quant.schedule:
      record["quant_phase"] = quant_phase
    record.update(extra or {})
    record.update(self.shares.report())
    if self.reads_records:  # Bad records skipped by rule (ember/data/records.py), over all processes.
      record["data_skipped_records"] = int(distributed.sum_over_processes(np.int64(records.skipped_records())))
    writer.write(record)
    console(progress_line(record, self.cfg.steps))
    for warning in moe_warnings:  # Never silent: these copies' expert outputs were zero.
      console(f"warning: {warning}")
    return record


class _QuantHealth:
  """Every `log.quant_stats_every` steps (a logged step): the quantization health figures
  (ember/trainer/quant_stats.py) for that step's record, and their warnings, on the console and in the
  record (`quant_warnings`)."""

  def __init__(self, cfg):
    self.model = ModelConfig.from_config(cfg)
    self.watch = quant_stats.Watch(self.model.recipe.name)

  def record(self, done: int, stats_tree) -> dict:
    record = quant_stats.summarize(jax.device_get(stats_tree), self.model)
    warnings = self.watch.check(record, done)
    for w in warnings:
      console(f"warning: quantization: {w}")
    return {**record, "quant_warnings": warnings}


class _Profiler:
  """A profiler trace of steps [train.profile_start_step, + train.profile_steps) into workdir/profile."""

  def __init__(self, cfg):
    self.start, self.stop = cfg.train.profile_start_step, cfg.train.profile_start_step + cfg.train.profile_steps
    self.last, self.dir = cfg.steps, os.path.join(cfg.workdir, "profile")
    self.active = False

  def before(self, step: int) -> None:
    if self.start >= 0 and step == self.start:
      jax.profiler.start_trace(self.dir)
      self.active = True

  def after(self, done: int) -> None:
    if self.active and (done == self.stop or done == self.last):
      jax.profiler.stop_trace()
      self.active = False


def _restore_or_init(cfg, ckpt, mesh, tx, policy, targets, metrics, train_it):
  """Resumes from the workdir's latest checkpoint, else starts from checkpoint.init_from_hf, checkpoint.restore_from
  or init. `targets(step)`: (shardings, abstract) of the state after `step` steps (its precision phase's)."""
  restored = ckpt.restore_latest(targets, train_it, seed=cfg.seed)
  if restored is not None:
    state, step = restored
    metrics.truncate_after(step)
    console(f"resumed from {ckpt.directory} at step {step}")
    return state
  shardings, abstract = targets(0)
  init = lambda: create_train_state(cfg, mesh, tx, policy)[1]
  if cfg.checkpoint.init_from_hf:
    params = hf_load.load_params(cfg.checkpoint.init_from_hf, ModelConfig.from_config(cfg), abstract.params,
                                 shardings.params)
    state = state_around(cfg, tx, policy, params, shardings)
    console(f"started from the Hugging Face model in {cfg.checkpoint.init_from_hf}")
  elif cfg.checkpoint.restore_from:
    state = restore_from(cfg.checkpoint.restore_from, abstract, shardings, train_it,
                         params_only=cfg.checkpoint.params_only, init=init)
  else:
    state = init()
  metrics.truncate_after(0)  # A new run: no records of an earlier one in this workdir.
  return state


def _check_phase(ckpt: Checkpointer, phases: precision.Phases, step: int) -> None:
  """Warns when a resumed checkpoint was saved in another precision phase than this config's schedule
  puts its step in (quant.schedule edited between runs): the run goes on in this config's phase."""
  if step == 0 or step not in ckpt.steps():
    return
  saved = ckpt.custom_metadata(step).get("quant_phase")
  if saved is not None and saved != phases.state_phase(step):
    console(f"warning: the checkpoint of step {step} was saved in precision phase {saved}; this config's "
            f"quant.schedule puts step {step} in {phases.describe(phases.state_phase(step))}")


def evaluate(cfg, state, eval_fn, batch_sharding) -> float:
  """Mean loss over the first `train.eval_batches` batches of the held-out split (the same every time)."""
  it = data_iterator(cfg, "eval")
  try:
    losses = [eval_fn(state, global_batch(next(it), batch_sharding)) for _ in range(cfg.train.eval_batches)]
  finally:
    it.close()
  return float(jnp.mean(jnp.stack(losses)))
