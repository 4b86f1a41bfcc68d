"""Load, override, validate and derive the one config tree.

`load(argv)` reads `--config=FILE[:ARG]` with ml_collections' `config_flags` and applies
`--config.a.b=v` overrides. `validate(cfg, num_devices)` checks the whole tree once at start-up
and `derive(...)` fills the values computed from others (head_dim, the mesh's -1 axis, the
decay length) in this one place. Any problem raises `ConfigError` whose message is one line
naming the key; `train.py` prints it and exits with status 2.
"""

from __future__ import annotations

import glob
import importlib.util
import math
import os

import ml_collections
from absl import flags
from ml_collections import config_flags

from ember import remat
from ember.errors import ConfigError
from ember.model_config import resolved_head_dim
from ember.parallel import mesh as mesh_lib
from ember.names import (BATCH, DATA_SOURCES, EXPERT, LOGICAL_AXES, MESH_AXES, MIXABLE_SOURCES, MOE_DISPATCHERS,
                         MOE_EXPERT_GEMMS, SOURCE_NEEDS)
from ember.quant import exclude as exclude_lib
from ember.quant import schedule as schedule_lib
from ember.quant.recipe import FORWARDS, RECIPES

DTYPES = ("float32", "bfloat16", "float16")


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
  while isinstance(e, (AttributeError, KeyError)) and e.args and isinstance(e.args[0], KeyError):
    e = e.args[0]  # ml_collections wraps the KeyError that names the key.
  text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)  # str(KeyError) is a repr.
  msg = text.strip().splitlines()[0] if text.strip() else type(e).__name__
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


def _get(cfg, dotted):
  node = cfg
  for part in dotted.split("."):
    node = node[part]
  return node


# --- Value checks, one table: every scalar key of configs/base.py and what it may hold. -------------
# (kind, bound): kind is int | float | bool | str; bound is "" (none), ">0", ">=N", "[0,1]" or "[0,1)".
_SCALARS = {
    "workdir": ("str", ""), "seed": ("int", ">=0"), "steps": ("int", ">=1"),
    "model.name": ("str", ""), "model.num_layers": ("int", ">=1"), "model.d_model": ("int", ">=1"),
    "model.num_heads": ("int", ">=1"), "model.num_kv_heads": ("int", ">=1"), "model.head_dim": ("int", ">=0"),
    "model.d_ff": ("int", ">=1"), "model.vocab_size": ("int", ">=1"), "model.seq_len": ("int", ">=1"),
    "model.rope_theta": ("float", ">0"), "model.norm_eps": ("float", ">=0"),
    "model.tie_embeddings": ("bool", ""), "model.param_dtype": ("str", ""),
    "model.dtype": ("str", ""), "model.attention": ("str", ""),
    "model.init_std": ("float", ">=0"), "model.num_experts": ("int", ">=0"),
    "model.experts_per_token": ("int", ">=1"), "model.moe_every": ("int", ">=1"),
    "model.shared_expert_d_ff": ("int", ">=0"), "model.router_softmax_first": ("bool", ""),
    "model.capacity_factor": ("float", ">=0"), "model.moe_dispatch": ("str", ""),
    "model.moe_ragged_buffer": ("float", ">0"), "model.moe_expert_gemm": ("str", ""),
    "model.moe_expert_buffer": ("float", ">0"), "model.load_balance_weight": ("float", ">=0"),
    "model.router_z_weight": ("float", ">=0"),
    "train.batch_size": ("int", ">=1"), "train.learning_rate": ("float", ">=0"),
    "train.warmup_steps": ("int", ">=0"), "train.decay_steps": ("int", ">=0"),
    "train.min_lr_ratio": ("float", "[0,1]"), "train.b1": ("float", "[0,1)"), "train.b2": ("float", "[0,1)"),
    "train.eps": ("float", ">0"), "train.weight_decay": ("float", ">=0"),
    "train.decay_norms_and_embeddings": ("bool", ""), "train.grad_clip_norm": ("float", ">=0"),
    "train.loss_chunk_size": ("int", ">=0"), "train.z_loss_weight": ("float", ">=0"),
    "train.eval_every_steps": ("int", ">=0"), "train.eval_batches": ("int", ">=1"),
    "train.profile_start_step": ("int", ">=-1"), "train.profile_steps": ("int", ">=1"),
    "quant.recipe": ("str", ""), "quant.amax_history_len": ("int", ">=1"),
    "quant.amax_compute_algo": ("str", ""), "quant.margin": ("int", ">=0"),
    "quant.nvfp4_rht": ("bool", ""), "quant.nvfp4_stochastic_rounding": ("bool", ""),
    "quant.nvfp4_2d_weights": ("bool", ""), "quant.rht_seed": ("int", ">=0"), "quant.forward": ("str", ""),
    "remat.policy": ("str", ""), "remat.memory_budget_gb": ("float", ">=0"),
    "data.source": ("str", ""), "data.path": ("str", ""), "data.tokenizer": ("str", ""),
    "data.eval_fraction": ("float", "[0,1]"), "data.chunk_shuffle_window": ("int", ">=0"),
    "data.tfds_name": ("str", ""), "data.tfds_data_dir": ("str", ""),
    "data.tfds_text_key": ("str", ""), "data.text_key": ("str", ""), "data.cache_dir": ("str", ""),
    "data.num_threads": ("int", ">=1"), "data.num_shards": ("int", ">=0"),
    "mesh.dcn_data": ("int", ">=1"), "mesh.dcn_fsdp": ("int", ">=1"),
    "checkpoint.every_steps": ("int", ">=-1"), "checkpoint.keep": ("int", ">=1"),
    "checkpoint.async_save": ("bool", ""), "checkpoint.restore_from": ("str", ""),
    "checkpoint.params_only": ("bool", ""), "checkpoint.init_from_hf": ("str", ""),
    "log.every_steps": ("int", ">=1"), "log.tensorboard": ("bool", ""), "log.quant_stats_every": ("int", ">=0"),
    "distributed.coordinator_address": ("str", ""), "distributed.num_processes": ("int", ">=0"),
    "distributed.process_id": ("int", ">=-1"),
}
# Keys holding a tuple of strings.
_STRING_TUPLES = ("quant.exclude", "remat.save_names", "remat.offload_names", "remat.auto_candidates")
# Keys with a fixed set of values.
_CHOICES = {
    "model.param_dtype": DTYPES, "model.dtype": DTYPES, "model.attention": ("auto", "xla", "cudnn"),
    "model.moe_dispatch": MOE_DISPATCHERS, "model.moe_expert_gemm": MOE_EXPERT_GEMMS,
    "quant.recipe": RECIPES, "quant.amax_compute_algo": ("max", "most_recent"), "quant.forward": FORWARDS,
    "remat.policy": remat.POLICIES,
    "data.source": DATA_SOURCES,
}
_TYPES = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}
_KIND_NAMES = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}


def _in_bound(value, bound: str) -> bool:
  if not bound:
    return True
  if bound == ">0":
    return value > 0
  if bound == "[0,1]":
    return 0 <= value <= 1
  if bound == "[0,1)":  # Adam's betas: 1 would divide by zero in the bias correction.
    return 0 <= value < 1
  return value >= float(bound[2:])


def _check_scalar(cfg, key: str, kind: str, bound: str) -> None:
  value = _get(cfg, key)
  if isinstance(value, bool) and kind in ("int", "float") or not isinstance(value, _TYPES[kind]):
    _fail(key, f"must be {_KIND_NAMES[kind]}, got {value!r}")
  if kind in ("int", "float") and not math.isfinite(value):
    _fail(key, f"must be finite, got {value!r}")
  if not _in_bound(value, bound):
    said = {"[0,1]": "in [0, 1]", "[0,1)": "in [0, 1)", ">0": "> 0"}.get(bound, f">= {bound[2:]}")
    _fail(key, f"must be {said}, got {value!r}")
  if key in _CHOICES and value not in _CHOICES[key]:
    _fail(key, f"unknown value {value!r}; choose one of {', '.join(_CHOICES[key])}")


def _check_string_tuple(cfg, key: str) -> tuple[str, ...]:
  value = _get(cfg, key)
  if not isinstance(value, (tuple, list)):
    _fail(key, f"must be a tuple of strings, e.g. ('a', 'b'), got {value!r}")
  bad = next((v for v in value if not isinstance(v, str)), None)
  if bad is not None:
    _fail(key, f"must hold strings only, got {bad!r}")
  return tuple(value)


def _base_config() -> ml_collections.ConfigDict | None:
  """configs/base.py of this checkout (every key, with its default); None where it is not shipped."""
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "base.py")
  if not os.path.isfile(path):
    return None
  spec = importlib.util.spec_from_file_location("_ember_base_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def _check_known_keys(cfg) -> None:
  """Exactly the keys of configs/base.py: an extra key is a typo, a missing one a config file that did
  not start from `base.get_config()`."""
  known = _base_config()

  def walk(node, ref, prefix):
    for k in node.keys():
      if k not in ref:
        _fail(prefix + k, "unknown config key (configs/base.py lists every key)")
      if isinstance(node[k], ml_collections.ConfigDict) and isinstance(ref[k], ml_collections.ConfigDict):
        walk(node[k], ref[k], f"{prefix}{k}.")
    missing = next((k for k in ref.keys() if k not in node), None)
    if missing is not None:
      _fail(prefix + missing, "missing config key (start the config from configs/base.py's get_config())")

  if known is not None:
    walk(cfg, known, "")


def validate(cfg: ml_collections.ConfigDict, num_devices: int, process_count: int = 1) -> None:
  """Checks every key before anything is built; raises ConfigError naming the first bad key."""
  _check_known_keys(cfg)
  for key, (kind, bound) in _SCALARS.items():
    _check_scalar(cfg, key, kind, bound)
  for key in _STRING_TUPLES:
    _check_string_tuple(cfg, key)
  _validate_model(cfg.model)
  _validate_quant(cfg)
  remat.validate(cfg.remat)
  _validate_data(cfg, process_count)
  _validate_mesh(cfg, num_devices)
  _validate_paths(cfg)


def _validate_model(m) -> None:
  if not m.head_dim and m.d_model % m.num_heads:
    _fail("model.num_heads", f"{m.num_heads} heads do not divide model.d_model={m.d_model} (or set model.head_dim)")
  if m.num_heads % m.num_kv_heads:
    _fail("model.num_kv_heads", f"{m.num_kv_heads} kv heads do not divide model.num_heads={m.num_heads}")
  if resolved_head_dim(m) % 2:
    _fail("model.head_dim", f"rotary embeddings need an even head_dim, got {resolved_head_dim(m)}")
  if m.num_experts:
    if m.experts_per_token > m.num_experts:
      _fail("model.experts_per_token", f"must be in [1, num_experts={m.num_experts}], got {m.experts_per_token}")
    if m.num_layers % m.moe_every:
      _fail("model.moe_every", f"model.num_layers={m.num_layers} is not a multiple of moe_every={m.moe_every}")


def _validate_quant(cfg) -> None:
  _validate_exclude(cfg)
  for index, (start, phase) in enumerate(schedule_lib.precision_phases(cfg)[1:]):
    key = f"quant.schedule[{index}]"
    for q_key, (kind, bound) in _SCALARS.items():
      if q_key.startswith("quant."):
        try:
          _check_scalar(phase, q_key, kind, bound)
        except ConfigError as e:
          raise ConfigError(f"config.{key}: from step {start}: {str(e).removeprefix('config.')}") from None
    try:
      _check_string_tuple(phase, "quant.exclude")
      _validate_exclude(phase)
    except ConfigError as e:
      raise ConfigError(f"config.{key}: from step {start}: {str(e).removeprefix('config.')}") from None


def _validate_exclude(cfg) -> None:
  selectors = []
  for entry in cfg.quant.exclude:
    try:
      selectors.append(exclude_lib.parse(entry))
    except ValueError as e:
      _fail("quant.exclude", str(e))
  try:
    exclude_lib.check_layers(tuple(selectors), cfg.model.num_layers)
  except ValueError as e:
    _fail("quant.exclude", str(e))


def _validate_data(cfg, process_count: int) -> None:
  d = cfg.data
  missing = _missing_need(d.source, d)
  if missing:
    _fail(f"data.{missing}", f"source {d.source} needs {_NEED_MEANING[missing]}")
  if d.source == "tfds":
    if importlib.util.find_spec("tensorflow_datasets") is None:
      _fail("data.source", "'tfds' needs tensorflow-datasets; install the extra: pip install -e '.[tfds]'")
  if d.tokenizer != "byte" and not os.path.isfile(os.path.expanduser(d.tokenizer)):
    _fail("data.tokenizer", f"no SentencePiece model at {d.tokenizer!r}")
  for key in ("mixture", "eval_mixture"):
    _validate_mixture(d, key)
  shards = d.num_shards or cfg.train.batch_size  # 0: one shard per row of the global batch.
  if d.num_shards and cfg.train.batch_size % shards:
    _fail("data.num_shards", f"{shards} data shards do not divide train.batch_size={cfg.train.batch_size}")
  if shards % process_count:
    _fail("data.num_shards" if d.num_shards else "train.batch_size",
          f"{shards} data shards cannot be split over {process_count} processes")


_NEED_MEANING = {"path": "a glob of files", "text_key": "the field holding the text (text_key)",
                 "tfds_name": "a dataset name"}


def _missing_need(source: str, fields) -> str | None:
  """The first thing `source` needs (names.SOURCE_NEEDS) that `fields` leaves empty."""
  return next((need for need in SOURCE_NEEDS.get(source, ()) if not fields.get(need)), None)


def _validate_mixture(d, key: str) -> None:
  """`data.mixture` / `data.eval_mixture`: (name, source, path, text_key, weight) entries."""
  entries = d[key]
  if not isinstance(entries, (tuple, list)):
    _fail(f"data.{key}", f"must be a tuple of (name, source, path, text_key, weight) entries, got {entries!r}")
  names = set()
  for entry in entries:
    if not isinstance(entry, (tuple, list)) or len(entry) != 5:
      _fail(f"data.{key}", f"entry {entry!r} is not (name, source, path, text_key, weight)")
    name, source, path, text_key, weight = entry
    if not isinstance(name, str) or not name or name in names:
      _fail(f"data.{key}", f"entry {entry!r}: the name must be a new, non-empty string")
    names.add(name)
    if source not in MIXABLE_SOURCES:
      _fail(f"data.{key}", f"source {name!r}: unknown kind {source!r}; choose one of {', '.join(MIXABLE_SOURCES)}")
    if not isinstance(path, str) or not isinstance(text_key, str):
      _fail(f"data.{key}", f"source {name!r}: path and text_key must be strings")
    missing = _missing_need(source, {"path": path, "text_key": text_key})
    if missing:
      _fail(f"data.{key}", f"source {name!r}: {source} needs {_NEED_MEANING[missing]}")
    if path and source != "synthetic" and not glob.glob(os.path.expanduser(path), recursive=True):
      _fail(f"data.{key}", f"source {name!r}: no file matches {path!r}")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
      _fail(f"data.{key}", f"source {name!r}: the weight must be a number > 0, got {weight!r}")


def _validate_paths(cfg) -> None:
  d = cfg.data
  if d.source not in ("synthetic", "tfds") and d.path and not glob.glob(
      os.path.expanduser(d.path), recursive=True):
    _fail("data.path", f"no file matches {d.path!r}")
  restore = cfg.checkpoint.restore_from
  if restore and not os.path.isdir(os.path.expanduser(restore)):
    _fail("checkpoint.restore_from", f"no checkpoint directory at {restore}")
  hf = cfg.checkpoint.init_from_hf
  if hf:
    if restore:
      _fail("checkpoint.init_from_hf", "set together with checkpoint.restore_from; a run starts from one of them")
    if not os.path.isfile(os.path.join(os.path.expanduser(hf), "config.json")):
      _fail("checkpoint.init_from_hf", f"no Hugging Face model directory (config.json) at {hf}")
  _validate_workdir(cfg.workdir)


def _validate_workdir(workdir: str) -> None:
  """The run writes metrics and checkpoints under `workdir`: it must be (or be creatable as) a writable
  directory. Checked without creating anything."""
  if not workdir:
    _fail("workdir", "must name a directory")
  path = os.path.abspath(os.path.expanduser(workdir))
  if os.path.exists(path) and not os.path.isdir(path):
    _fail("workdir", f"{path} exists and is not a directory")
  existing = path
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    _fail("workdir", f"cannot create {path}: {existing} is not a directory")
  if not os.access(existing, os.W_OK | os.X_OK):
    _fail("workdir", f"cannot write to {path}: no write permission on {existing}")


# --- The mesh -----------------------------------------------------------------------------------------


def _validate_rules(rules) -> dict[str, tuple[str, ...]]:
  """`mesh.rules`: pairs (logical axis, None | mesh axis | tuple of mesh axes)."""
  out = {}
  if not isinstance(rules, (tuple, list)):
    _fail("mesh.rules", f"must be a tuple of (logical axis, mesh axes) pairs, got {rules!r}")
  for rule in rules:
    if not isinstance(rule, (tuple, list)) or len(rule) != 2 or not isinstance(rule[0], str):
      _fail("mesh.rules", f"entry {rule!r} is not a (logical axis, mesh axes) pair")
    logical, axes = rule
    if logical not in LOGICAL_AXES:
      _fail("mesh.rules", f"unknown logical axis {logical!r}; ember's layers name {', '.join(LOGICAL_AXES)}")
    axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
    if not isinstance(axes, (tuple, list)) or any(a not in MESH_AXES for a in axes):
      _fail("mesh.rules", f"{logical!r} maps to {rule[1]!r}; mesh axes are {', '.join(MESH_AXES)} (or None)")
    out[logical] = tuple(axes)
  return out


def _validate_mesh(cfg, num_devices):
  sizes = mesh_lib.mesh_shape(cfg.mesh, num_devices)
  rules = _validate_rules(cfg.mesh.rules)
  batch_shards = sizes["data"] * sizes["fsdp"] * sizes["expert"]
  if cfg.train.batch_size % batch_shards:
    _fail("train.batch_size", f"{cfg.train.batch_size} is not divisible by the data-parallel size "
          f"data*fsdp*expert={batch_shards}")
  m = cfg.model
  if sizes["tensor"] > 1 and m.num_kv_heads % sizes["tensor"]:
    _fail("mesh.tensor", f"{sizes['tensor']} does not divide model.num_kv_heads={m.num_kv_heads}")
  if m.num_experts and m.num_experts % sizes["expert"]:
    _fail("mesh.expert", f"{sizes['expert']} does not divide model.num_experts={m.num_experts}")
  if m.num_experts and sizes["expert"] > 1:
    expert_axes = [a for a in rules.get(EXPERT, ()) if sizes[a] > 1]
    missing = [a for a in expert_axes if a not in rules.get(BATCH, ())]
    if missing:
      _fail("mesh.rules", f"expert parallelism over {missing[0]!r} needs the batch sharded over it too "
            f"('batch' -> (..., {missing[0]!r}))")


def derive(cfg: ml_collections.ConfigDict, num_devices: int) -> ml_collections.ConfigDict:
  """Returns a copy with derived values filled in; the one place they are computed."""
  out = ml_collections.ConfigDict(cfg.to_dict())
  out.model.head_dim = resolved_head_dim(out.model)
  ici, _ = mesh_lib.ici_dcn(cfg.mesh, num_devices)
  for axis, size in ici.items():
    out.mesh[axis] = size  # Within a host; make_mesh multiplies by mesh.dcn_<axis>.
  if not out.train.decay_steps:
    out.train.decay_steps = max(out.steps - out.train.warmup_steps, 1)
  return out
