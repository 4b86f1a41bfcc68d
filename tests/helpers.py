"""Shared test helpers: small configs, fixed batches, a one-call train-state factory."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

from configs import default  # noqa: E402


def config(preset: str = "tiny", **overrides):
  """`configs/default.py:PRESET` with dotted overrides, e.g. config(**{"quant.recipe": "nvfp4"})."""
  cfg = default.get_config(preset)
  cfg.data.source = "synthetic"
  cfg.train.eval_every_steps = 0
  cfg.log.tensorboard = False
  for key, value in overrides.items():
    node = cfg
    *parents, leaf = key.split(".")
    for p in parents:
      node = node[p]
    node[leaf] = value
  return cfg


def random_batch(cfg, seed: int = 0, segments: int = 2) -> dict[str, np.ndarray]:
  """A packed batch: each row holds `segments` documents of random tokens, then padding."""
  rng = np.random.default_rng(seed)
  b, length = cfg.train.batch_size, cfg.model.seq_len
  tokens = rng.integers(0, min(cfg.model.vocab_size, 256), (b, length + 1), dtype=np.int32)
  seg = np.zeros((b, length), np.int32)
  pos = np.zeros((b, length), np.int32)
  bounds = np.linspace(0, length - length // 8, segments + 1).astype(int)
  for s in range(segments):
    seg[:, bounds[s]:bounds[s + 1]] = s + 1
    pos[:, bounds[s]:bounds[s + 1]] = np.arange(bounds[s + 1] - bounds[s])
  inputs, targets = tokens[:, :-1] * (seg > 0), tokens[:, 1:] * (seg > 0)
  return {"inputs": inputs, "targets": targets, "segment_ids": seg, "positions": pos}


def devices(n: int):
  return jax.devices()[:n]


def one_device_start(**overrides):
  """A validated, derived `config(**overrides)` on one device and its fresh state:
  (cfg, mesh, tx, lr schedule, remat preset, graphdef, state, state shardings)."""
  from ember import config as config_lib
  from ember import remat
  from ember.parallel.mesh import make_mesh
  from ember.parallel.sharding import use_rules
  from ember.trainer.optimizer import make_optimizer
  from ember.trainer.state import create_train_state

  cfg = config(**overrides)
  config_lib.validate(cfg, 1, 1)
  cfg = config_lib.derive(cfg, 1)
  mesh = make_mesh(cfg.mesh, devices(1))
  tx, schedule = make_optimizer(cfg.train)
  policy = remat.preset(cfg.remat)
  with use_rules(mesh, cfg.mesh.rules):
    graphdef, state, shardings = create_train_state(cfg, mesh, tx, policy)
  return cfg, mesh, tx, schedule, policy, graphdef, state, shardings


def train_losses(cfg, batches, num_devices: int, policy_name: str | None = None):
  """Losses of len(batches) train steps of `cfg` on the first `num_devices` devices."""
  from ember import config as config_lib
  from ember import remat
  from ember.parallel.mesh import make_mesh
  from ember.parallel.sharding import use_rules
  from ember.trainer.optimizer import make_optimizer
  from ember.trainer.state import create_train_state
  from ember.trainer.step import batch_sharding, jit_train_step

  config_lib.validate(cfg, num_devices)
  cfg = config_lib.derive(cfg, num_devices)
  mesh = make_mesh(cfg.mesh, devices(num_devices))
  tx, schedule = make_optimizer(cfg.train)
  policy = remat.preset(cfg.remat, policy_name)
  sharding = batch_sharding(cfg, mesh)
  with use_rules(mesh, cfg.mesh.rules):
    graphdef, state, shardings = create_train_state(cfg, mesh, tx, policy)
    step = jit_train_step(cfg, mesh, graphdef, tx, schedule, shardings, donate=False)
    losses = []
    for batch in batches:
      batch = {k: jax.device_put(v, sharding) for k, v in batch.items()}
      state, metrics = step(state, batch)
      losses.append(float(metrics["loss"]))
  return losses
