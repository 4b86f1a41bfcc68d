"""Weights & Biases (log.wandb_project), offline: the run records the scalars metrics.jsonl holds, at the same
steps, and a resumed run continues the same W&B run."""

import glob
import json
import shutil
import struct

import pytest
from wandb.proto import wandb_internal_pb2

from ember.errors import Diverged
from ember.trainer.loop import train
from ember.trainer.metrics import read_records
from tests.helpers import checked, config


def _records(path: str) -> list:
  """The records of a W&B run file (the LevelDB log format W&B writes: 32 KiB blocks of records, each a 7-byte
  header (crc, length, type: 1 full, 2 first, 3 middle, 4 last) and its bytes, after a 7-byte file header)."""
  data = open(path, "rb").read()
  assert data[:4] == b":W&B"
  pos, block, parts, out = 7, 32768, [], []
  while pos + 7 <= len(data):
    left = block - pos % block
    _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
    if kind == 0:  # A block's zero-filled tail.
      pos += left
      continue
    parts.append(data[pos + 7:pos + 7 + length])
    pos += 7 + length
    if kind in (1, 4):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(b"".join(parts))
      parts = []
      out.append(record)
  return out


def _history(path: str) -> dict[int, dict]:
  """{step: {key: value}} of the history records in a W&B run file."""
  out = {}
  for record in _records(path):
    if record.WhichOneof("record_type") == "history":
      items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
      out[record.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
  return out


def _exit_codes(path: str) -> list[int]:
  return [r.exit.exit_code for r in _records(path) if r.WhichOneof("record_type") == "exit"]


@pytest.mark.extended
def test_an_offline_run_records_the_metrics_and_a_resume_continues_it(tmp_path, monkeypatch):
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  workdir = tmp_path / "run"
  common = {"workdir": str(workdir), "log.every_steps": 1, "log.wandb_project": "ember-test",
            "checkpoint.every_steps": 2}
  train(checked(config("tiny", steps=2, **common)))
  train(checked(config("tiny", steps=4, **common)))  # Resumes at step 2.
  runs = sorted(glob.glob(str(workdir / "wandb" / "offline-run-*" / "run-*.wandb")))
  assert len(runs) == 2
  run_id = (workdir / "wandb_run_id").read_text()
  assert all(path.endswith(f"run-{run_id}.wandb") for path in runs)  # One W&B run, continued.
  logged = {}
  for path in runs:
    logged.update(_history(path))
  records = read_records(str(workdir / "metrics.jsonl"))
  assert sorted(logged) == [r["step"] for r in records] == [1, 2, 3, 4]
  for r in records:
    scalars = {k: v for k, v in r.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert logged[r["step"]] == pytest.approx(scalars, rel=1e-6), r["step"]
  # A new run in the workdir (its checkpoints removed: nothing to resume) is a new W&B run: under the old id, W&B
  # would drop its steps 1 and 2, at or below those the old run holds.
  shutil.rmtree(workdir / "checkpoints")
  train(checked(config("tiny", steps=2, **common)))
  new_id = (workdir / "wandb_run_id").read_text()
  assert new_id != run_id
  new_file = glob.glob(str(workdir / "wandb" / "offline-run-*" / f"run-{new_id}.wandb"))[0]
  assert sorted(_history(new_file)) == [1, 2] and _exit_codes(new_file) == [0]
  # A run that fails (here: it diverges, every step's loss made NaN) ends its W&B run failed, not finished.
  shutil.rmtree(workdir / "checkpoints")
  with pytest.raises(Diverged):
    train(checked(config("tiny", steps=4, **common, **{"train.max_skipped_steps": 1, "train.learning_rate": 1e30})))
  failed_id = (workdir / "wandb_run_id").read_text()
  assert _exit_codes(glob.glob(str(workdir / "wandb" / "offline-run-*" / f"run-{failed_id}.wandb"))[0]) == [1]


def test_wandb_without_the_package_is_a_config_error(monkeypatch):
  import importlib.util
  from ember import config as config_lib
  from ember.errors import ConfigError
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
  with pytest.raises(ConfigError, match=r"config.log.wandb_project: .*pip install -e '.\[wandb\]'"):
    config_lib.validate(config("tiny", **{"log.wandb_project": "p"}), 1)


def test_wandb_that_cannot_start_is_a_config_error(tmp_path, monkeypatch):
  """Online without an API key: one line naming the key and the way out, not W&B's traceback."""
  from ember.errors import ConfigError
  from ember.trainer.metrics import WandbRun
  for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_SILENT"):
    monkeypatch.delenv(var, raising=False)
  monkeypatch.setenv("HOME", str(tmp_path))  # No ~/.netrc holding a key.
  monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
  import wandb
  wandb.teardown()  # An offline run earlier in this process leaves W&B's process-wide settings offline.
  with pytest.raises(ConfigError, match=r"^config.log.wandb_project: W&B did not start \(.*\); run `wandb login`"):
    WandbRun(project="p", entity="", name="", workdir=str(tmp_path / "run"), config={}).start(new_run=True)
