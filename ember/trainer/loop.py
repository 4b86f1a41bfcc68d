"""The training loop: set up, restore, compile once, step, log, evaluate, checkpoint, stop cleanly.

The device never waits for the host: the jitted step runs ahead asynchronously and metrics are
fetched once per log interval (that fetch is also where step time is measured). SIGTERM (a
preemption notice; with several processes JAX's preemption service agrees on the step) ends the
loop after the current step with a synchronous checkpoint, and the process exits 0.
"""

from __future__ import annotations

import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from ember import config as config_lib
from ember import remat
from ember.data import build_tokenizer, make_iterator
from ember.parallel import distributed
from ember.parallel.mesh import make_mesh
from ember.parallel.sharding import use_rules
from ember.trainer import flops as flops_lib
from ember.trainer import step as step_lib
from ember.trainer.checkpointing import Checkpointer, CheckpointError, ShardedIterator
from ember.trainer.metrics import MetricsWriter, compiled_peak_bytes, console, device_peak_bytes, progress_line
from ember.trainer.optimizer import make_optimizer
from ember.trainer.state import create_train_state, state_shardings
from ember.trainer.step import eval_step

__version__ = "0.1.0"


def _global_batch(batch: dict, sharding: NamedSharding) -> dict:
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in batch.items()}


def setup(cfg):
  """Validates and derives the config, builds the mesh; returns (cfg, mesh)."""
  distributed.initialize(cfg.distributed)
  num_devices = jax.device_count()
  config_lib.validate(cfg, num_devices)
  cfg = config_lib.derive(cfg, num_devices)
  tokenizer = build_tokenizer(cfg.data) if cfg.data.source != "synthetic" else None
  if tokenizer is not None and tokenizer.vocab_size > cfg.model.vocab_size:
    raise config_lib.ConfigError(f"config.model.vocab_size: {cfg.model.vocab_size} is smaller than the "
                                 f"tokenizer's vocabulary ({tokenizer.vocab_size})")
  return cfg, make_mesh(cfg.mesh)


def data_iterator(cfg, split: str) -> ShardedIterator:
  """This process's rows of each global batch: its contiguous block of `data.num_shards` shards."""
  num_shards = int(cfg.data.get("num_shards", 0)) or jax.process_count()
  if cfg.train.batch_size % num_shards:
    raise config_lib.ConfigError(f"config.data.num_shards: {num_shards} shards do not divide "
                                 f"train.batch_size={cfg.train.batch_size}")
  make = lambda shard: make_iterator(cfg.data, seq_len=cfg.model.seq_len, global_batch_size=cfg.train.batch_size,
                                     seed=cfg.seed, split=split, process_index=shard, process_count=num_shards,
                                     vocab_size=cfg.model.vocab_size)
  return ShardedIterator(make, distributed.data_shards(num_shards), num_shards)


def resolve_policy(cfg, mesh, tx, schedule) -> remat.Preset:
  if cfg.remat.policy != "auto":
    return remat.preset(cfg.remat)
  from ember.tools.auto_remat import choose  # Compiles candidates: only when asked for.
  return remat.preset(cfg.remat, choose(cfg, mesh, tx, schedule))


def train(cfg) -> dict:
  """Runs (or resumes) the job the config describes; returns a summary of the final figures."""
  t_start = time.time()
  cfg, mesh = setup(cfg)
  tx, schedule = make_optimizer(cfg.train)
  batch_sharding = step_lib.batch_sharding(cfg, mesh)
  metrics = MetricsWriter(cfg.workdir, tensorboard=cfg.log.tensorboard)
  preemption = distributed.Preemption().install()
  with use_rules(mesh, cfg.mesh.rules):
    policy = resolve_policy(cfg, mesh, tx, schedule)
    graphdef, shardings, abstract = state_shardings(cfg, mesh, tx, policy)
    ckpt = Checkpointer(os.path.join(cfg.workdir, "checkpoints"), every_steps=cfg.checkpoint.every_steps,
                        keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_save)
    ckpt_metadata = {"config": cfg.to_dict(), "ember_version": __version__, "mesh": dict(mesh.shape),
                     "process_count": jax.process_count()}
    train_it = data_iterator(cfg, "train")
    state = _restore_or_init(cfg, ckpt, mesh, tx, policy, abstract, shardings, metrics, train_it)
    start = int(state.step)

    step_fn = step_lib.jit_train_step(cfg, mesh, graphdef, tx, schedule, shardings)
    eval_fn = jax.jit(functools.partial(eval_step, graphdef=graphdef, cfg=cfg),
                      in_shardings=(shardings, batch_sharding))
    batch = _global_batch(next(train_it), batch_sharding)
    t0 = time.time()
    compiled = step_fn.lower(state, batch).compile()
    compiled_peak = compiled_peak_bytes(compiled)
    memory = "no memory analysis" if compiled_peak is None else f"compiled peak {compiled_peak / 2**30:.2f} GiB/device"
    console(f"compiled the train step in {time.time() - t0:.1f}s ({memory}; remat {cfg.remat.policy}, "
            f"recipe {cfg.quant.recipe}, mesh {dict(mesh.shape)})")
    flops_per_step = flops_lib.train_flops_per_step(cfg)
    peak = flops_lib.peak_tflops(jax.devices()[0].device_kind)
    tokens_per_step = cfg.train.batch_size * cfg.model.seq_len
    last = {"step": start}
    t_log, step_at_log = time.time(), start
    profile = cfg.train.profile_start_step
    for step in range(start, cfg.steps):
      if step == profile:
        jax.profiler.start_trace(os.path.join(cfg.workdir, "profile"))
      state, step_metrics = compiled(state, batch)
      done = step + 1
      if profile >= 0 and (done == profile + cfg.train.profile_steps or (done == cfg.steps and step >= profile)):
        jax.profiler.stop_trace()
      stopping = preemption.reached(done) and done < cfg.steps
      if done % cfg.log.every_steps == 0 or done == cfg.steps or stopping:
        host = jax.device_get(step_metrics)
        now = time.time()
        step_time = (now - t_log) / max(done - step_at_log, 1)
        t_log, step_at_log = now, done
        record = {"step": done, **{k: float(v) for k, v in host.items()},
                  "step_time_s": step_time, "tokens_per_s": tokens_per_step / step_time,
                  "tflops_per_device": flops_per_step / step_time / jax.device_count() / 1e12}
        record["mfu"] = None if peak is None else record["tflops_per_device"] / peak
        record["eta_s"] = step_time * (cfg.steps - done)
        device_peak, record["peak_source"] = device_peak_bytes()
        record["peak_bytes"] = compiled_peak if device_peak is None else device_peak
        metrics.write(record)
        console(progress_line(record, cfg.steps))
        last.update(record)
      if cfg.train.eval_every_steps and (done % cfg.train.eval_every_steps == 0 or done == cfg.steps):
        eval_loss = evaluate(cfg, state, eval_fn, batch_sharding)
        metrics.write({"step": done, "eval_loss": eval_loss})
        console(f"step {done:>6}/{cfg.steps}  eval_loss {eval_loss:.4f}")
        last["eval_loss"] = eval_loss
      if ckpt.should_save(done, cfg.steps) or stopping:
        ckpt.save(done, state, train_it, seed=cfg.seed, metadata=ckpt_metadata, force_sync=stopping)
      if stopping:
        console(f"preempted (SIGTERM): saved a checkpoint at step {done} in {ckpt.directory} and stopped")
        break
      if done < cfg.steps:
        batch = _global_batch(next(train_it), batch_sharding)
    ckpt.close()
  metrics.close()
  train_it.close()
  preemption.uninstall()
  last["wall_time_s"] = time.time() - t_start
  return last


def _restore_or_init(cfg, ckpt, mesh, tx, policy, abstract, shardings, metrics, train_it):
  """Resumes from the workdir's latest checkpoint, else starts from checkpoint.restore_from or from init."""
  restored = ckpt.restore_latest(abstract, shardings, train_it, seed=cfg.seed)
  if restored is not None:
    state, step = restored
    metrics.truncate_after(step)
    console(f"resumed from {ckpt.directory} at step {step}")
    return state
  init = lambda: create_train_state(cfg, mesh, tx, policy)[1]
  if cfg.checkpoint.restore_from:
    from ember.trainer.checkpointing import restore_from  # Another run's checkpoint.
    state = restore_from(cfg.checkpoint.restore_from, abstract, shardings, train_it,
                         params_only=cfg.checkpoint.params_only, init=init)
  else:
    state = init()
  metrics.truncate_after(0)  # A new run: no records of an earlier one in this workdir.
  return state


def evaluate(cfg, state, eval_fn, batch_sharding) -> float:
  """Mean loss over the first `train.eval_batches` batches of the held-out split (the same every time)."""
  it = data_iterator(cfg, "eval")
  try:
    losses = [eval_fn(state, _global_batch(next(it), batch_sharding)) for _ in range(cfg.train.eval_batches)]
  finally:
    it.close()
  return float(jnp.mean(jnp.stack(losses)))


__all__ = ["train", "setup", "evaluate", "CheckpointError"]
