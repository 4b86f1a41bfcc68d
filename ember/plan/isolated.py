"""A compile in a child process, so that one which kills its process fails alone.

XLA reports some partitioning bugs with a check failure, which aborts the process (exit 134): a layout search
that compiled in-process ended there, with no table and no JSON. `compile_report_isolated` runs
plan/compile.py's `compile_report` in a fresh Python process (`python -m ember.plan.isolated IN OUT`) and
turns every way it can end into the report or a `CompileFailed` with one line: the child's own error (an
EmberError it raised), or how it died and the last telling line it wrote (XLA's "Check failed: ...").

The child inherits the environment (JAX_PLATFORMS=cpu and XLA_FLAGS as the tools set them before importing
JAX) and imports JAX afresh; its startup (a few seconds) is small beside a compile for a described GPU.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile

from ember.config import Settings
from ember.errors import EmberError, one_line

_OWN_ERROR = 3  # The child's exit status for an EmberError it raised (its message is in OUT).


class CompileFailed(EmberError):
  """A compile that failed or killed its process, with the reason in one line."""


def compile_report_isolated(cfg: Settings, target, *, timeout_s: float | None = None,
                            beat_s: float | None = None) -> dict:
  """plan/compile.py's `compile_report(cfg, target, beat_s=beat_s)`, computed in a child process; CompileFailed if
  it fails."""
  with tempfile.TemporaryDirectory(prefix="ember-compile-") as d:
    given, report = os.path.join(d, "in.pkl"), os.path.join(d, "out.json")
    with open(given, "wb") as f:
      pickle.dump((cfg, target.name, beat_s), f)
    try:
      proc = subprocess.run([sys.executable, "-m", "ember.plan.isolated", given, report], capture_output=True,
                            text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
      raise CompileFailed(f"the compile took longer than {timeout_s:g} s") from None
    if proc.returncode == 0:
      with open(report) as f:
        return json.load(f)
    if proc.returncode == _OWN_ERROR and os.path.exists(report):
      with open(report) as f:
        raise CompileFailed(json.load(f)["error"])
    raise CompileFailed(f"the compile {_how_it_ended(proc.returncode)}: {_telling_line(proc.stderr)}")


def _how_it_ended(status: int) -> str:
  """'was killed by SIGABRT', 'exited with status 1', ... for a child's return code."""
  if status < 0 or status > 128:
    number = -status if status < 0 else status - 128
    try:
      return f"was killed by {signal.Signals(number).name}"
    except ValueError:
      return f"was killed by signal {number}"
  return f"exited with status {status}"


def _telling_line(stderr: str) -> str:
  """XLA's check failure where there is one, else the last line that is not a notice or a stack frame."""
  lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
  for ln in lines:
    if "Check failed" in ln:  # "F1128 01:04:39.6 6321 spmd_partitioner_util.cc:497] Check failed: ...".
      return one_line(ln.split("] ", 1)[1] if "] " in ln else ln)
  noise = ("WARNING:", "I0000", "W0000", "***", "@ ", "Fatal Python error", "Current thread", "  File ", "File \"")
  telling = [ln for ln in lines if not ln.startswith(noise)]
  return one_line(telling[-1]) if telling else "no message"


def _main(argv: list[str]) -> int:
  given, report = argv[1], argv[2]
  with open(given, "rb") as f:
    cfg, target_name, beat_s = pickle.load(f)
  from ember.plan import target as target_lib
  from ember.plan.compile import compile_report
  try:
    result = compile_report(cfg, target_lib.parse(target_name), beat_s=beat_s)
  except EmberError as e:
    with open(report, "w") as f:
      json.dump({"error": one_line(e)}, f)
    return _OWN_ERROR
  with open(report, "w") as f:
    json.dump(result, f)
  return 0


if __name__ == "__main__":
  sys.exit(_main(sys.argv))
