"""Test set-up: 8 virtual CPU devices, set before JAX is imported anywhere; one compilation cache per session;
the long cases (`@pytest.mark.long`, and every case but the first of a test marked `@pytest.mark.variants`) only
with `--long`, the extended ones (`@pytest.mark.extended`) only with `--extended`."""
import importlib.util
import os
import shutil
import tempfile

import pytest

from tests.xla_cpu import cpu_xla_flags  # noqa: E402  (imports nothing else)

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + cpu_xla_flags(8)).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Many tests compile the same small programs (the same config's step on the same mesh, in this process or in a
# `python train.py` it starts): the session's xdist workers and every process they start share JAX's persistent
# compilation cache, in a directory the controller makes (workers and subprocesses inherit its environment, and
# JAX reads JAX_COMPILATION_CACHE_DIR itself) and nothing outlives. Not for the programs compiled for described
# GPUs (tests/plan with the CUDA plugin), whose executables are for devices this machine does not have: those
# share XLA's GPU kernels instead (below).
_CACHE = "JAX_COMPILATION_CACHE_DIR"
_TARGET_SUITE = importlib.util.find_spec("jax_cuda12_plugin") is not None
_MADE_HERE = _CACHE not in os.environ and not _TARGET_SUITE
if _MADE_HERE:
  os.environ[_CACHE] = tempfile.mkdtemp(prefix="ember-test-jax-cache-")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

# The programs compiled for described GPUs share most of their kernels (the same small layers under another recipe,
# policy or mesh), and ptxas, which turns each kernel into GPU code, takes a third of their compile. Each xdist
# worker keeps the kernels it compiled in a file of its own, which later compiles link instead of compiling them
# again (about half of a tiny step's compile). One file a worker: XLA rewrites the file whole, so no two processes
# may write one at once (a worker's processes compile one at a time).
_KERNELS = "EMBER_TEST_GPU_KERNELS"
_KERNELS_MADE_HERE = _KERNELS not in os.environ and _TARGET_SUITE
if _KERNELS_MADE_HERE:
  os.environ[_KERNELS] = tempfile.mkdtemp(prefix="ember-test-gpu-kernels-")
if _TARGET_SUITE:
  _worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
  os.environ["XLA_FLAGS"] += f" --xla_gpu_kernel_cache_file={os.environ[_KERNELS]}/{_worker}.bin"


# The collector as train.py sets it (the tests trace hundreds of steps in this process); imported here, after the
# XLA options above, as every test module imports ember.
from ember import collect_for_tracing  # noqa: E402

collect_for_tracing()


def pytest_unconfigure(config):
  # The process that made a directory (the xdist controller, or the only process) removes it.
  for made, variable in ((_MADE_HERE, _CACHE), (_KERNELS_MADE_HERE, _KERNELS)):
    if made:
      shutil.rmtree(os.environ[variable], ignore_errors=True)


def pytest_addoption(parser):
  parser.addoption("--long", action="store_true",
                   help="also run the long cases (marked `long`: end-to-end runs of several processes, SLURM jobs, "
                        "kills and resumes); .ci/run does")
  parser.addoption("--extended", action="store_true",
                   help="also run the long cases and the extended ones (marked `extended`: the costlier variants of "
                        "a behaviour a shorter test checks, e.g. the same equality under another recipe or mesh)")


def _tier(item, first_cases: dict) -> str:
  """extended | long | default. A test marked `variants` is one behaviour checked over several cases: its first
  case (in collection order, of those not marked otherwise) runs by default, the others with --long."""
  for mark in ("extended", "long"):
    if item.get_closest_marker(mark):
      return mark
  if item.get_closest_marker("variants"):
    first = first_cases.setdefault((item.path, item.originalname), item.nodeid)
    return "default" if first == item.nodeid else "long"
  return "default"


def pytest_collection_modifyitems(config, items):
  extended = config.getoption("--extended")
  runs = {"default": True, "long": extended or config.getoption("--long"), "extended": extended}
  skips = {"long": pytest.mark.skip(reason="long case: run with pytest --long (.ci/run does)"),
           "extended": pytest.mark.skip(reason="extended case (a costlier variant): run with pytest --extended")}
  first_cases = {}
  for item in items:
    tier = _tier(item, first_cases)
    if not runs[tier]:
      item.add_marker(skips[tier])
