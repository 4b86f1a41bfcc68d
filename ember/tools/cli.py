"""What the command-line tools share besides ember.errors.ArgumentParser: unknown flags refused, and the
checks of the paths a tool writes, made before any work so that a long compile never ends in a traceback
about its output file."""

from __future__ import annotations

import argparse
import json
import os

from ember.errors import ConfigError


def split_config(argv: list[str]) -> tuple[list[str], list[str]]:
  """(the tool's own flags, what config.load reads: the program name and the `--config*` flags) of a tool's
  argv."""
  own = [a for a in argv[1:] if not a.startswith("--config")]
  return own, [argv[0]] + [a for a in argv[1:] if a.startswith("--config")]


def settings(config_argv: list[str], *overrides: str, unread: bool = True):
  """The validated settings (ember.config.Settings) of the `--config*` flags `split_config` kept, with
  `overrides` (more `--config.KEY=VALUE` flags, after the user's); the devices are resolved by the tool.
  `unread=False`: no warnings of keys a run would not read (a tool that compares policies reads them all)."""
  from ember import config as config_lib
  return config_lib.validate(config_lib.load([*config_argv, *overrides]), None, unread=unread)


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
  """`parser.parse_known_args(argv)`; an argument it does not know is a ConfigError naming it."""
  args, unknown = parser.parse_known_args(argv)
  if unknown:
    raise ConfigError(f"{unknown[0]}: unknown command-line argument")
  return args


def parse_with_overrides(parser: argparse.ArgumentParser, argv: list[str],
                         expected: str) -> tuple[argparse.Namespace, dict[str, str]]:
  """(the tool's flags, {key: value} of its `--config.KEY=VALUE` flags) for a tool that starts runs of its own and
  hands them the overrides; anything else is a ConfigError naming it and what `expected` lists."""
  args, unknown = parser.parse_known_args(argv)
  overrides = {}
  for a in unknown:
    if not a.startswith("--config.") or "=" not in a:
      raise ConfigError(f"{a}: unknown command-line argument (expected {expected}, --config.KEY=VALUE)")
    key, value = a[len("--config."):].split("=", 1)
    overrides[key] = value
  return args, overrides


def boolean(value: str) -> bool:
  """An argparse type for a switch that may also be given a value: true / false, 1 / 0, yes / no."""
  if value.lower() in ("true", "1", "yes"):
    return True
  if value.lower() in ("false", "0", "no"):
    return False
  raise ValueError(value)


def check_out_file(flag: str, path: str) -> None:
  """`path` can be written as a file: not a directory, in an existing directory this process may write."""
  if not path:
    raise ConfigError(f"{flag}: empty; name the file to write")
  full = os.path.abspath(os.path.expanduser(path))
  if os.path.isdir(full):
    raise ConfigError(f"{flag}: {path} is a directory; name a file")
  parent = os.path.dirname(full)
  if not os.path.isdir(parent):
    raise ConfigError(f"{flag}: cannot write {path}: no directory {parent}")
  if not os.access(parent, os.W_OK | os.X_OK) or os.path.exists(full) and not os.access(full, os.W_OK):
    raise ConfigError(f"{flag}: cannot write {path}: no write permission")


def check_out_files(paths: dict[str, str]) -> None:
  """`check_out_file` for each {flag: path} given a path (an empty one: that file is not wanted)."""
  for flag, path in paths.items():
    if path:
      check_out_file(flag, path)


def check_out_dir(flag: str, path: str) -> None:
  """`path` is, or can be created as, a directory this process may write (nothing is created)."""
  from ember import storage
  from ember.config import directory_problem
  if storage.is_remote(path) or storage.scheme_problem(path):
    raise ConfigError(f"{flag}: {path}: the tools write their outputs to a local directory")
  problem = directory_problem(path)
  if problem:
    raise ConfigError(f"{flag}: {problem}")


def make_out_dir(flag: str, path: str) -> None:
  """`check_out_dir`, then the directory made: what the check cannot know (a read-only mount, /proc, any path for
  root, whom the permission bits do not stop) fails here, before any work, as a ConfigError naming it."""
  check_out_dir(flag, path)
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise ConfigError(f"{flag}: cannot create {path}: {e.strerror or e}") from None


def write_json(flag: str, path: str, obj) -> None:
  """Writes `obj` as JSON; a failure (a full disk, a path gone since the check) is a ConfigError naming it."""
  from ember import storage
  try:
    storage.write_atomic(path, json.dumps(obj, indent=1))  # An earlier file is replaced whole or kept.
  except OSError as e:
    raise ConfigError(f"{flag}: cannot write {path}: {e.strerror or e}") from None
