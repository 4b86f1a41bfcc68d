"""train.py keeps the native libraries' own lines off the console: Gloo's connection lines (written by C++ on file
descriptor 1, here by os.write, in pieces as its threads write them) are dropped, every other line passes in order,
nothing is lost at exit; `--config.log.verbose=true` leaves them; XLA's C++ log level is set before JAX loads."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

_SCRIPT = """
import os, sys
sys.path.insert(0, {root!r})
import train
if not train.verbose_requested(sys.argv):
  train.quiet()
print("ember line 1", flush=True)
os.write(1, b"[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\\n")
os.write(1, b"[Gloo] Rank [Gloo] Rank 2 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3\\n")
os.write(1, b"3 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3\\n")
os.write(1, b"native line\\n")
print("TF_CPP_MIN_LOG_LEVEL=" + os.environ.get("TF_CPP_MIN_LOG_LEVEL", ""))
sys.stdout.write("last, unterminated")
"""


def _run(*flags: str) -> str:
  script = _SCRIPT.format(root=str(ROOT))
  return subprocess.run([sys.executable, "-c", script, *flags], capture_output=True, text=True, timeout=60,
                        env={"PATH": "/usr/bin:/bin"}).stdout


def test_gloo_lines_are_dropped_and_the_rest_kept():
  assert _run().splitlines() == ["ember line 1", "native line", "TF_CPP_MIN_LOG_LEVEL=2", "last, unterminated"]


def test_verbose_keeps_them():
  out = _run("--config.log.verbose=true")
  assert out.count("[Gloo]") == 3 and "TF_CPP_MIN_LOG_LEVEL=\n" in out
