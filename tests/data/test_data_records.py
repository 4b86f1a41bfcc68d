"""JSON Lines and Parquet sources: lazy reading, compressed JSONL, and the bad-data rule."""

import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from ember.data import make_iterator, records, sources
from ember.errors import DataError
from tests.helpers import ROOT


def _docs(cfg, split):
  ds = sources.open_documents(cfg, split, seed=0, vocab_size=256)
  out = []
  for element in (ds[i] for i in range(len(ds))):
    out += element if isinstance(element, list) else [element]
  return [d for d in out if d]


def _all_docs(cfg):
  before = records.skipped_records()
  docs = _docs(cfg, "train") + _docs(cfg, "eval")
  return sorted(docs), records.skipped_records() - before


GOOD = [f"document number {i} " * (1 + i % 5) for i in range(40)]


def _write_jsonl(path, texts, bad=True):
  lines = [json.dumps({"text": t, "id": i}).encode() for i, t in enumerate(texts)]
  if bad:  # One of each bad record, and blank lines (not records at all).
    lines[3:3] = [b'{"id": 7}', b"\xff\xfe not utf-8", b"{not json", b'{"text": 12}', b"", b"   "]
  path.write_bytes(b"\n".join(lines) + b"\n\n")


def test_jsonl_reads_every_good_record_and_counts_the_bad(tmp_path, data_cfg):
  _write_jsonl(tmp_path / "a.jsonl", GOOD[:25])
  _write_jsonl(tmp_path / "b.jsonl", GOOD[25:], bad=False)
  cfg = data_cfg(source="jsonl", path=str(tmp_path / "*.jsonl"))
  docs, skipped = _all_docs(cfg)
  assert docs == sorted(t.encode() for t in GOOD)
  assert skipped == 5  # No text key, not UTF-8, not JSON, a non-string text, whitespace only.


@pytest.mark.parametrize("suffix", [".gz", ".zst"])
def test_compressed_jsonl_reads_like_plain(tmp_path, data_cfg, suffix):
  plain = tmp_path / "plain" / "a.jsonl"
  plain.parent.mkdir()
  _write_jsonl(plain, GOOD, bad=False)
  packed = tmp_path / "packed" / f"a.jsonl{suffix}"
  packed.parent.mkdir()
  if suffix == ".gz":
    packed.write_bytes(gzip.compress(plain.read_bytes()))
  else:
    packed.write_bytes(zstandard.ZstdCompressor().compress(plain.read_bytes()))
  cache = tmp_path / "cache"
  cfg = lambda p: data_cfg(source="jsonl", path=str(p), cache_dir=str(cache))
  assert _all_docs(cfg(packed))[0] == _all_docs(cfg(plain))[0]
  assert len(list(cache.glob("*.jsonl"))) == 1  # Decompressed once, then read by offsets.
  _all_docs(cfg(packed))
  assert len(list(cache.glob("*.jsonl"))) == 1 and not list(cache.glob("*.part"))


def _write_parquet(path, texts, row_group_size):
  pq.write_table(pa.table({"body": texts, "n": list(range(len(texts)))}), path, row_group_size=row_group_size)


def test_parquet_reads_row_groups_lazily_and_skips_nulls(tmp_path, data_cfg):
  _write_parquet(tmp_path / "a.parquet", GOOD[:20] + [None, None], row_group_size=5)
  _write_parquet(tmp_path / "b.parquet", GOOD[20:], row_group_size=7)
  cfg = data_cfg(source="parquet", path=str(tmp_path / "*.parquet"), text_key="body")
  ds = sources.open_documents(cfg, "train", seed=0, vocab_size=256)
  assert all(isinstance(ds[i], list) for i in range(len(ds)))  # One element per row group.
  docs, skipped = _all_docs(cfg)
  assert docs == sorted(t.encode() for t in GOOD) and skipped == 2


def test_parquet_errors_name_the_file_and_the_key(tmp_path, data_cfg):
  _write_parquet(tmp_path / "a.parquet", GOOD, row_group_size=10)
  with pytest.raises(DataError, match=r"data.text_key: 'text' is not a column of .*a.parquet \(columns: body, n\)"):
    sources.open_documents(data_cfg(source="parquet", path=str(tmp_path / "*.parquet")), "train", seed=0,
                           vocab_size=256)
  data = (tmp_path / "a.parquet").read_bytes()
  (tmp_path / "a.parquet").write_bytes(data[: len(data) // 2])  # Truncated: its footer is gone.
  with pytest.raises(DataError, match=r"data.path: cannot read .*a.parquet as Parquet"):
    sources.open_documents(data_cfg(source="parquet", path=str(tmp_path / "*.parquet"), text_key="body"), "train",
                           seed=0, vocab_size=256)


@pytest.mark.long
def test_jsonl_feeds_the_pipeline(tmp_path, data_cfg):
  _write_jsonl(tmp_path / "a.jsonl", GOOD)
  cfg = data_cfg(source="jsonl", path=str(tmp_path / "a.jsonl"), num_threads=1)
  it = make_iterator(cfg, seq_len=32, global_batch_size=4, seed=0, split="train")
  batch = next(it)
  text = bytes(np.asarray(batch["inputs"])[batch["segment_ids"] > 0].astype(np.uint8).tolist())
  assert b"document number" in text
  it.close()


def test_bad_parquet_file_ends_train_py_with_one_line(tmp_path):
  _write_parquet(tmp_path / "a.parquet", GOOD, row_group_size=10)
  data = (tmp_path / "a.parquet").read_bytes()
  (tmp_path / "a.parquet").write_bytes(data[: len(data) // 2])
  p = subprocess.run([sys.executable, "train.py", "--config=configs/default.py:tiny", "--config.data.source=parquet",
                      f"--config.data.path={tmp_path}/*.parquet", "--config.data.text_key=body",
                      f"--config.workdir={tmp_path}/run"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                     env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert p.returncode == 2, p.stderr
  lines = p.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: data.path: cannot read") and "a.parquet" in lines[0], p.stderr


def test_a_wrong_text_key_is_an_error_not_a_silent_skip(tmp_path, data_cfg):
  _write_jsonl(tmp_path / "a.jsonl", GOOD)
  with pytest.raises(DataError, match=r"data.text_key: none of the first \d+ lines of .*a.jsonl .* 'body' field"):
    sources.open_documents(data_cfg(source="jsonl", path=str(tmp_path / "a.jsonl"), text_key="body"), "train",
                           seed=0, vocab_size=256)
  pq.write_table(pa.table({"body": [b"bytes"] * 4}), tmp_path / "b.parquet")
  with pytest.raises(DataError, match=r"data.text_key: column 'body' of .*b.parquet holds binary, not strings"):
    sources.open_documents(data_cfg(source="parquet", path=str(tmp_path / "b.parquet"), text_key="body"), "train",
                           seed=0, vocab_size=256)


def test_an_unwritable_cache_is_a_one_line_error(tmp_path, data_cfg):
  packed = tmp_path / "a.jsonl.gz"
  packed.write_bytes(gzip.compress(b'{"text": "x"}\n' * 4))
  (tmp_path / "file").write_text("not a directory")
  with pytest.raises(DataError, match=r"data.cache_dir: cannot decompress .*a.jsonl.gz into"):
    sources.open_documents(data_cfg(source="jsonl", path=str(packed), cache_dir=str(tmp_path / "file" / "cache")),
                           "train", seed=0, vocab_size=256)
