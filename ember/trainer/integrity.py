"""Is a restored checkpoint the one that was saved? Fingerprints of the train state's arrays, and quiet failures.

Orbax and TensorStore detect a damaged file only where its format has a structure to break (a manifest, a JSON
file, a compressed chunk's header): random bytes inside an array chunk restore without an error, as different
numbers (a run resumed from one trained on NaNs). So `save` records, beside the state, one fingerprint per
array: the sum, modulo 2**32, of its elements' bit patterns, each multiplied by an odd weight drawn from its
position, so that a changed, swapped or shifted element changes the sum. Integer arithmetic modulo 2**32 is
exact in any order, so the fingerprint is the same on any mesh, process count or device. A restore whose
fingerprints differ is a damaged checkpoint (`DamagedCheckpoint`), handled as an unreadable one.

A restore that fails part-way leaves reads in flight: when TensorStore completes one, its callback finds Orbax's
event loop closed, and Orbax's read coroutines that will never be awaited fail when they are collected (the
step's directory has been moved aside). Python reports each as an unraisable error with its traceback, dozens
of them after the one warning line, and asyncio logs each read task whose TensorStore error no one retrieved
("Task exception was never retrieved", when the task is collected). `quiet_abandoned_reads` drops exactly those;
it is installed before the first restore, not after a failure, because a TensorStore thread may run a callback of
the failed read before the exception reaches the code that would install it (an intermittent traceback
otherwise)."""

from __future__ import annotations

import functools
import inspect
import logging
import os
import sys
import threading

import jax
import jax.numpy as jnp

_MIX = 0x9E3779B1  # Odd: position weights spread over all 32 bits.


class DamagedCheckpoint(Exception):
  """A checkpoint's arrays do not match the fingerprints saved with them, or the fingerprints are unreadable."""


def fingerprints(named: dict) -> dict[str, int]:
  """{name: fingerprint} of {name: array} (any sharding; computed where the arrays are, one program per set of
  devices: a scalar may live on one device and the parameters on the mesh)."""
  groups: dict[tuple, list[str]] = {}
  for name, a in named.items():
    devices = tuple(sorted(d.id for d in a.sharding.device_set)) if isinstance(a, jax.Array) else ()
    groups.setdefault(devices, []).append(name)
  out = {}
  for names in groups.values():
    values = jax.device_get(_fingerprints([jnp.asarray(named[n]) for n in names]))
    out.update({n: int(v) for n, v in zip(names, values)})
  return {n: out[n] for n in named}


@jax.jit
def _fingerprints(arrays):
  return [_fingerprint(a) for a in arrays]


def _fingerprint(a: jax.Array) -> jax.Array:
  if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
    a = jax.random.key_data(a)
  if a.dtype == jnp.bool_:
    a = a.astype(jnp.uint8)
  unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[a.dtype.itemsize]
  bits = jax.lax.bitcast_convert_type(a, unsigned).astype(jnp.uint32)
  if a.ndim == 0:
    return bits
  # A weight per position from one iota per axis (no flat index: an axis fits 32 bits, a whole array may not).
  position = functools.reduce(lambda acc, d: acc * jnp.uint32(_MIX) + jax.lax.broadcasted_iota(jnp.uint32, a.shape, d),
                              range(a.ndim), jnp.zeros(a.shape, jnp.uint32))
  return jnp.sum(bits * (position * jnp.uint32(_MIX) * 2 + 1), dtype=jnp.uint32)


def verify(saved: dict[str, int], named: dict, where: str) -> None:
  """Raises DamagedCheckpoint naming the first array of `named` whose fingerprint differs from `saved`'s."""
  got = fingerprints({n: a for n, a in named.items() if n in saved})
  for name, value in got.items():
    if value != saved[name]:
      raise DamagedCheckpoint(f"{where}: array {name} does not match the fingerprint saved with it")


def _closed_loop(e: BaseException | None, tb) -> bool:
  """The 'Event loop is closed' error of asyncio's check, raised by a callback of an abandoned read."""
  while tb is not None and tb.tb_next is not None:
    tb = tb.tb_next
  return (isinstance(e, RuntimeError) and str(e) == "Event loop is closed"
          and (tb is None or tb.tb_frame.f_code.co_name == "_check_closed"))


def _is_abandoned_read(unraisable) -> bool:
  """An 'Event loop is closed' from asyncio's check, or an error of an Orbax coroutine no one awaits."""
  obj = unraisable.object
  orbax_read = inspect.iscoroutine(obj) and f"{os.sep}orbax{os.sep}checkpoint{os.sep}" in obj.cr_code.co_filename
  return orbax_read or _closed_loop(unraisable.exc_value, unraisable.exc_traceback)


def _unretrieved_read(record: logging.LogRecord) -> bool:
  """asyncio's log line for a collected task whose TensorStore error no one retrieved (TensorStore's errors, and
  only they, end with the spec of the store they failed on)."""
  error = record.exc_info[1] if record.exc_info else None
  return (str(record.msg).startswith("Task exception was never retrieved") and error is not None
          and "tensorstore_spec=" in str(error))


@functools.cache
def quiet_abandoned_reads() -> None:
  """From now on, drop the 'Event loop is closed' errors of a failed restore's reads (module doc), whether Python
  reports them as unraisable or as a thread's uncaught exception, and asyncio's log lines for their unretrieved
  TensorStore errors; every other error still reaches the previous hook or the log. Harmless where no restore
  fails: a healthy restore leaves no read behind."""
  previous, previous_thread = sys.unraisablehook, threading.excepthook

  def hook(unraisable):
    if not _is_abandoned_read(unraisable):
      previous(unraisable)

  def thread_hook(args):
    if not _closed_loop(args.exc_value, args.exc_traceback):
      previous_thread(args)

  sys.unraisablehook, threading.excepthook = hook, thread_hook
  logging.getLogger("asyncio").addFilter(lambda record: not _unretrieved_read(record))
