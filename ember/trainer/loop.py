"""The training loop: prepare, restore, compile once, step, log, evaluate, checkpoint, stop cleanly.

The host waits for each step's loss before the next step (one step in flight: a step's dispatch costs the device
far less than the step) and fetches metrics once per log interval (that fetch is also where step time is
measured). A step whose loss or gradients are not finite changes nothing (step.unless_non_finite): the loop
counts it (`skipped_steps`) and ends the run after train.max_skipped_steps in a row, so the loop's step (batches
consumed, the checkpoints' step) runs ahead of `state.step` (updates applied) by the steps skipped. Each stage has
a deadline (ember/trainer/watchdog.py): a hung job ends itself. With several processes each one's speed is
compared with the others' at every log step (ember/trainer/watchdog.py). SIGTERM (a preemption notice; with several processes JAX's preemption service agrees on the step) ends
the loop after the step the device is running with a synchronous checkpoint, and the process exits 0. Every
resource (data iterators and their threads, the checkpoint manager, writers) is closed on the way
out, error or not, so a failed run ends with its one error line and nothing else.

`remat.policy=auto` is resolved before the loop starts (ember/plan/auto_remat.py, called by
train.py and the tools): the loop only ever runs a preset.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import ember
from ember import config as config_lib
from ember import platform, storage
from ember.config import Settings
from ember.data import records
from ember.data.pipeline import data_iterator, global_batch, source_shares
from ember.errors import ConfigError, Diverged, one_line
from ember.hf import load as hf_load
from ember.layers.decoder import keys_of, stacked_layers
from ember.names import RECORD_SOURCES, SEGMENT_IDS
from ember.parallel import distributed, sharding
from ember.parallel.mesh import make_mesh
from ember.trainer import precision
from ember.trainer.checkpointing import Checkpointer, LocalCheckpoints, all_processes_ok, restore_from, stacked_of
from ember.trainer.metrics import (MOE_KEYS, MetricsWriter, MoeCounts, WandbRun, console, format_count, format_eta,
                                  progress, progress_line)
from ember.trainer.optimizer import make_optimizer
from ember.trainer.perf import Throughput, peak_bytes
from ember.trainer.phase import Phase
from ember.trainer.state import create_train_state, state_around, state_shardings
from ember.trainer.watchdog import Deadlines, Stragglers, Watchdog, xla_flags
from ember.xla_flags import loop_pipelining_note


def prepare(settings: Settings) -> tuple[Settings, Mesh]:
  """Joins the multi-process job, resolves the validated settings on its devices (`config.on_devices`), builds
  the mesh: (settings, mesh)."""
  _set_collective_timeouts(settings.train)
  if settings.train.compilation_cache_dir:  # Before anything compiles (the auto remat policy's candidates too).
    jax.config.update("jax_compilation_cache_dir", settings.train.compilation_cache_dir)
  distributed.initialize(settings.distributed)
  cfg = config_lib.on_devices(settings, jax.device_count())
  device = jax.local_devices()[0]
  if platform.target_platform() == "gpu" and not platform.divides_exactly(device):
    console("warning: float32 division on this GPU is not IEEE-rounded (JAX started its backend before ember was "
            "imported, without ember's XLA_FLAGS): quantization scales may differ from docs/quantization.md's rules "
            "by an ulp; import ember first, or set XLA_FLAGS=--xla_backend_extra_options=-nvptx-prec-divf32=2")
  note = loop_pipelining_note(os.environ.get("XLA_FLAGS", ""), cfg.model.scan_layers, cfg.mesh.sizes()["pipeline"])
  if platform.target_platform() == "gpu" and note:
    console(note)
  return cfg, make_mesh(cfg.mesh)


def _set_collective_timeouts(train_cfg) -> None:
  """XLA's GPU collective timeouts set past the watchdog's (watchdog.xla_flags), while JAX has not yet started its
  backend (a process that started it before keeps its own)."""
  from jax._src import xla_bridge  # No public query in JAX 0.10.
  try:
    step_s, compile_s = float(train_cfg.step_timeout_s), float(train_cfg.compile_timeout_s)
  except (AttributeError, TypeError, ValueError):  # Not a number: validation names the key.
    return
  if not xla_bridge.backends_are_initialized():
    os.environ["XLA_FLAGS"] = xla_flags(os.environ.get("XLA_FLAGS", ""), step_s, compile_s)


def _make_workdir(workdir: str) -> None:
  """config.validate checks the path without creating it; creating it can still fail where the permission
  bits allow it (a virtual or read-only file system such as /proc): one line, exit 2."""
  try:
    storage.makedirs(workdir)
  except OSError as e:
    raise ConfigError(f"config.workdir: cannot create {workdir}: {e.strerror or e}") from None


def train(cfg: Settings, mesh: Mesh | None = None) -> dict:
  """Runs (or resumes) the job the validated settings describe; returns a summary of the final figures.

  Without `mesh` the job is joined and the settings resolved on its devices here (`prepare`); with it, they are
  `prepare`'s. The loop is the step and, after it, one named hook each: the phase switch, preemption, log, eval
  and checkpoint."""
  t_start = time.time()
  if mesh is None:
    cfg, mesh = prepare(cfg)
  if cfg.remat.policy == "auto":
    raise ConfigError("config.remat.policy: 'auto' must be resolved before training (ember.plan.auto_remat.resolve; "
                      "train.py does it)")
  _make_workdir(cfg.workdir)
  with contextlib.ExitStack() as resources, sharding.use_rules(mesh, cfg.mesh.rules):
    run = _Run.open(cfg, mesh, resources)
    _warn_of_the_warm_up(cfg)  # Once the set-up holds: beside a set-up's error, a warning would be noise.
    first, timed_from, done = run.first, None, run.first
    last_ready = time.time()
    run.interval.restart()  # The first interval's time is its steps', not the set-up's or the first batch's.
    for step in range(first, cfg.steps):
      compiles = _compiles(run, step)
      # Long: a step that compiles, and the steps up to the first logged one (its first all-gathers, the
      # straggler probe's compile).
      if compiles or step < first + cfg.log.every_steps:
        run.watchdog.expect(f"step {step + 1}", *run.deadlines.long())
      else:
        run.watchdog.expect(f"step {step + 1}", *run.deadlines.step())
      entered = time.time()
      _switch_phase(run, step)
      if compiles:  # The compile has its own line; a step's figures are the step's.
        run.interval.exclude(time.time() - entered)
      run.profiler.before(step)
      run.state, step_metrics = run.phase.compiled(run.state, run.batch)
      # One step in flight at most: a SIGTERM is seen at the end of the step the device is running, not after the
      # steps the host had queued ahead of it (the next batch is ready in the pipeline's threads meanwhile).
      jax.block_until_ready(step_metrics["loss"])
      if not compiles:  # The loop's time a step, its hooks included: what the step's deadline is a multiple of.
        run.deadlines.timed(time.time() - last_ready)
      last_ready = time.time()
      run.moe.add(step, step_metrics)
      done = step + 1
      run.skips.count(done, step_metrics)
      # The first step carries the compile: not timed.
      timed_from = timed_from or (done, time.time(), run.interval.excluded_s)
      if run.profiler.stops(done):  # Writing a trace takes its time, left out of the speed like a checkpoint's.
        run.watchdog.expect(f"the profile's write at step {done}", *run.deadlines.long())
      with run.interval.left_out():
        run.profiler.after(done)
      stopping = _preempted(run, done)
      if done == first + 1 and not _logs_at(run, done, stopping):
        # The run's first step warms up (the allocator's pools, the collectives' communicators): left out of the
        # first line's speed and ETA, as it is of the summary's.
        run.interval.restart(at=done)
      _log(run, done, step_metrics, stopping)
      with run.interval.left_out():  # Speed and MFU are the steps': an evaluation is not training.
        _evaluate(run, done)
        _checkpoint(run, done, stopping)
      if stopping:
        console(f"preempted ({run.preemption.signal}): saved a checkpoint at step {done} in {run.ckpt.directory} and "
                "stopped")
        run.last["preempted"] = True
        break
      if done < cfg.steps:
        waited = time.time()
        run.batch = run.next_batch()
        run.stragglers.add_input_wait(time.time() - waited)
    run.watchdog.expect("the last checkpoint's write", *run.deadlines.long())
    if done == cfg.steps and done > first:
      console(_summary(run, first, timed_from, done, time.time() - t_start))
    elif first >= cfg.steps:
      console(f"finished already: {_restored_from(run, first)} is at step {first}, and the run trains to step "
              f"{cfg.steps}; nothing to train (a larger --config.steps goes on from it)")
  run.last["wall_time_s"] = time.time() - t_start
  return run.last


def _warn_of_the_warm_up(cfg: Settings) -> None:
  """A warm-up the run does not finish: the learning rate never reaches its peak (a large preset's warm-up kept by
  a short run: configs/default.py's 200 steps against llama3_8b's 2,000 of warm-up)."""
  t = cfg.train
  if t.warmup_steps > cfg.steps > 0 and t.learning_rate > 0:
    console(f"warning: train.warmup_steps={t.warmup_steps} is longer than the run (steps={cfg.steps}): the learning "
            f"rate rises to {cfg.steps / t.warmup_steps:.0%} of train.learning_rate and never decays; set "
            "--config.train.warmup_steps below steps")


def _restored_from(run: "_Run", first: int) -> str:
  """Which checkpoint the state after `first` steps came from: this run's, its local tier's, or
  checkpoint.restore_from's (a new run from another run's checkpoint)."""
  if first in run.ckpt.steps():
    return f"the newest checkpoint in {run.ckpt.directory}"
  if run.local is not None and storage.exists(storage.join(run.local.directory, str(first))):
    return f"the newest local checkpoint in {run.local.directory}"
  return f"the checkpoint of checkpoint.restore_from ({run.cfg.checkpoint.restore_from})"


def _wandb_run(cfg: Settings) -> WandbRun | None:
  """The W&B run of `log.wandb_project` (process 0), or None."""
  lg = cfg.log
  if not lg.wandb_project or jax.process_index() != 0:
    return None
  return WandbRun(project=lg.wandb_project, entity=lg.wandb_entity, name=lg.wandb_run_name, workdir=cfg.workdir,
                  config=cfg.to_dict())


def _plan(cfg: Settings, mesh, params) -> str:
  """What the run trains and how, in one block: the model and its parameter count (active, for MoE), a step's
  tokens, the devices and mesh axes in use, the precision and remat choices."""
  m, t = cfg.model, cfg.train

  def size(path, leaf):  # A stacked leaf's rows past the model's layers are a pipeline's padding: not counted.
    layers = stacked_layers(m, cfg.quant, keys_of(path))
    return leaf.size if layers is None else leaf.size // leaf.shape[0] * len(layers)

  total = sum(jax.tree.leaves(jax.tree_util.tree_map_with_path(size, params)))
  inactive = m.num_routed_layers * (m.num_experts - m.experts_per_token) * m.expert_params
  active = f" ({format_count(total - inactive)} active a token)" if inactive else ""
  micro = f", {t.grad_accum_steps} micro-batches" if t.grad_accum_steps > 1 else ""
  axes = {k: v for k, v in mesh.shape.items() if v > 1}
  return (f"model {m.name}: {format_count(total)} parameters{active}, {m.num_layers} layers, d_model {m.d_model}, "
          f"vocabulary {m.vocab_size:,}\n"
          f"  step: {format_count(t.batch_size * m.seq_len)} tokens (batch {t.batch_size} x {m.seq_len}{micro}); "
          f"{jax.device_count()} {jax.devices()[0].platform} device(s) in {jax.process_count()} process(es), mesh "
          + (" x ".join(f"{k} {v}" for k, v in axes.items()) or "of one device") + "\n"
          f"  precision: recipe {cfg.quant.name}, remat {cfg.remat.policy}, optimizer {t.optimizer}; "
          f"training to step {cfg.steps} in {cfg.workdir}")


def _summary(run: _Run, first: int, timed_from: tuple[int, float, float], done: int, wall_s: float) -> str:
  """The end of a finished run: what it trained, how fast (the steps after the first, which carries the
  compile, less the time the interval left out: evaluations, checkpoint writes), its last losses, and where its
  outputs are."""
  cfg = run.cfg
  tokens = (done - first) * cfg.train.batch_size * cfg.model.seq_len
  (timed_first, t0, excluded0), timed_steps = timed_from, done - timed_from[0]
  speed = ""
  if timed_steps > 0:
    step_s = (time.time() - t0 - (run.interval.excluded_s - excluded0)) / timed_steps
    perf = Throughput.of(cfg, step_s, jax.device_count(), jax.devices()[0].device_kind)
    mfu = "" if perf.mfu is None else f", MFU {perf.mfu:.1%}"
    speed = f"; {perf.tokens_per_s:,.0f} tokens/s{mfu} over steps {timed_first + 1}-{done}"
  losses = ", ".join(f"{k} {run.last[k]:.4f}" for k in ("loss", "eval_loss") if k in run.last)
  return (f"finished: {done - first} steps ({first + 1}-{done}), {tokens:,} tokens in {format_eta(wall_s)}{speed}; "
          f"{losses}; metrics {storage.join(cfg.workdir, 'metrics.jsonl')}, checkpoints "
          f"{run.ckpt.directory}")


@dataclasses.dataclass
class _Run:
  """Everything the loop's hooks share: the config and mesh, the data, writers and checkpointer, the state,
  the current precision phase, and the last logged figures (the summary `train` returns)."""
  cfg: Any
  mesh: Any
  train_it: Any
  metrics: MetricsWriter
  preemption: distributed.Preemption
  ckpt: Checkpointer
  local: LocalCheckpoints | None
  targets: Any  # step -> (shardings, abstract) of the state after that step (its precision phase's).
  phases: precision.Phases
  phase: Phase
  state: Any
  batch: Any
  batch_sharding: Any
  shares: Any
  meta: dict
  interval: "_Interval"
  profiler: "_Profiler"
  moe: MoeCounts
  reads_records: bool
  last: dict
  first: int  # The step the run starts after (its checkpoint's; 0 for a new run).
  watchdog: Watchdog
  deadlines: Deadlines
  stragglers: Stragglers
  skips: "_Skips"
  evaluated: bool = False

  @classmethod
  def open(cls, cfg: Settings, mesh, resources: contextlib.ExitStack) -> "_Run":
    """The set-up: data, writers, preemption handler and checkpointer (closed by `resources`), then the state
    restored or initialised and its first batch."""
    watch = Watchdog(process_index=jax.process_index())  # Closed last: it watches the others' closing too.
    resources.callback(watch.close)
    deadlines = Deadlines(cfg.train.step_timeout_s, cfg.train.compile_timeout_s)
    watch.expect("the set-up (data, checkpoint restore)", *deadlines.long())
    tx, schedule = make_optimizer(cfg)
    progress(f"set-up: the {cfg.data.source} data pipeline")
    batch_sharding = sharding.batch_sharding(cfg.mesh.rules_dict, mesh)
    train_it = data_iterator(cfg, "train", batch_sharding)
    resources.callback(train_it.close)
    metrics = MetricsWriter(cfg.workdir, tensorboard=cfg.log.tensorboard, wandb=_wandb_run(cfg))
    resources.push(lambda error_type, *_: metrics.close(failed=error_type is not None))
    preemption = distributed.Preemption().install()
    resources.callback(preemption.uninstall)
    ckpt = Checkpointer(storage.join(cfg.workdir, "checkpoints"), every_steps=cfg.checkpoint.every_steps,
                        keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_save)
    resources.callback(ckpt.close)
    phases = precision.Phases(cfg)
    targets = lambda step: state_shardings(phases.cfg(phases.state_phase(step)), mesh, tx)[1:]
    c = cfg.checkpoint
    local = LocalCheckpoints(c.local_dir, c.local_every_steps, mesh, cfg.seed, workdir=cfg.workdir) \
        if c.local_every_steps else None
    progress("set-up: the model state (the newest checkpoint, or initialised)")
    state, first = _restore_or_init(cfg, ckpt, local, mesh, tx, targets, metrics, train_it)
    if local is not None:
      local.forget_after(first)
    if first and first in ckpt.steps():  # Resumed from a persistent step: what it was trained with, read once.
      metadata = ckpt.custom_metadata(first)
      _check_phase(metadata, phases, first)
      _check_schedule(metadata, cfg, first)
    shares = source_shares(cfg)
    run = cls(cfg=cfg, mesh=mesh, train_it=train_it, metrics=metrics, preemption=preemption, ckpt=ckpt, local=local,
              targets=targets,
              phases=phases, phase=Phase(phases, phases.state_phase(first), mesh, tx, schedule),
              state=state, batch=None, batch_sharding=batch_sharding, shares=shares,
              meta={"config": cfg.to_dict(), "ember_version": ember.__version__, "mesh": dict(mesh.shape),
                    "process_count": jax.process_count()},
              interval=_Interval(cfg, start=first), profiler=_Profiler(cfg), moe=MoeCounts(),
              reads_records=_reads_records(cfg), last={"step": first}, first=first, watchdog=watch,
              deadlines=deadlines, stragglers=Stragglers(cfg.log.straggler_ratio),
              skips=_Skips(cfg.train.max_skipped_steps, skipped=first - int(state.step)))
    run.batch = run.next_batch()
    console(_plan(cfg, mesh, state.params))
    # Closing (the callbacks run last first, so this one first): an error's way out waits for a checkpoint write
    # in flight, which the last step's deadline was not made for.
    resources.callback(lambda: watch.expect("closing the run", *deadlines.long()))
    return run

  def next_batch(self):
    """The next global batch; a mixture's per-token sources are counted here and stay on the host."""
    rows = next(self.train_it)
    if self.train_it.primary:  # Rows that several processes feed (pipeline stages on other hosts) count once.
      self.shares.count(rows)
    return global_batch(rows, self.batch_sharding, self.cfg.train.batch_size)


def _reads_records(cfg: Settings) -> bool:
  kinds = {cfg.data.source} if not cfg.data.mixture else {source for _, source, *_ in cfg.data.mixture}
  return bool(kinds & set(RECORD_SOURCES))


# --- The hooks, in the order the loop calls them after each step ----------------------------------------------


def _compiles(run: _Run, step: int) -> bool:
  """Whether `step` starts a precision phase (the run's first step included), which compiles its step first."""
  return run.phases.at(step) != run.phase.index or run.phase.compiled is None


def _switch_phase(run: _Run, step: int) -> None:
  """Before a step: compiles the first phase, or moves the state into the precision phase `step` starts."""
  if _compiles(run, step):
    run.phase, run.state = run.phase.enter(run.phases.at(step), run.state, run.batch, step)
    run.evaluated = False  # The phase's evaluation compiles anew.


def _preempted(run: _Run, done: int) -> bool:
  """True at the step where every process saves and stops (a SIGTERM, agreed on by all processes)."""
  return run.preemption.reached(done) and done < run.cfg.steps


def _logs_at(run: _Run, done: int, stopping: bool) -> bool:
  """Whether step `done` is logged: every `log.every_steps`, the last, a preemption's, a statistics step."""
  cfg = run.cfg
  return done % cfg.log.every_steps == 0 or done == cfg.steps or stopping or _health_at(run, done)


def _health_at(run: _Run, done: int) -> bool:
  """Whether step `done` records the recipe's quantization statistics (`log.quant_stats_every`)."""
  return run.phase.quant_health is not None and done % run.cfg.log.quant_stats_every == 0


def _log(run: _Run, done: int, step_metrics, stopping: bool) -> None:
  """Every `log.every_steps` (and the last, a preemption's and a statistics step): one record in
  metrics.jsonl and TensorBoard, the progress line, and the warnings of the interval."""
  cfg, phase = run.cfg, run.phase
  if not _logs_at(run, done, stopping):
    return
  health = _health_at(run, done)
  host = jax.device_get({k: v for k, v in step_metrics.items() if k != "quant_stats" and k not in MOE_KEYS})
  record = {"step": done, **{k: float(v) for k, v in host.items()}, **run.interval.take(done),
            "skipped_steps": run.skips.total}
  if jax.process_count() > 1:
    with run.interval.left_out():  # The probe (its compile, then its runs) measures; it trains nothing.
      straggler, warning = run.stragglers.take(distributed.gather_over_processes)
    record.update(straggler)
    if warning:
      console(f"warning: {warning}")
  moe, moe_warnings = run.moe.take(done, phase.plan)
  record.update(moe)
  record["peak_bytes"], record["peak_source"] = peak_bytes(phase.compiled_peak)
  if len(cfg.phases) > 1:
    record["quant_phase"] = phase.index
  if health:
    record.update(phase.quant_health.record(done, step_metrics["quant_stats"]))
  record.update(run.shares.report())
  if run.reads_records:  # Bad records skipped by rule (ember/data/records.py), over all processes.
    skipped = records.skipped_records() if run.train_it.primary else 0  # Rows fed by several processes: once.
    record["data_skipped_records"] = int(distributed.sum_over_processes(np.int64(skipped)))
  run.metrics.write(record)
  console(progress_line(record, cfg.steps))
  for warning in moe_warnings:  # Never silent: these copies' expert outputs were zero.
    console(f"warning: {warning}")
  run.last.update(record)


def _evaluate(run: _Run, done: int) -> None:
  """Every `train.eval_every_steps` and at the end: the held-out loss, recorded and printed."""
  cfg = run.cfg
  if not cfg.train.eval_every_steps or (done % cfg.train.eval_every_steps and done != cfg.steps):
    return
  step_s, key = run.deadlines.step()  # The first evaluation compiles.
  if run.evaluated and step_s is not None:
    run.watchdog.expect(f"the evaluation at step {done}", step_s * cfg.train.eval_batches, key)
  else:
    run.watchdog.expect(f"the evaluation at step {done}", *run.deadlines.long())
  run.evaluated = True
  run.last["eval_loss"] = evaluate(cfg, run.state, run.phase.eval_fn, run.batch_sharding)
  run.metrics.write({"step": done, "eval_loss": run.last["eval_loss"]})
  console(f"step {done:>6}/{cfg.steps}  eval_loss {run.last['eval_loss']:.4f}")


def _checkpoint(run: _Run, done: int, stopping: bool) -> None:
  """Every `checkpoint.every_steps`, at the end, and synchronously when stopping for a preemption."""
  if run.ckpt.should_save(done, run.cfg.steps) or stopping:
    run.watchdog.expect(f"the checkpoint of step {done}", *run.deadlines.long())
    run.ckpt.save(done, run.state, run.train_it, seed=run.cfg.seed,
                  metadata={**run.meta, "quant_phase": run.phase.index}, force_sync=stopping)
    if not stopping:  # A preemption's save has its own line.
      console(f"checkpoint: step {done} to {os.path.join(run.ckpt.directory, str(done))}")
  elif run.local is not None and run.local.should_save(done):
    run.watchdog.expect(f"the local checkpoint of step {done}", *run.deadlines.long())
    began = time.time()
    run.local.save(done, run.state, run.targets(done)[0], run.train_it)
    console(f"local checkpoint: step {done} to {os.path.join(run.local.directory, str(done))} "
            f"({time.time() - began:.1f} s)")


class _Skips:
  """The steps skipped for a non-finite loss or gradient (the step itself leaves the state as it was:
  step.unless_non_finite): counted, each one warned of, and `limit` in a row (train.max_skipped_steps; 0 = no
  limit) end the run with `Diverged` (exit status 3); the checkpoints saved before stay as they are."""

  def __init__(self, limit: int, *, skipped: int):
    self.limit, self.total, self.in_a_row = limit, skipped, 0

  def count(self, done: int, step_metrics: dict) -> None:
    if not int(step_metrics.pop("skipped")):
      self.in_a_row = 0
      return
    self.total += 1
    self.in_a_row += 1
    loss, norm = (float(step_metrics[k]) for k in ("loss", "grad_norm"))
    console(f"warning: step {done}: loss {loss:.4g}, grad_norm {norm:.4g}: not finite, the step is skipped (no "
            f"update; {self.in_a_row} in a row, {self.total} in the run)")
    if self.limit and self.in_a_row >= self.limit:
      raise Diverged(f"train.max_skipped_steps: {self.in_a_row} steps in a row ({done - self.in_a_row + 1}-{done}) had "
                     f"a non-finite loss or gradients; stopped with the state of step {done - self.in_a_row} (its "
                     "checkpoints are as saved); lower the learning rate or look at those steps' data")


class _Interval:
  """Step time since the last logged step (the metrics fetch there is where the device is waited for), and
  the throughput, MFU and ETA that follow from it."""

  def __init__(self, cfg: Settings, *, start: int):
    self.cfg, self.t_last, self.step_last = cfg, time.time(), start
    self.excluded_s = 0.0  # All the time left out so far.

  def restart(self, at: int | None = None) -> None:
    """The interval starts now (after step `at`, where given)."""
    self.t_last = time.time()
    self.step_last = self.step_last if at is None else at

  def exclude(self, seconds: float) -> None:
    """Leaves `seconds` (a compile, an evaluation, a checkpoint's write) out of the interval's time and the run's
    speed (`_summary`)."""
    self.t_last += seconds
    self.excluded_s += seconds

  @contextlib.contextmanager
  def left_out(self):
    """`exclude`s the time the block takes."""
    start = time.time()
    try:
      yield
    finally:
      self.exclude(time.time() - start)

  def take(self, done: int) -> dict:
    now = time.time()
    step_time = (now - self.t_last) / max(done - self.step_last, 1)
    self.t_last, self.step_last = now, done
    perf = Throughput.of(self.cfg, step_time, jax.device_count(), jax.devices()[0].device_kind)
    return {**perf.to_dict(), "eta_s": step_time * (self.cfg.steps - done)}


class _Profiler:
  """A profiler trace of steps [train.profile_start_step, + train.profile_steps) into workdir/profile (written
  locally and copied there for a gs:// workdir); with several processes each into workdir/profile/process_<i>:
  the profiler names its file after the host, and processes sharing one (launch/local.sh, several tasks a node)
  wrote over each other's."""

  def __init__(self, cfg: Settings):
    self.start, self.stop = cfg.train.profile_start_step, cfg.train.profile_start_step + cfg.train.profile_steps
    where = storage.join(cfg.workdir, "profile")
    if jax.process_count() > 1:
      where = storage.join(where, f"process_{jax.process_index()}")
    self.last, self.dir = cfg.steps, storage.Mirror(where)
    self.active = False

  def before(self, step: int) -> None:
    if self.start >= 0 and step == self.start:
      jax.profiler.start_trace(self.dir.local)
      self.active = True

  def stops(self, done: int) -> bool:
    return self.active and (done == self.stop or done == self.last)

  def after(self, done: int) -> None:
    if self.stops(done):
      jax.profiler.stop_trace()
      self.dir.sync()
      self.active = False


def _restore_local(local, step: int, targets, train_it):
  """(state, processes restored from their peers) of local step `step`, or None where a process could not read its
  part (a damaged file): every process then resumes from the persistent tier, which checks its arrays, rather than
  fail on the same step at every restart."""
  error = None
  try:
    state, from_peers, position = local.restore(step, targets)
  except Exception as e:  # A truncated or garbled part: its own format's errors, of many types.
    error = e
  if all_processes_ok(error is None):
    if train_it is not None and position is not None:
      train_it.set_state(position)
    return state, from_peers
  console(f"warning: cannot restore the local checkpoint {os.path.join(local.directory, str(step))}"
          + (f" ({type(error).__name__}: {one_line(error)[:200]})" if error else " (on another process)")
          + "; resuming from the persistent tier")
  return None


def _restore_or_init(cfg: Settings, ckpt, local, mesh, tx, targets, metrics, train_it):
  """(state, the step it is after): resumes from the newest checkpoint of either tier (the local one when it is
  newer than the workdir's newest persistent step), else starts from checkpoint.init_from_hf,
  checkpoint.restore_from or init. `targets(step)`: (shardings, abstract) of the state after `step` steps (its
  precision phase's)."""
  newest_local = None if local is None else local.newest(targets, after=max(ckpt.steps(), default=0))
  restored_local = None if newest_local is None else _restore_local(local, newest_local, targets, train_it)
  if restored_local is not None:
    state, from_peers = restored_local
    metrics.truncate_after(newest_local)
    peers = f"; the parts of processes {from_peers} from their peers' copies" if from_peers else ""
    console(f"resumed from the local checkpoint {os.path.join(local.directory, str(newest_local))} at step "
            f"{newest_local}{peers}")
    return state, newest_local
  restored = ckpt.restore_latest(targets, train_it, seed=cfg.seed, stacked=stacked_of(cfg))
  if restored is not None:
    state, step = restored
    metrics.truncate_after(step)
    console(f"resumed from {ckpt.directory} at step {step}")
    return state, step
  init = lambda: create_train_state(cfg, mesh, tx)[1]
  metrics.truncate_after(0)  # A new run: no records of an earlier one in this workdir.
  if cfg.checkpoint.restore_from:
    return restore_from(cfg.checkpoint.restore_from, targets, train_it, params_only=cfg.checkpoint.params_only,
                        init=init, stacked=stacked_of(cfg))
  shardings, abstract = targets(0)
  if cfg.checkpoint.init_from_hf:
    params = hf_load.load_params(cfg.checkpoint.init_from_hf, cfg.model, cfg.quant, abstract.params,
                                 shardings.params)
    state = state_around(cfg, tx, params, shardings)
    if hf_load.keeps_router_biases(cfg.model):  # DeepSeek-V3's routers' biases (routing state, not parameters).
      state = dataclasses.replace(state, quant_state=hf_load.router_biases(cfg.checkpoint.init_from_hf, cfg.model,
                                                                           cfg.quant, state.quant_state))
    console(f"started from the Hugging Face model in {cfg.checkpoint.init_from_hf}")
  else:
    state = init()
  return state, 0


def _check_phase(metadata: dict, phases: precision.Phases, step: int) -> None:
  """Warns when the checkpoint of `step` (its `metadata`, Checkpointer.custom_metadata) was saved in another
  precision phase than this config's schedule puts its step in (quant.schedule edited between runs), or under
  other precision keys (quant.recipe changed between runs, to one of the same state): the run goes on in this
  config's phase."""
  saved = metadata.get("quant_phase")
  if saved is not None and saved != phases.state_phase(step):
    console(f"warning: the checkpoint of step {step} was saved in precision phase {saved}; this config's "
            f"quant.schedule puts step {step} in {phases.describe(phases.state_phase(step))}")
    return
  # As the checkpoint's JSON holds them (tuples as lists), to compare.
  plain = lambda v: json.loads(json.dumps(v, default=str))
  saved_quant, quant = metadata.get("config", {}).get("quant"), plain(phases.settings.to_dict()["quant"])
  # The schedule aside: where it moves the resumed step's phase, the warning above says so.
  changed = sorted(k for k in quant if k != "schedule" and saved_quant is not None and k in saved_quant
                   and plain(saved_quant[k]) != quant[k])
  if changed:
    console(f"warning: the checkpoint of step {step} was trained with other precision settings "
            f"({', '.join(f'quant.{k}={saved_quant.get(k)!r}' for k in changed)}); this run goes on with "
            + ", ".join(f"quant.{k}={quant[k]!r}" for k in changed))


def _check_schedule(metadata: dict, cfg: Settings, step: int) -> None:
  """Says so when a resumed run's learning-rate schedule is not the one the checkpoint of `step` (its `metadata`)
  was trained on: a larger `steps` with `train.decay_steps=0` stretches the decay over the new length from here
  on."""
  saved = metadata.get("config", {}).get("train", {})
  keys = ("learning_rate", "warmup_steps", "decay_steps", "min_lr_ratio")
  changed = [k for k in keys if k in saved and saved[k] != getattr(cfg.train, k)]
  if changed:
    console(f"note: the learning-rate schedule differs from the one step {step} was trained on: "
            + ", ".join(f"train.{k} {saved[k]} -> {getattr(cfg.train, k)}" for k in changed))


def evaluate(cfg: Settings, state, eval_fn, batch_sharding) -> float:
  """Mean loss per token over the first `train.eval_batches` batches of the held-out split (the same every time):
  each batch's mean weighted by its tokens (padding holds none), as one batch of them all would be."""
  it = data_iterator(cfg, "eval", batch_sharding)
  losses, counts = [], []
  try:
    for _ in range(cfg.train.eval_batches):
      batch = global_batch(next(it), batch_sharding, cfg.train.batch_size)
      losses.append(eval_fn(state, batch))
      counts.append(jnp.sum(batch[SEGMENT_IDS] > 0, dtype=jnp.float32))
  finally:
    it.close()
  counts = jnp.stack(counts)
  return float(jnp.sum(jnp.stack(losses) * counts) / jnp.maximum(jnp.sum(counts), 1.0))
