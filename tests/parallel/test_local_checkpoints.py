"""Local checkpoints across two real processes (jax.distributed on 127.0.0.1, 2 CPU devices each, tiny fp8_delayed):
local every 2 steps, persistent every 10. Both processes SIGKILLed mid-run and restarted resume from the newest
local step, once with process 1's local directory deleted (its part comes back from its peer's copy), and the
whole run's metrics equal an uninterrupted run's bit for bit."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ember.trainer.metrics import TIMING_KEYS
from tests.helpers import train_processes

STEPS = 16
ARGS = ["--config=configs/default.py:tiny", "--config.model.num_layers=1", "--config.model.seq_len=16",
        "--config.train.batch_size=8", "--config.data.source=synthetic", "--config.train.eval_every_steps=0",
        "--config.log.every_steps=1", "--config.checkpoint.every_steps=10", "--config.quant.recipe=fp8_delayed",
        "--config.model.dtype=float32", "--config.mesh.fsdp=2", "--config.mesh.dcn_fsdp=2",
        "--config.log.tensorboard=false", "--config.checkpoint.local_every_steps=2"]

def _start(workdir: Path) -> list[subprocess.Popen]:
  return train_processes([*ARGS, f"--config.workdir={workdir}",
                          f"--config.checkpoint.local_dir={workdir}/local/{{process}}", f"--config.steps={STEPS}"])


def _records(workdir: Path) -> list[dict]:
  path = workdir / "metrics.jsonl"
  lines = path.read_text().splitlines() if path.exists() else []
  return [json.loads(line) for line in lines if line.endswith("}")]


def _finish(procs) -> str:
  errs = [p.communicate(timeout=300)[1] for p in procs]
  assert [p.returncode for p in procs] == [0, 0], errs[0][-3000:] + errs[1][-3000:]
  return errs[0]


def _kill_after(procs, workdir: Path, step: int) -> None:
  deadline = time.time() + 300
  while not any(r["step"] >= step for r in _records(workdir)):
    assert all(p.poll() is None for p in procs), "\n".join(p.communicate()[1][-2500:] for p in procs)
    assert time.time() < deadline
    time.sleep(0.05)
  for p in procs:
    p.send_signal(signal.SIGKILL)
  for p in procs:
    p.wait()


def _without_timings(records: list[dict]) -> list[dict]:
  return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]


@pytest.mark.long
def test_killed_processes_resume_from_local_checkpoints_even_with_one_disk_lost(tmp_path):
  reference = tmp_path / "reference"
  _finish(_start(reference))
  run = tmp_path / "run"
  rng = random.Random(0)
  # Killed before the first persistent step: only the local tier holds the run. Then process 1's disk is lost.
  _kill_after(_start(run), run, rng.randint(3, 8))
  shutil.rmtree(run / "local" / "1")
  (own,) = (run / "local" / "0").iterdir()  # The run's own directory, run-<its id>.
  assert own.name.startswith("run-"), own
  complete = lambda d, *names: all(any(f.startswith(n) and f.endswith(".bin") for f in os.listdir(d)) for n in names)
  newest = max(int(d) for d in os.listdir(own) if d.isdigit() and complete(own / d, "process_0", "peer_1"))
  procs = _start(run)
  _kill_after(procs, run, rng.randint(12, 14))  # Past the persistent step 10: a local step 12 or later is newer.
  err = procs[0].stderr.read()
  assert (f"resumed from the local checkpoint {own}/{newest} at step {newest}; the parts of processes [1] "
          "from their peers' copies") in err, err[-3000:]
  # A plain restart: every part on its own disk.
  err = _finish(_start(run))
  resumed = re.search(rf"resumed from the local checkpoint {own}/(\d+) at step (\d+)\n", err)
  assert resumed and resumed[1] == resumed[2] and int(resumed[1]) >= 12, err[-3000:]
  assert _without_timings(_records(run)) == _without_timings(_records(reference))


@pytest.mark.long
def test_runs_sharing_a_local_dir_keep_to_their_own_steps(tmp_path, capsys):
  """Two runs with one `checkpoint.local_dir` (a node's disk): the second, in a workdir of its own, starts at step 0
  rather than resuming from the first one's newest local step, and its saves prune none of the first one's. A third
  in the first one's workdir, deleted and made again, is a new run too."""
  from ember.trainer.loop import train
  from tests import helpers

  def run(name: str, steps: int):
    train(helpers.checked(helpers.config(**{
        "workdir": str(tmp_path / name), "steps": steps, "checkpoint.every_steps": -1, "log.every_steps": 1,
        "checkpoint.local_dir": str(tmp_path / "local"), "checkpoint.local_every_steps": 1,
        "model.num_layers": 1, "model.seq_len": 16, "train.batch_size": 8})))

  run("a", 4)
  run("b", 2)
  assert "resumed" not in capsys.readouterr().err
  assert [r["step"] for r in _records(tmp_path / "b") if "loss" in r] == [1, 2]
  steps = {d.name: sorted(int(s) for s in os.listdir(d) if s.isdigit()) for d in (tmp_path / "local").iterdir()}
  assert sorted(steps.values()) == [[1, 2], [3, 4]], steps  # Each run's newest two.
  shutil.rmtree(tmp_path / "a")
  run("a", 2)
  assert "resumed" not in capsys.readouterr().err
  assert [r["step"] for r in _records(tmp_path / "a") if "loss" in r] == [1, 2]


def test_a_local_dir_the_node_cannot_create_is_a_config_error(tmp_path):
  """Checked where the steps are written (a training node's disk), not where the config was validated: one line
  naming the key, not a NotADirectoryError."""
  from ember.errors import ConfigError
  from ember.trainer.loop import train
  from tests import helpers
  (tmp_path / "a_file").write_text("")
  with pytest.raises(ConfigError, match=r"^config.checkpoint.local_dir: cannot create .*a_file/run-"):
    train(helpers.checked(helpers.config(**{
        "workdir": str(tmp_path / "run"), "steps": 1, "checkpoint.local_dir": str(tmp_path / "a_file"),
        "checkpoint.local_every_steps": 1, "model.num_layers": 1, "model.seq_len": 16, "train.batch_size": 8})))


def test_steps_a_run_did_not_resume_from_give_way_to_the_ones_it_writes(tmp_path):
  """Local steps after the step a run resumed from (another layout's, or unreadable) were kept as the newest, and
  each step the run wrote was pruned as the oldest at once: the tier silently saved nothing."""
  from ember.trainer.loop import train
  from tests import helpers
  local, checkpoints = tmp_path / "local", tmp_path / "run" / "checkpoints"
  run = lambda steps: train(helpers.checked(helpers.config(**{
      "workdir": str(tmp_path / "run"), "steps": steps, "checkpoint.local_dir": str(local),
      "checkpoint.local_every_steps": 1, "checkpoint.every_steps": 4, "model.num_layers": 1, "model.seq_len": 16,
      "train.batch_size": 8})))
  run(10)  # Persistent steps 4, 8 and 10; local ones between them, the newest two kept.
  (run_dir,) = local.iterdir()
  assert sorted(int(p.name) for p in run_dir.iterdir()) == [7, 9]
  for step in (7, 9):  # Parts this run cannot read (as another mesh's are).
    for part in (run_dir / str(step)).iterdir():
      part.unlink()
  for step in (8, 10):
    shutil.rmtree(checkpoints / str(step))
  run(7)  # Resumes from the persistent step 4 and writes local steps 5 and 6.
  assert sorted(int(p.name) for p in run_dir.iterdir()) == [5, 6]


def test_a_local_part_that_does_not_read_gives_way_to_the_persistent_tier(tmp_path, capsys):
  """A garbled local part failed every restart on the same step, with a traceback; the run now resumes from the
  persistent tier, which checks its arrays against their fingerprints, and says so."""
  from ember.trainer.loop import train
  from ember.trainer.metrics import read_records
  from tests import helpers
  local = tmp_path / "local"
  run = lambda steps: train(helpers.checked(helpers.config(**{
      "workdir": str(tmp_path / "run"), "steps": steps, "checkpoint.local_dir": str(local),
      "checkpoint.local_every_steps": 1, "checkpoint.every_steps": 4, "model.num_layers": 1, "model.seq_len": 16,
      "train.batch_size": 8, "log.every_steps": 1})))
  run(6)
  shutil.rmtree(tmp_path / "run" / "checkpoints" / "6")  # The local step 5 is the newest now.
  (part,) = (next(local.iterdir()) / "5").iterdir()
  part.write_bytes(part.read_bytes()[:100])  # Truncated.
  run(6)
  assert "cannot restore the local checkpoint" in capsys.readouterr().err
  steps = [r["step"] for r in read_records(str(tmp_path / "run" / "metrics.jsonl")) if "loss" in r]
  assert steps == [1, 2, 3, 4, 5, 6]  # Resumed after the persistent step 4.
