"""train.compilation_cache_dir: a run stores its compiled programs there, and a second run of the same program (a
restarted job, a sweep's repeat) loads every one of them instead of compiling it again."""

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT
from tests.xla_cpu import cpu_xla_flags


def _run(workdir, cache) -> str:
  env = {k: v for k, v in os.environ.items() if not k.startswith(("EMBER_", "JAX_COMPILATION_CACHE"))}
  # Every program is stored, however fast it compiled: which ones pass JAX's compile-time threshold (1 s by default,
  # 0.5 s in the suite) depends on the machine's load, and a program compiled anew would go unnoticed among them.
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_xla_flags(1), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  p = subprocess.run([sys.executable, "train.py", "--config=configs/default.py:tiny", "--config.data.source=synthetic",
                      "--config.steps=2", "--config.log.tensorboard=false", f"--config.workdir={workdir}",
                      f"--config.train.compilation_cache_dir={cache}"], cwd=ROOT, env=env, capture_output=True,
                     text=True, timeout=600)
  assert p.returncode == 0, p.stderr[-3000:]
  return p.stdout + p.stderr


@pytest.mark.long
def test_a_second_run_of_the_same_program_compiles_nothing(tmp_path):
  cache = tmp_path / "cache"
  first = _run(tmp_path / "a", cache)
  stored = set(os.listdir(cache))
  assert stored, "the first run stored no compiled program"
  second = _run(tmp_path / "b", cache)
  assert set(os.listdir(cache)) == stored  # Every program the second run needed was there: none compiled anew.
  losses = lambda out: [line.split("loss ")[1].split()[0] for line in out.splitlines() if " loss " in line]
  assert losses(first) == losses(second) and losses(first)
