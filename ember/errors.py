"""The errors a user can cause, and how they end a command: one line on stderr, exit status 2.

A leaf module (it imports nothing of ember), so every floor can raise them without import loops.
Each message names the config key, flag or path at fault and the reason.

Every exit status of train.py (docs/multihost.md, "When a job fails", says what to do with each):
  0   finished, or stopped by SIGTERM after saving a checkpoint (`train.preempted_exit_status` if set: 143 in
      launch/jobset.yaml, since a Kubernetes Job takes 0 for done);
  1   an unexpected error (its traceback);
  2   bad input (`EmberError`): a command line, config value, data path or checkpoint; one line;
  3   diverged (`Diverged`): train.max_skipped_steps non-finite steps in a row; restarting will not help;
  4   out of memory (XLA's RESOURCE_EXHAUSTED, compiling or running a step): the step does not fit; one line;
      restarting will not help;
  75  hung (ember/trainer/watchdog.py): a stage outlived its deadline; restart from the newest checkpoint.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import NoReturn


class EmberError(ValueError):
  """Bad input: a command line, config value, data path or checkpoint that cannot serve this run."""


class ConfigError(EmberError):
  """A bad command line or config value; the message names the key and the reason."""


def bad_key(key: str, reason: str) -> NoReturn:
  """Raises the ConfigError of config key `key` (dotted, e.g. "train.batch_size"): one line naming it."""
  raise ConfigError(f"config.{key}: {reason}")


class DataError(EmberError):
  """A bad data path, file or data setting; the message names the key or file and the reason."""


class CheckpointError(EmberError):
  """A checkpoint that cannot serve this run (shape mismatch, missing directory, other seed)."""


DIVERGED_EXIT_STATUS = 3
OUT_OF_MEMORY_EXIT_STATUS = 4


class Diverged(RuntimeError):
  """The run stopped itself: too many non-finite steps in a row (train.max_skipped_steps)."""


class ArgumentParser(argparse.ArgumentParser):
  """argparse whose errors (a missing, malformed or out-of-choice flag) raise ConfigError naming the flag,
  so a command's bad flag ends like any bad input: one line, exit 2, no usage text. `-h` still prints
  the usage and exits 0."""

  def __init__(self, *args, **kwargs):
    kwargs.setdefault("allow_abbrev", False)
    super().__init__(*args, **kwargs)

  def error(self, message: str):
    required = re.fullmatch(r"the following arguments are required: (.*)", message)
    if required:
      raise ConfigError(f"{required.group(1)}: required, not given")
    argument = re.fullmatch(r"argument ([^:]+): (.*)", message, re.DOTALL)
    if argument:
      raise ConfigError(f"{argument.group(1).split('/')[-1]}: {argument.group(2)}")
    raise ConfigError(message)


def one_line(e: BaseException) -> str:
  """The first line of an exception's message (library errors can span many)."""
  return (str(e).strip().splitlines() or [type(e).__name__])[0]


_process_index: int | None = None  # This process's, once JAX knows it (`note_process_index`).


def note_process_index(index: int) -> None:
  """Called when the job is joined (ember/parallel/distributed.py): from then on `first_process` asks no launcher."""
  global _process_index
  _process_index = int(index)


def first_process() -> bool:
  """Whether this is process 0 of the job: JAX's index once noted; before, the launchers' variables (JAX, which
  knows it for sure, takes seconds to import; a `--config.distributed.process_id` is known from the join on)."""
  if _process_index is not None:
    return _process_index == 0
  return all(os.environ.get(k, "0") in ("", "0") for k in ("EMBER_PROCESS_ID", "SLURM_PROCID"))


def warn(msg: str) -> None:
  """A warning line on stderr (process 0 prints; the trainer's console adds a time stamp to its own)."""
  if first_process():
    print(f"warning: {msg}", file=sys.stderr, flush=True)


def out_of_memory(err: BaseException) -> str | None:
  """The one line an out-of-memory error of XLA's (RESOURCE_EXHAUSTED from JAX's runtime) ends a run with, what
  it asks of the allocator included; None for any other error."""
  text = str(err)
  at = text.find("RESOURCE_EXHAUSTED")
  # JAX's runtime error, about memory: storage libraries (tensorstore, under a checkpoint's write) use the same
  # code for a full disk or too many open files, which no smaller step would mend.
  runtime = any(c.__name__ in ("JaxRuntimeError", "XlaRuntimeError") for c in type(err).__mro__)
  if at < 0 or not runtime or not re.search(r"memory|allocat", text, re.IGNORECASE) or "os_error_code" in text:
    return None
  said = text[at:].splitlines()[0].strip().rstrip(".")
  return (f"out of memory: {said[:300]}; the step does not fit: keep fewer residuals (remat.policy), run fewer "
          "sequences a device at once (train.grad_accum_steps) or split the state over more devices (mesh.fsdp); "
          "python -m ember.tools.compile --target=<gpu>x<count> states a step's peak before a launch")


def out_of_memory_exit(err: BaseException) -> int:
  """For a command that runs steps, in its `except Exception`: XLA's out-of-memory error said in one line on stderr,
  OUT_OF_MEMORY_EXIT_STATUS returned; any other error raised again, its traceback kept."""
  line = out_of_memory(err)
  if line is None:
    raise err
  _say_error(line)
  return OUT_OF_MEMORY_EXIT_STATUS


def _say_error(line: str) -> None:
  """`error: <line>` on stderr in one write, so the lines of processes sharing a stderr (launch/local.sh) never
  interleave."""
  sys.stderr.write(f"error: {line}\n")
  sys.stderr.flush()


def fail_and_exit(err: BaseException) -> None:
  """Prints one line (`_say_error`) and exits with status 2 (bad command line, config or input path), or 3
  (`Diverged`)."""
  _say_error(one_line(err))
  sys.exit(DIVERGED_EXIT_STATUS if isinstance(err, Diverged) else 2)
