"""The native libraries' own log lines, kept off the console of a program (train.py, the tools run as `python -m`)
unless `--config.log.verbose=true`:

- XLA's C++ INFO and WARNING lines: TF_CPP_MIN_LOG_LEVEL=2 (a level the user set stays), which XLA reads when it
  loads, so `quiet` works fully before JAX is imported (train.py calls it first; `import ember` imports no JAX);
- what C++ writes before its logging is set up, which no level reaches: "WARNING: All log messages before
  absl::InitializeLog() is called are written to STDERR" and the INFO / WARNING lines under it (the CUDA plugin's
  "Could not find cuda drivers" on a machine that compiles for described GPUs);
- Gloo's connection lines on stdout ("[Gloo] Rank 0 is connected to 1 peer ranks...", in pieces, as its threads
  write them).

Those last two are written by C++ straight to file descriptors 1 and 2: each is replaced by a pipe whose reader
thread passes every other line through, in order, and drains to the end at exit. ember's own lines, C++ ERROR and
FATAL lines and all that Python prints go through unchanged. Standard library only.
"""

from __future__ import annotations

import atexit
import os
import re
import sys
import threading

# A line that matches is dropped from that descriptor.
NOISE = {
    1: re.compile(rb"\[Gloo\] |peer ranks\. Expected number of connected peer ranks"),
    2: re.compile(rb"^WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
                  rb"|^[IW]\d{4} [\d:.]+ +\d+ [\w.-]+:\d+\] "),
}
_VERBOSE_FLAGS = ("--config.log.verbose", "--config.log.verbose=true", "--config.log.verbose=1")

_filters: list["_Filter"] = []


def verbose_requested(argv: list[str]) -> bool:
  """`--config.log.verbose` on the command line (read before the config loads: the native libraries' logging is
  fixed when they load)."""
  return any(a.lower() in _VERBOSE_FLAGS for a in argv[1:])


def quiet(argv: list[str]) -> None:
  """Unless `argv` asks for the native lines: XLA's log level (in effect if JAX is not imported yet) and the
  descriptors' filters, once per process, undone at exit."""
  if verbose_requested(argv) or _filters:
    return
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # XLA's C++ log at ERROR and up, if JAX is not loaded yet.
  _filters.extend(_Filter(fd, NOISE[fd]) for fd in (1, 2))
  atexit.register(restore)


def restore() -> None:
  """The descriptors back to what they were, every line written so far passed on."""
  while _filters:
    _filters.pop().close()


class _Filter:
  """File descriptor `fd` replaced by a pipe whose reader thread writes each line on to the original, but those
  `noise` matches."""

  def __init__(self, fd: int, noise: re.Pattern):
    for stream in (sys.stdout, sys.stderr):
      stream.flush()
    self._fd, self._noise = fd, noise
    self._original = os.dup(fd)
    read, write = os.pipe()
    os.dup2(write, fd)
    os.close(write)
    self._read = read
    self._gone = False
    self._thread = threading.Thread(target=self._pump, name=f"ember-native-output-{fd}", daemon=True)
    self._thread.start()

  def _pump(self) -> None:
    pending = b""
    while True:
      chunk = os.read(self._read, 65536)
      if not chunk:
        break
      *lines, pending = (pending + chunk).split(b"\n")
      self._write(b"".join(line + b"\n" for line in lines if not self._noise.search(line)))
    if not self._noise.search(pending):
      self._write(pending)
    os.close(self._read)

  def _write(self, data: bytes) -> None:
    """On to the original descriptor; once that is gone (a closed pipe: `| head`), the rest is read and dropped,
    so that the process never blocks on a full pipe."""
    if data and not self._gone:
      try:
        os.write(self._original, data)
      except OSError:
        self._gone = True

  def close(self) -> None:
    if threading.current_thread() is threading.main_thread():  # Elsewhere (the watchdog) the main thread may hold
      for stream in (sys.stdout, sys.stderr):                  # a stream's lock; it flushed what it wrote.
        try:
          stream.flush()
        except (OSError, ValueError):
          pass
    os.dup2(self._original, self._fd)  # The pipe's last writer is gone: the reader sees its end.
    self._thread.join(timeout=5)
    os.close(self._original)
