"""Load, override, validate and derive the one config tree.

`load(argv)` reads `--config=FILE[:ARG]` with ml_collections' `config_flags` and applies
`--config.a.b=v` overrides. `validate(cfg, num_devices)` checks the whole tree once at start-up
and `derive(...)` fills the values computed from others (head_dim, the mesh's -1 axis, the
decay length) in this one place. Any problem raises `ConfigError` whose message is one line
naming the key; `train.py` prints it and exits with status 2.
"""

from __future__ import annotations

import glob
import math
import os
import sys

import ml_collections
from absl import flags
from ml_collections import config_flags

from ember.quant.recipe import RECIPES

DATA_SOURCES = ("synthetic", "text", "array_record", "tfds")
MESH_AXES = ("data", "fsdp", "tensor", "expert")


class ConfigError(ValueError):
  """A bad command line or config value; the message names the key and the reason."""


def load(argv: list[str], flag_values: flags.FlagValues | None = None) -> ml_collections.ConfigDict:
  """Parses `argv` (argv[0] is the program) into a config; raises ConfigError."""
  fv = flag_values or flags.FlagValues()
  holder = config_flags.DEFINE_config_file("config", None, "Config file[:arg].", flag_values=fv, lock_config=True,
                                          sys_argv=list(argv))
  extra = [a for a in argv[1:] if not a.startswith("--config")]
  try:
    fv([argv[0]] + [a for a in argv[1:] if a.startswith("--config")], known_only=False)
    cfg = holder.value
    if cfg is None:
      raise ConfigError("--config: missing; pass --config=configs/default.py")
    cfg.keys()  # A file that failed to load raises here.
  except ConfigError:
    raise
  except Exception as e:  # absl/ml_collections raise many types; one line each.
    raise ConfigError(_explain(argv, e)) from None
  if extra:
    raise ConfigError(f"{extra[0]}: unknown command-line argument (expected --config=FILE and --config.KEY=VALUE)")
  return cfg


def _explain(argv: list[str], e: Exception) -> str:
  """Turns a config_flags failure into one line naming the offending flag or key."""
  msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
  config_arg = next((a for a in argv if a.startswith("--config=")), None)
  if config_arg is not None:
    path = config_arg.split("=", 1)[1].split(":", 1)[0]
    if not os.path.isfile(path):
      return f"--config: no such config file: {path}"
  if msg.startswith("Unknown command line flag 'config."):
    return f"{msg.split(chr(39))[1]}: unknown config key"
  if isinstance(e, (AttributeError, KeyError)):
    key = msg.strip("'\"")
    for a in argv:
      if a.startswith("--config.") and key in a.split("=", 1)[0].split("."):
        return f"{a.split('=', 1)[0][2:]}: unknown config key"
    return f"config.{key}: unknown config key"
  if msg.startswith("flag --"):
    return msg[len("flag --"):]
  return msg


def _fail(key: str, reason: str):
  raise ConfigError(f"config.{key}: {reason}")


def _positive(cfg, *keys):
  for key in keys:
    value = _get(cfg, key)
    if not isinstance(value, (int, float)) or value <= 0:
      _fail(key, f"must be > 0, got {value!r}")


def _get(cfg, dotted):
  node = cfg
  for part in dotted.split("."):
    node = node[part]
  return node


def validate(cfg: ml_collections.ConfigDict, num_devices: int) -> None:
  """Checks everything that can be checked before building anything; raises ConfigError."""
  m, t = cfg.model, cfg.train
  _positive(cfg, "steps", "model.num_layers", "model.d_model", "model.num_heads", "model.num_kv_heads",
            "model.d_ff", "model.vocab_size", "model.seq_len", "train.batch_size", "log.every_steps")
  if t.learning_rate < 0:
    _fail("train.learning_rate", f"must be >= 0, got {t.learning_rate}")
  if not m.head_dim and m.d_model % m.num_heads:
    _fail("model.num_heads", f"{m.num_heads} heads do not divide model.d_model={m.d_model}")
  if m.num_heads % m.num_kv_heads:
    _fail("model.num_kv_heads", f"{m.num_kv_heads} kv heads do not divide model.num_heads={m.num_heads}")
  if m.num_experts < 0:
    _fail("model.num_experts", f"must be >= 0, got {m.num_experts}")
  if m.num_experts and not 0 < m.experts_per_token <= m.num_experts:
    _fail("model.experts_per_token", f"must be in [1, num_experts={m.num_experts}], got {m.experts_per_token}")
  if m.moe_every < 1:
    _fail("model.moe_every", f"must be >= 1, got {m.moe_every}")
  for key in ("param_dtype", "dtype"):
    if m[key] not in ("float32", "bfloat16", "float16"):
      _fail(f"model.{key}", f"must be float32, bfloat16 or float16, got {m[key]!r}")
  if m.attention not in ("auto", "xla", "cudnn"):
    _fail("model.attention", f"must be auto, xla or cudnn, got {m.attention!r}")
  if cfg.quant.recipe not in RECIPES:
    _fail("quant.recipe", f"unknown recipe {cfg.quant.recipe!r}; choose one of {', '.join(RECIPES)}")
  if cfg.quant.amax_compute_algo not in ("max", "most_recent"):
    _fail("quant.amax_compute_algo", f"must be max or most_recent, got {cfg.quant.amax_compute_algo!r}")
  _positive(cfg, "quant.amax_history_len")
  if cfg.data.source not in DATA_SOURCES:
    _fail("data.source", f"unknown source {cfg.data.source!r}; choose one of {', '.join(DATA_SOURCES)}")
  _validate_data_paths(cfg)
  _validate_mesh(cfg, num_devices)
  from ember import remat  # Late import: remat imports layer names, which import jax.
  remat.validate(cfg.remat)


def _validate_data_paths(cfg):
  d = cfg.data
  if d.source in ("text", "array_record") and d.path and not glob.glob(os.path.expanduser(d.path), recursive=True):
    _fail("data.path", f"no file matches {d.path!r}")
  if d.source == "array_record" and not d.path:
    _fail("data.path", "source array_record needs a glob of .array_record files")
  if d.source == "tfds" and not d.tfds_name:
    _fail("data.tfds_name", "source tfds needs a dataset name")
  if d.tokenizer != "byte" and not os.path.isfile(d.tokenizer):
    _fail("data.tokenizer", f"no SentencePiece model at {d.tokenizer!r}")


def is_moe_layer(model_cfg, index: int) -> bool:
  """Layer `index` is MoE when experts are on and it closes a group of `moe_every` layers."""
  return bool(model_cfg.num_experts) and index % model_cfg.moe_every == model_cfg.moe_every - 1


def num_moe_layers(model_cfg) -> int:
  return sum(is_moe_layer(model_cfg, i) for i in range(model_cfg.num_layers))


def mesh_shape(cfg, num_devices: int) -> dict[str, int]:
  """{axis: size} for data, fsdp, tensor, expert: the -1 axis resolved, dcn (across-host) sizes folded in."""
  ici, dcn = _ici_dcn(cfg, num_devices)
  return {a: ici[a] * dcn[a] for a in MESH_AXES}


def _ici_dcn(cfg, num_devices: int) -> tuple[dict[str, int], dict[str, int]]:
  """Per-host sizes (`mesh.a`, -1 resolved) and host counts (`mesh.dcn_a`) of each axis."""
  dcn = {a: int(cfg.mesh.get(f"dcn_{a}", 1)) for a in MESH_AXES}
  for a, d in dcn.items():
    if d < 1:
      _fail(f"mesh.dcn_{a}", f"must be >= 1, got {d}")
  hosts = math.prod(dcn.values())
  if num_devices % hosts:
    key = next(f"mesh.dcn_{a}" for a, d in dcn.items() if d > 1)
    _fail(key, f"the dcn axes ask for {hosts} hosts, which do not divide the {num_devices} devices")
  per_host = num_devices // hosts
  ici = {a: int(cfg.mesh[a]) for a in MESH_AXES}
  fill = [a for a, s in ici.items() if s < 0]
  if len(fill) > 1:
    _fail(f"mesh.{fill[1]}", "only one mesh axis may be -1")
  for a, s in ici.items():
    if s == 0 or s < -1:
      _fail(f"mesh.{a}", f"must be >= 1 or -1, got {s}")
  known = math.prod(s for s in ici.values() if s > 0)
  if fill:
    if per_host % known:
      where = " per host" if hosts > 1 else ""
      _fail(f"mesh.{fill[0]}", f"cannot fill: {per_host} devices{where} are not divisible by the other axes' "
            f"product {known}")
    ici[fill[0]] = per_host // known
  if math.prod(ici.values()) != per_host:
    shape = ", ".join(f"{a}={s * dcn[a]}" for a, s in ici.items())
    _fail("mesh", f"mesh ({shape}) has {math.prod(ici.values()) * hosts} devices but {num_devices} are available")
  return ici, dcn


def _validate_mesh(cfg, num_devices):
  sizes = mesh_shape(cfg, num_devices)
  batch_shards = sizes["data"] * sizes["fsdp"] * sizes["expert"]
  if cfg.train.batch_size % batch_shards:
    _fail("train.batch_size", f"{cfg.train.batch_size} is not divisible by the data-parallel size "
          f"data*fsdp*expert={batch_shards}")
  m = cfg.model
  if sizes["tensor"] > 1 and m.num_kv_heads % sizes["tensor"]:
    _fail("mesh.tensor", f"{sizes['tensor']} does not divide model.num_kv_heads={m.num_kv_heads}")
  if m.num_experts and m.num_experts % sizes["expert"]:
    _fail("mesh.expert", f"{sizes['expert']} does not divide model.num_experts={m.num_experts}")


def derive(cfg: ml_collections.ConfigDict, num_devices: int) -> ml_collections.ConfigDict:
  """Returns a copy with derived values filled in; the one place they are computed."""
  out = ml_collections.ConfigDict(cfg.to_dict())
  if not out.model.head_dim:
    out.model.head_dim = out.model.d_model // out.model.num_heads
  ici, _ = _ici_dcn(cfg, num_devices)
  for axis, size in ici.items():
    out.mesh[axis] = size  # Within a host; make_mesh multiplies by mesh.dcn_<axis>.
  if not out.train.decay_steps:
    out.train.decay_steps = max(out.steps - out.train.warmup_steps, 1)
  return out


def fail_and_exit(err: Exception) -> None:
  """Prints one line and exits with status 2 (bad command line, config or input path)."""
  print(f"error: {err}", file=sys.stderr)
  sys.exit(2)
