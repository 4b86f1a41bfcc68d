"""The command line to a config tree: `load(argv)` reads `--config=FILE[:ARG]` with ml_collections'
`config_flags` (the file alone first, so that its own errors name it) and applies `--config.a.b=v` overrides.
Any problem raises `ConfigError` whose message is one line naming the flag or key; `train.py` prints it and
exits with status 2. What the tree may hold is checked next (ember/config/checks.py).
"""

from __future__ import annotations

import os
import re
import sys

import ml_collections
from absl import flags
from absl import logging as absl_logging
from ml_collections import config_flags

from ember.config import schema
from ember.errors import ConfigError, one_line
from ember.quant.recipe import RECIPES

def load(argv: list[str], flag_values: flags.FlagValues | None = None) -> ml_collections.ConfigDict:
  """Parses `argv` (argv[0] is the program) into a config; raises ConfigError."""
  files = [a for a in argv[1:] if a == "--config" or a.startswith("--config=")]
  if not files:
    raise ConfigError("--config: missing; pass --config=configs/default.py")
  if len(files) > 1:
    raise ConfigError(f"--config: given {len(files)} times ({', '.join(files)}); pass one config file and change "
                      "keys with --config.KEY=VALUE")
  base = _load_file(argv[0], files[-1])  # The file alone first: its own errors are the file's, not an override's.
  for flag in (a for a in argv[1:] if a.startswith("--config.")):
    key = flag[2:].split("=", 1)[0]
    if not re.fullmatch(r"config(\.[A-Za-z_]\w*)+", key):
      raise ConfigError(f"{flag}: not a config override; pass --config.KEY=VALUE")
    value = _value(base, key)
    if value is _UNDER_A_VALUE:  # ml_collections' own message names the key's type, not the key.
      raise ConfigError(_unknown(key))
    if "=" not in flag and value is not _MISSING and not isinstance(value, bool):  # absl would take the next flag.
      raise ConfigError(f"{key}: no value; pass {flag}=VALUE")
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


def _load_file(prog: str, arg: str) -> ml_collections.ConfigDict:
  """Loads `--config=FILE[:ARG]` with no overrides; ConfigError naming the file and what is wrong with it."""
  if "=" not in arg:  # `--config FILE`: the file reached argv as an argument of its own.
    raise ConfigError("--config: give the file in the same argument, --config=FILE[:ARG], e.g. "
                      "--config=configs/default.py")
  spec = arg.split("=", 1)[1]
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
  return cfg


_MISSING, _UNDER_A_VALUE = object(), object()


def _value(cfg: ml_collections.ConfigDict, dotted: str):
  """The value at `config.KEY` (`dotted`); `_MISSING` where the file has no such key (absl names it),
  `_UNDER_A_VALUE` where a part of the key is a value, not a section."""
  node = cfg
  for part in dotted.split(".")[1:]:
    if not isinstance(node, ml_collections.ConfigDict):
      return _UNDER_A_VALUE
    if part not in node:
      return _MISSING
    node = node[part]
  return node


def _explain(argv: list[str], e: Exception) -> str:
  """Turns a failed override into one line naming the offending flag or key."""
  while isinstance(e, (AttributeError, KeyError)) and e.args and isinstance(e.args[0], KeyError):
    e = e.args[0]  # ml_collections wraps the KeyError that names the key.
  text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)  # str(KeyError) is a repr.
  msg = text.strip().splitlines()[0] if text.strip() else type(e).__name__
  if msg.startswith("Unknown command line flag 'config."):
    return _unknown(msg.split(chr(39))[1])
  if isinstance(e, (AttributeError, KeyError)):
    key = msg.strip("'\"")
    named = [a.split("=", 1)[0][2:] for a in argv if a.startswith("--config.")]
    named = [n for n in named if key in n.split(".")]
    unknown = [n for n in named if not schema.is_key(n.removeprefix("config."))]  # Not another flag's good key.
    if unknown or named:
      return _unknown((unknown or named)[0])
    return _unknown(f"config.{key}")
  bad = re.fullmatch(r"flag --(config\.[\w.]+)=(.*?): (.*)", msg)  # absl could not parse the value.
  if bad:
    key, value, reason = bad.groups()
    reason = "must be true or false" if "Non-boolean" in reason else reason.split(" If you intended")[0]
    return f"{key}: cannot parse {value!r}: {reason}"
  missing = re.fullmatch(r"Missing value for flag --(config\.[\w.]+)", msg)
  if missing:
    return f"{missing.group(1)}: no value; pass --{missing.group(1)}=VALUE"
  return msg.removeprefix("flag --")



def _unknown(flag: str) -> str:
  """The one line for an unknown `config.KEY`, with the nearest known key; or, for a key ember knows that the
  config file does not hold, that."""
  if schema.is_key(flag.removeprefix("config.")):
    return (f"{flag}: the config file does not define this key (ember/config/defaults.py does: build the file's "
            "config from it, as configs/default.py does)")
  return f"{flag}: unknown config key" + schema.did_you_mean(flag.removeprefix("config."))


USAGE = """usage: python train.py --config=configs/default.py[:PRESET] [--config.KEY=VALUE ...]

Trains the model the config describes.
  PRESET  a model shape in configs/models/: {presets}
  KEY     any key of ember/config/defaults.py, e.g. --config.steps=1000 --config.quant.recipe=RECIPE
  RECIPE  {recipes}
A bad flag, key or value exits 2 with one line naming it. README.md goes from install to a multi-host GPU launch."""


def usage() -> str:
  """`python train.py --help`: the command line and the model presets."""
  try:
    from configs.models import PRESETS
    presets = ", ".join(PRESETS)
  except ImportError:  # Run outside the repository: no presets beside it.
    presets = "run from the repository to list them"
  return USAGE.format(presets=presets, recipes=", ".join(RECIPES))


