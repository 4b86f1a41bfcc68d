"""data.source=hf: a Hugging Face dataset (here a local folder of JSON-lines files, loaded offline) read by index:
the held-out split is disjoint from the training one and together they are every record; a missing column or
dataset is one line naming the key; a run trains from it."""

import json
import math

import pytest

from ember.data import DataError, sources
from ember.trainer.loop import train
from ember.trainer.metrics import read_records
from tests.helpers import checked, config


@pytest.fixture
def hf_folder(tmp_path, monkeypatch):
  """A dataset folder of two JSON-lines files (60 records, one with a null text), read offline with its cache in
  tmp_path; (folder, the texts)."""
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
  folder = tmp_path / "corpus"
  folder.mkdir()
  texts = [f"def f{i}(x):\n  return x * {i}  # record {i}\n" * (1 + i % 5) for i in range(60)]
  for part in range(2):
    with open(folder / f"part-{part}.jsonl", "w") as f:
      for i in range(part * 30, part * 30 + 30):
        f.write(json.dumps({"id": i, "text": None if i == 7 else texts[i]}) + "\n")
  texts[7] = ""
  return folder, texts


def test_the_splits_are_disjoint_and_cover_the_records(hf_folder, tmp_path):
  folder, texts = hf_folder
  read = {}
  for split in ("train", "eval"):
    ds = sources.hf_documents(str(folder), "", "train", "text", str(tmp_path / "cache"), split, 0.2)
    read[split] = [ds[i].decode() for i in range(len(ds))]
  assert 0 < len(read["eval"]) < len(read["train"])
  assert sorted(read["train"] + read["eval"]) == sorted(texts)


def test_a_missing_or_non_text_column_or_dataset_is_one_line(hf_folder, tmp_path):
  folder, _ = hf_folder
  with pytest.raises(DataError, match=r"data.text_key: .* has no column 'content'; its columns: id, text"):
    sources.hf_documents(str(folder), "", "train", "content", "", "train", 0.1)
  with pytest.raises(DataError, match=r"data.text_key: column 'id' of .* holds Value\('int64'.*, not text"):
    sources.hf_documents(str(folder), "", "train", "id", "", "train", 0.1)  # Ints would train as NUL bytes.
  with pytest.raises(DataError, match=r"data.hf_dataset: cannot load '.*nowhere'"):
    sources.hf_documents(str(tmp_path / "nowhere"), "", "train", "text", "", "train", 0.1)


@pytest.mark.extended
def test_a_run_trains_from_a_local_dataset(hf_folder, tmp_path):
  folder, _ = hf_folder
  workdir = tmp_path / "run"
  train(checked(config("tiny", steps=3, workdir=str(workdir), **{"data.source": "hf", "data.hf_dataset": str(folder),
                                                         "log.every_steps": 1})))
  losses = [r["loss"] for r in read_records(str(workdir / "metrics.jsonl")) if "loss" in r]
  assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
