"""The errors a user can cause, and how they end a command: one line on stderr, exit status 2.

A leaf module (it imports nothing of ember), so every floor can raise them without import loops.
Each message names the config key, flag or path at fault and the reason.
"""

from __future__ import annotations

import sys


class EmberError(ValueError):
  """Bad input: a command line, config value, data path or checkpoint that cannot serve this run."""


class ConfigError(EmberError):
  """A bad command line or config value; the message names the key and the reason."""


class DataError(EmberError):
  """A bad data path, file or data setting; the message names the key or file and the reason."""


class CheckpointError(EmberError):
  """A checkpoint that cannot serve this run (shape mismatch, missing directory, other seed)."""


def one_line(e: BaseException) -> str:
  """The first line of an exception's message (library errors can span many)."""
  return (str(e).strip().splitlines() or [type(e).__name__])[0]


def warn(msg: str) -> None:
  """A warning line on stderr (process 0 prints; the trainer's console adds a time stamp to its own)."""
  import os
  if os.environ.get("EMBER_PROCESS_ID", "0") in ("", "0"):
    print(f"warning: {msg}", file=sys.stderr, flush=True)


def fail_and_exit(err: BaseException) -> None:
  """Prints one line and exits with status 2 (bad command line, config or input path)."""
  print(f"error: {one_line(err)}", file=sys.stderr, flush=True)
  sys.exit(2)
