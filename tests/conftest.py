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
# GPUs (tests/plan with the CUDA plugin), whose executables are for devices this machine does not have.
_CACHE = "JAX_COMPILATION_CACHE_DIR"
_MADE_HERE = _CACHE not in os.environ and importlib.util.find_spec("jax_cuda12_plugin") is None
if _MADE_HERE:
  os.environ[_CACHE] = tempfile.mkdtemp(prefix="ember-test-jax-cache-")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")


def pytest_unconfigure(config):
  if _MADE_HERE:  # The process that made the cache (the xdist controller, or the only process).
    shutil.rmtree(os.environ[_CACHE], ignore_errors=True)


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
