"""Checkpoint fingerprints (ember/trainer/integrity.py): one value per array, the same on any sharding, changed
by any changed, swapped or shifted element."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ember.trainer import integrity


def _reference(a: np.ndarray) -> int:
  """The fingerprint in NumPy: sum of bit patterns times odd position weights, modulo 2**32."""
  bits = a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize]).astype(np.uint64)
  mix, mod = np.uint64(0x9E3779B1), np.uint64(2**32)  # uint64 throughout: products of two 32-bit values fit.
  position = np.zeros(a.shape, np.uint64)
  for d in range(a.ndim):
    position = (position * mix + np.indices(a.shape)[d].astype(np.uint64)) % mod
  weights = ((position * mix) % mod * np.uint64(2) + np.uint64(1)) % mod
  return int(np.sum(bits * weights % mod) % mod) if a.ndim else int(bits)


def test_fingerprints_equal_numpys_and_do_not_depend_on_the_sharding():
  rng = np.random.default_rng(0)
  arrays = {"w": rng.normal(size=(16, 24)).astype(np.float32), "h": rng.normal(size=(8, 4, 8)).astype(jnp.bfloat16),
            "count": np.asarray(7, np.int32), "q": rng.integers(0, 255, size=(32,), dtype=np.uint8)}
  one = integrity.fingerprints({k: jnp.asarray(v) for k, v in arrays.items()})
  assert one == {k: _reference(np.asarray(v)) for k, v in arrays.items()}
  mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
  specs = {"w": P("a", "b"), "h": P("b", None, "a"), "count": P(), "q": P(("a", "b"))}
  sharded = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in arrays.items()}
  assert integrity.fingerprints(sharded) == one
  # Arrays on different sets of devices (a scalar on one, the rest on the mesh) in one call.
  mixed = dict(sharded, count=jax.device_put(arrays["count"], jax.devices()[3]))
  assert integrity.fingerprints(mixed) == one


@pytest.mark.parametrize("change", ["one bit", "two swapped", "shifted row"])
def test_any_change_changes_the_fingerprint(change):
  a = np.random.default_rng(1).normal(size=(8, 16)).astype(np.float32)
  b = a.copy()
  if change == "one bit":
    b.view(np.uint32)[3, 5] ^= 1
  elif change == "two swapped":
    b[0, 0], b[7, 15] = a[7, 15], a[0, 0]
  else:
    b[2] = np.roll(a[2], 1)
  before, after = integrity.fingerprints({"a": jnp.asarray(a)}), integrity.fingerprints({"a": jnp.asarray(b)})
  assert before != after
  with pytest.raises(integrity.DamagedCheckpoint, match="array a does not match"):
    integrity.verify(before, {"a": jnp.asarray(b)}, "step 4")
  integrity.verify(before, {"a": jnp.asarray(a)}, "step 4")


_ABANDONED_READS = """
import asyncio, gc, logging, sys, threading
from ember.trainer import integrity
logging.basicConfig()

loop = asyncio.new_event_loop()
loop.close()
integrity.quiet_abandoned_reads()

def run(target):
  t = threading.Thread(target=target)
  t.start()
  t.join()

def unraisable():
  try:
    loop.call_soon_threadsafe(print)
  except RuntimeError as e:
    sys.unraisablehook(type("U", (), {"exc_type": type(e), "exc_value": e, "exc_traceback": e.__traceback__,
                                      "err_msg": None, "object": None})())

def unretrieved(error):
  async def read():
    raise error
  running = asyncio.new_event_loop()
  task = running.create_task(read())
  running.run_until_complete(asyncio.sleep(0.01))
  running.close()
  del task
  gc.collect()

run(lambda: loop.call_soon_threadsafe(print))
unraisable()
unretrieved(ValueError('DATA_LOSS: Error reading "x/.zarray" [tensorstore_spec=\\'{}\\']'))
print("quiet so far", file=sys.stderr, flush=True)
unretrieved(ValueError("not a read"))
run(lambda: 1 / 0)
"""


def test_abandoned_reads_are_quiet_and_other_errors_are_not():
  """After `quiet_abandoned_reads`, a callback that finds its event loop closed (as a failed restore's pending
  reads do) prints nothing, from a thread or as an unraisable error, nor does a collected task whose TensorStore
  error no one retrieved; any other error in a thread or a task still does.
  In a process of its own: pytest replaces the thread hook while a test runs."""
  import subprocess
  import sys
  from tests.helpers import ROOT
  p = subprocess.run([sys.executable, "-c", _ABANDONED_READS], cwd=ROOT, capture_output=True, text=True, timeout=120)
  quiet, _, rest = p.stderr.partition("quiet so far\n")
  assert quiet == "" and "ZeroDivisionError" in rest and "ValueError: not a read" in rest, p.stderr
