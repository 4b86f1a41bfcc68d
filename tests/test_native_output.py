"""The native libraries' own lines stay off a program's console (ember/native_output.py): Gloo's connection lines
on stdout (in pieces, as its threads write them) and C++ INFO / WARNING lines on stderr are dropped, every other
line passes in order, nothing is lost at exit; `--config.log.verbose=true` leaves them all."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

_SCRIPT = """
import os, sys
from ember import native_output
native_output.quiet(sys.argv)
print("ember line 1", flush=True)
os.write(1, b"[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\\n")
os.write(1, b"[Gloo] Rank [Gloo] Rank 2 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3\\n")
os.write(1, b"3 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3\\n")
os.write(1, b"native line\\n")
os.write(2, b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\\n")
os.write(2, b"I0000 00:00:1795876299.044039   17315 cudart_stub.cc:31] Could not find cuda drivers on your machine.\\n")
os.write(2, b"W1128 14:06:53.116422   10729 spmd_partitioner.cc:656] [SPMD] Involuntary full rematerialization.\\n")
os.write(2, b"E1128 14:06:53.116422   10729 gpu_compiler.cc:1] an error XLA reports\\n")
print("error: config.model.d_model: an ember error", file=sys.stderr)
sys.stdout.write("last, unterminated")
"""


def _run(*flags: str) -> subprocess.CompletedProcess:
  env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, "-c", _SCRIPT, *flags], capture_output=True, text=True, timeout=120,
                        env=env, cwd=ROOT)


def test_native_lines_are_dropped_and_the_rest_kept():
  p = _run()
  assert p.stdout.splitlines() == ["ember line 1", "native line", "last, unterminated"]
  assert p.stderr.splitlines() == ["E1128 14:06:53.116422   10729 gpu_compiler.cc:1] an error XLA reports",
                                   "error: config.model.d_model: an ember error"]


def test_verbose_keeps_them():
  p = _run("--config.log.verbose=true")
  assert p.stdout.count("[Gloo]") == 3
  assert len(p.stderr.splitlines()) == 5
