"""Load, override, validate and derive the one config tree.

`load(argv)` reads `--config=FILE[:ARG]` with ml_collections' `config_flags` (the file alone first, so
that its own errors name it) and applies `--config.a.b=v` overrides. `validate(cfg, num_devices)`
checks the whole tree once at start-up (each key's own type, bound or choices:
ember/config_schema.py; here, the rules across keys) and `derive(...)` fills the values computed
from others (head_dim, the mesh's -1 axis, the decay length) in this one place. Any problem raises
`ConfigError` whose message is one line naming the key; `train.py` prints it and exits with status 2.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import sys

import ml_collections
from absl import flags
from absl import logging as absl_logging
from ml_collections import config_flags

from ember import config_schema as schema
from ember import remat
from ember.errors import ConfigError, one_line
from ember.model_config import resolved_head_dim
from ember.names import BATCH, EXPERT, LOGICAL_AXES, MESH_AXES, MIXABLE_SOURCES, SOURCE_NEEDS
from ember.parallel import distributed
from ember.parallel import mesh as mesh_lib
from ember.quant import exclude as exclude_lib
from ember import config_phases
from ember.quant.recipe import Recipe

def load(argv: list[str], flag_values: flags.FlagValues | None = None) -> ml_collections.ConfigDict:
  """Parses `argv` (argv[0] is the program) into a config; raises ConfigError."""
  files = [a for a in argv[1:] if a == "--config" or a.startswith("--config=")]
  if not files:
    raise ConfigError("--config: missing; pass --config=configs/default.py")
  _load_file(argv[0], files[-1])  # The file alone first: its own errors are the file's, not an override's.
  fv = flag_values or flags.FlagValues()
  holder = config_flags.DEFINE_config_file("config", None, "Config file[:arg].", flag_values=fv, lock_config=True,
                                          sys_argv=list(argv))
  extra = [a for a in argv[1:] if not a.startswith("--config")]
  try:
    fv([argv[0]] + [a for a in argv[1:] if a.startswith("--config")], known_only=False)
    cfg = holder.value
    cfg.keys()  # A file that failed to load raises here.
  except Exception as e:  # absl/ml_collections raise many types; one line each.
    raise ConfigError(_explain(argv, e)) from None
  if extra:
    raise ConfigError(f"{extra[0]}: unknown command-line argument (expected --config=FILE and --config.KEY=VALUE)")
  return cfg


def _load_file(prog: str, arg: str) -> None:
  """Loads `--config=FILE[:ARG]` with no overrides; ConfigError naming the file and what is wrong with it."""
  spec = arg.split("=", 1)[1] if "=" in arg else ""
  path = spec.split(":", 1)[0]
  if not path:
    raise ConfigError("--config: empty; pass --config=FILE[:ARG], e.g. --config=configs/default.py")
  if not os.path.isfile(path):
    raise ConfigError(f"--config: no such config file: {path}")
  if not os.access(path, os.R_OK):
    raise ConfigError(f"--config: cannot read {path}: no read permission")
  sys.modules.pop("config_config", None)  # ml_collections would load the file into an earlier load's module.
  fv = flags.FlagValues()
  holder = config_flags.DEFINE_config_file("config", None, "", flag_values=fv, sys_argv=[prog, arg])
  verbosity = absl_logging.get_verbosity()
  absl_logging.set_verbosity(absl_logging.ERROR)  # ml_collections' warning for a None config: said below.
  try:
    fv([prog, arg], known_only=False)
    cfg = holder.value
  except Exception as e:  # Anything the file (or its get_config) raises.
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    if isinstance(e, AttributeError) and "get_config" in str(e):
      reason = "defines no get_config()"
    elif isinstance(e, SyntaxError) or not lines:
      reason = one_line(e)
    elif "Error whilst parsing config file" in lines[0]:
      reason = lines[-1]  # The traceback's last line: the exception get_config raised.
    else:
      reason = f"{type(e).__name__}: {lines[0]}"
    raise ConfigError(f"--config: {spec}: {reason}") from None
  finally:
    absl_logging.set_verbosity(verbosity)
  if not isinstance(cfg, ml_collections.ConfigDict):
    raise ConfigError(f"--config: {spec}: get_config() returned {type(cfg).__name__}, not a ConfigDict")


def _explain(argv: list[str], e: Exception) -> str:
  """Turns a failed override into one line naming the offending flag or key."""
  while isinstance(e, (AttributeError, KeyError)) and e.args and isinstance(e.args[0], KeyError):
    e = e.args[0]  # ml_collections wraps the KeyError that names the key.
  text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)  # str(KeyError) is a repr.
  msg = text.strip().splitlines()[0] if text.strip() else type(e).__name__
  if msg.startswith("Unknown command line flag 'config."):
    return f"{msg.split(chr(39))[1]}: unknown config key"
  if isinstance(e, (AttributeError, KeyError)):
    key = msg.strip("'\"")
    named = [a.split("=", 1)[0][2:] for a in argv if a.startswith("--config.")]
    named = [n for n in named if key in n.split(".")]
    unknown = [n for n in named if not schema.is_key(n.removeprefix("config."))]  # Not another flag's good key.
    if unknown or named:
      return f"{(unknown or named)[0]}: unknown config key"
    return f"config.{key}: unknown config key"
  bad = re.fullmatch(r"flag --(config\.[\w.]+)=(.*?): (.*)", msg)  # absl could not parse the value.
  if bad:
    key, value, reason = bad.groups()
    reason = "must be true or false" if "Non-boolean" in reason else reason.split(" If you intended")[0]
    return f"{key}: cannot parse {value!r}: {reason}"
  missing = re.fullmatch(r"Missing value for flag --(config\.[\w.]+)", msg)
  if missing:
    return f"{missing.group(1)}: no value; pass --{missing.group(1)}=VALUE"
  return msg.removeprefix("flag --")


def _fail(key: str, reason: str):
  raise ConfigError(f"config.{key}: {reason}")


def validate(cfg: ml_collections.ConfigDict, num_devices: int | None, process_count: int = 1) -> None:
  """Checks every key before anything is built; raises ConfigError naming the first bad key.

  `num_devices=None`: the devices are not known here (a sweep checks its runs before starting any); the
  mesh's sizes are then left to the run."""
  schema.check(cfg)
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
  for index, (start, phase) in enumerate(config_phases.precision_phases(cfg)[1:]):
    key = f"quant.schedule[{index}]"
    for q_key in schema.SCALARS:
      if q_key.startswith("quant."):
        try:
          schema.check_scalar(phase, q_key)
        except ConfigError as e:
          raise ConfigError(f"config.{key}: from step {start}: {str(e).removeprefix('config.')}") from None
    try:
      schema.check_string_tuple(phase, "quant.exclude")
      _validate_exclude(phase)
    except ConfigError as e:
      raise ConfigError(f"config.{key}: from step {start}: {str(e).removeprefix('config.')}") from None


def _validate_exclude(cfg) -> None:
  """The selectors as the recipe parses them (one parser, quant/exclude.py), against the model's layers."""
  try:
    exclude_lib.check_layers(Recipe(exclude=tuple(cfg.quant.exclude)).selectors, cfg.model.num_layers)
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
  if d.tokenizer != "byte" and not os.path.isfile(os.path.expanduser(d.tokenizer)) and not hf_tokenizer_json(
      d.tokenizer):
    _fail("data.tokenizer", f"no SentencePiece model, tokenizer.json or directory holding one at {d.tokenizer!r}")
  for key in ("mixture", "eval_mixture"):
    _validate_mixture(d, key)
  distributed.data_shards(d.num_shards, cfg.train.batch_size, 0, process_count)  # Raises naming the key.


_NEED_MEANING = {"path": "a glob of files", "text_key": "the field holding the text (text_key)",
                 "tfds_name": "a dataset name"}


def _missing_need(source: str, fields) -> str | None:
  """The first thing `source` needs (names.SOURCE_NEEDS) that `fields` leaves empty."""
  return next((need for need in SOURCE_NEEDS.get(source, ()) if not fields.get(need)), None)


def hf_tokenizer_json(path: str) -> str | None:
  """The Hugging Face `tokenizer.json` that a `data.tokenizer` value names (the file, or one in the named
  directory), or None."""
  path = os.path.expanduser(path)
  if os.path.isdir(path):
    path = os.path.join(path, "tokenizer.json")
  return path if path.endswith(".json") and os.path.isfile(path) else None


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
  problem = directory_problem(workdir)
  if problem:
    _fail("workdir", problem)


def directory_problem(directory: str) -> str | None:
  """Why `directory` cannot be (or be created as) a writable directory, or None; nothing is created."""
  if not directory:
    return "must name a directory"
  path = os.path.abspath(os.path.expanduser(directory))
  if os.path.exists(path) and not os.path.isdir(path):
    return f"{path} exists and is not a directory"
  existing = path
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    return f"cannot create {path}: {existing} is not a directory"
  if not os.access(existing, os.W_OK | os.X_OK):
    return f"cannot write to {path}: no write permission on {existing}"
  return None


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
  rules = _validate_rules(cfg.mesh.rules)
  if num_devices is None:
    return
  sizes = mesh_lib.mesh_shape(cfg.mesh, num_devices)
  batch_shards = sizes["data"] * sizes["fsdp"] * sizes["expert"]
  if cfg.train.batch_size % batch_shards:
    _fail("train.batch_size", f"{cfg.train.batch_size} is not divisible by the data-parallel size "
          f"data*fsdp*expert={batch_shards}")
  accum = cfg.train.grad_accum_steps
  if (cfg.train.batch_size // batch_shards) % accum:
    _fail("train.grad_accum_steps", f"{accum} does not divide the sequences each device holds: train.batch_size="
          f"{cfg.train.batch_size} / data*fsdp*expert={batch_shards} = {cfg.train.batch_size // batch_shards}")
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
