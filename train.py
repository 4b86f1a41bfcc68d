"""ember's entry point.

  python train.py --config=configs/default.py[:PRESET] [--config.KEY=VALUE ...]
  python train.py --help

A bad flag, config value or input path exits with status 2 and one line on stderr; ember/errors.py lists
every exit status.
"""

import atexit
import os
import sys
import threading
import time


def _first_process() -> bool:
  """Process 0 of the job, read from the launchers' variables: JAX, which knows it for sure, takes seconds to
  import."""
  return all(os.environ.get(k, "0") in ("", "0") for k in ("EMBER_PROCESS_ID", "SLURM_PROCID"))


# --- The native libraries' own log lines, kept off the console unless `log.verbose` ---------------------------
# XLA's C++ INFO and WARNING lines (TF_CPP_MIN_LOG_LEVEL=2, which XLA reads when it loads: set before JAX is
# imported, which importing any ember module does) and Gloo's connection lines ("[Gloo] Rank 0 is connected to 1
# peer ranks...", printed by C++ on file descriptor 1, which no Python setting reaches: a pipe on that descriptor
# passes every other line through). ember's own lines, XLA's errors and all that Python prints go through unchanged.

# Dropped from file descriptor 1: a line holding any of these (Gloo's threads write a line in pieces, so one
# line can hold another's start and a piece can start a line).
NOISE = (b"[Gloo] ", b"peer ranks. Expected number of connected peer ranks")
_VERBOSE_FLAGS = ("--config.log.verbose", "--config.log.verbose=true", "--config.log.verbose=True",
                  "--config.log.verbose=1")

_filter: "_Filter | None" = None


def verbose_requested(argv: list[str]) -> bool:
  """`--config.log.verbose` on the command line (read before the config loads: the native libraries' logging is
  fixed when they load)."""
  return any(a in _VERBOSE_FLAGS for a in argv[1:])


def quiet() -> None:
  """XLA's C++ log at ERROR and up (a level the user set stays) and Gloo's lines dropped from stdout."""
  global _filter
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  if _filter is None:
    _filter = _Filter()
    atexit.register(restore)


def restore() -> None:
  """File descriptor 1 back to what it was, every line read so far passed on (at exit, or for `log.verbose`)."""
  global _filter
  if _filter is not None:
    _filter.close()
    _filter = None


def _noise(line: bytes) -> bool:
  return any(n in line for n in NOISE)


class _Filter:
  """File descriptor 1 replaced by a pipe whose reader thread writes each line on to the original, but noise."""

  def __init__(self):
    sys.stdout.flush()
    self._original = os.dup(1)
    read, write = os.pipe()
    os.dup2(write, 1)
    os.close(write)
    self._read = read
    self._gone = False
    self._thread = threading.Thread(target=self._pump, name="ember-native-output", daemon=True)
    self._thread.start()

  def _pump(self) -> None:
    pending = b""
    while True:
      chunk = os.read(self._read, 65536)
      if not chunk:
        break
      *lines, pending = (pending + chunk).split(b"\n")
      self._write(b"".join(line + b"\n" for line in lines if not _noise(line)))
    if not _noise(pending):
      self._write(pending)
    os.close(self._read)

  def _write(self, data: bytes) -> None:
    """On to the original stdout; once that is gone (a closed pipe: `| head`), the rest is read and dropped, so
    that the process never blocks on a full pipe."""
    if data and not self._gone:
      try:
        os.write(self._original, data)
      except OSError:
        self._gone = True

  def close(self) -> None:
    try:
      sys.stdout.flush()
    except (OSError, ValueError):
      pass
    os.dup2(self._original, 1)  # The pipe's last writer is gone: the reader sees its end.
    self._thread.join(timeout=5)
    os.close(self._original)


# ------------------------------------------------------------------------------------------------------------


def main(argv: list[str]) -> int:
  if any(a in ("-h", "--help", "-help") for a in argv[1:]):
    from ember.config import usage
    print(usage())
    return 0
  if not verbose_requested(argv):  # Before JAX loads: XLA reads its log level then.
    quiet()
  if _first_process():  # Before the imports, on stdout (stderr is for the log): the run is seen to start at once.
    print(f"[{time.strftime('%H:%M:%S')}] ember: starting ({' '.join(argv[1:]) or 'no flags'}); loading JAX",
          flush=True)
  from ember.errors import Diverged, EmberError, fail_and_exit
  try:
    from ember.config import load
    from ember.plan.auto_remat import resolve
    from ember.trainer.loop import prepare, train
    cfg, mesh = prepare(load(argv))
    train(resolve(cfg, mesh), mesh)
  except (EmberError, Diverged) as e:
    fail_and_exit(e)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
