"""Shared test helpers: small configs, fixed batches, the trainer's start-up in one call."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

from configs import default  # noqa: E402
from ember import config as config_lib  # noqa: E402
from ember import remat  # noqa: E402
from ember.parallel.mesh import make_mesh  # noqa: E402
from ember.parallel.sharding import use_rules  # noqa: E402
from ember.parallel.sharding import batch_sharding
from ember.trainer.optimizer import make_optimizer  # noqa: E402
from ember.trainer.state import TrainState, create_train_state  # noqa: E402
from ember.trainer.step import jit_train_step  # noqa: E402
from tests.xla_cpu import cpu_xla_flags, step_options


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


def loaded(argv: list[str]):
  """The validated settings of a command line (`config.load`, then `config.validate` without devices): what a
  tool hands on to the trainer, the compile or the planner."""
  return config_lib.validate(config_lib.load(argv), None)


def checked(cfg):
  """A config tree validated without devices: the settings `train()` takes."""
  return config_lib.validate(cfg, None)


def settings(preset: str = "tiny", num_devices: int = 1, **overrides):
  """`config(preset, **overrides)` validated and derived for `num_devices` devices: the typed settings."""
  cfg = config(preset, **overrides)
  return config_lib.validate(cfg, num_devices)


def random_batch(cfg, seed: int = 0, segments: int = 2) -> dict[str, np.ndarray]:
  """A packed batch: each row holds `segments` documents of random tokens, then padding."""
  rng = np.random.default_rng(seed)
  b, length = cfg.train.batch_size, cfg.model.seq_len
  vocab = cfg.model.vocab_size or 256  # 0: the tokenizer's, the byte tokenizer's 256 in these tests.
  tokens = rng.integers(0, min(vocab, 256), (b, length + 1), dtype=np.int32)
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


@dataclasses.dataclass
class Start:
  """What the trainer sets up before its first step (ember/trainer/loop.py): the validated, derived config,
  the mesh of its first devices, the optimizer and lr schedule, and the fresh sharded train state."""
  cfg: Any
  mesh: Mesh
  tx: Any
  schedule: Any
  graphdef: Any
  state: TrainState
  shardings: TrainState

  def rules(self):
    """The context the model runs in: the config's logical-axis rules on this mesh."""
    return use_rules(self.mesh, self.cfg.mesh.rules)


def start(cfg, num_devices: int = 1) -> Start:
  """The one start-up sequence of the tests: validate, derive, mesh, optimizer, state."""
  cfg = config_lib.validate(cfg, num_devices)
  mesh = make_mesh(cfg.mesh, devices(num_devices))
  tx, schedule = make_optimizer(cfg)
  with use_rules(mesh, cfg.mesh.rules):
    graphdef, state, shardings = create_train_state(cfg, mesh, tx)
  return Start(cfg, mesh, tx, schedule, graphdef, state, shardings)


def one_device_start(**overrides) -> Start:
  """`start` of `config(**overrides)` on one device."""
  return start(config(**overrides), 1)


def run_steps(cfg, batches, num_devices: int, policy_name: str | None = None):
  """(each step's metrics, the final state), on the host, of len(batches) train steps of `cfg` on the first
  `num_devices` devices (under the remat preset `policy_name`, default the config's), jitted as the trainer jits
  the step."""
  s = start(cfg, num_devices)
  policy = remat.preset(s.cfg.remat, policy_name)
  sharding = batch_sharding(s.cfg.mesh.rules_dict, s.mesh)
  with s.rules():
    step = jit_train_step(s.cfg, s.mesh, s.graphdef, s.tx, s.schedule, s.shardings, policy=policy, donate=False)
    state, out, compiled = s.state, [], None
    for batch in batches:
      batch = {k: jax.device_put(v, sharding) for k, v in batch.items()}
      compiled = compiled or step.lower(state, batch).compile(compiler_options=step_options(s.cfg))
      state, metrics = compiled(state, batch)
      out.append(jax.device_get(metrics))
  return out, jax.device_get(state)


def train_losses(cfg, batches, num_devices: int, policy_name: str | None = None):
  """Losses of len(batches) train steps of `cfg` on the first `num_devices` devices (`run_steps`)."""
  return [float(m["loss"]) for m in run_steps(cfg, batches, num_devices, policy_name)[0]]


def one_step(cfg, batch, num_devices: int):
  """(metrics, new state), on the host, of one train step of `cfg` on the first `num_devices` devices, jitted as the
  trainer jits it (its state not donated)."""
  s = start(cfg, num_devices)
  sharding = batch_sharding(s.cfg.mesh.rules_dict, s.mesh)
  with s.rules():
    step = jit_train_step(s.cfg, s.mesh, s.graphdef, s.tx, s.schedule, s.shardings, donate=False)
    batch = {k: jax.device_put(v, sharding) for k, v in batch.items()}
    new_state, metrics = step.lower(s.state, batch).compile(compiler_options=step_options(s.cfg))(s.state, batch)
  return jax.device_get((metrics, new_state))


def compiled_text(cfg, num_devices: int) -> tuple[str, Start]:
  """(the optimised HLO of `cfg`'s train step compiled as the trainer jits it for its first `num_devices` devices,
  on a batch laid out as the trainer lays it out; the `Start` it was compiled from)."""
  s = start(cfg, num_devices)
  batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=batch_sharding(s.cfg.mesh.rules_dict, s.mesh))
           for k, v in random_batch(cfg).items()}
  with s.rules():
    step = jit_train_step(s.cfg, s.mesh, s.graphdef, s.tx, s.schedule, s.shardings, donate=False)
    return step.lower(s.state, batch).compile().as_text(), s


def rel_error(a, b) -> float:
  """max |a - b| over max |b| (float64)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def train_processes(args: list[str], count: int = 2, devices: int = 2) -> list[subprocess.Popen]:
  """`python train.py ARGS` as `count` real processes of one jax.distributed job on 127.0.0.1, `devices` CPU devices
  each, started directly (not through launch/local.sh) so that a test can signal each one; stderr piped."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = {k: v for k, v in os.environ.items() if not k.startswith(("EMBER_", "XLA_FLAGS"))}
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_xla_flags(devices),
             EMBER_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", EMBER_NUM_PROCESSES=str(count),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")  # With the session's cache (conftest.py): a restart
  # compiles nothing.
  return [subprocess.Popen([sys.executable, "train.py", *args], cwd=ROOT, env={**env, "EMBER_PROCESS_ID": str(i)},
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in range(count)]
