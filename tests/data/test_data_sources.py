"""Sources: the hash split, ArrayRecord round trip, synthetic streams and the tfds extra."""
import importlib.util
import zlib

import numpy as np
import pytest

from ember.data import DataError, make_iterator, sources
from ember.data import write_array_record


def test_split_is_disjoint_covering_and_never_empty():
  hashes = sources.mix64(np.arange(1000, dtype=np.uint64))
  train = sources.split_indices(hashes, "train", 0.1, "k")
  ev = sources.split_indices(hashes, "eval", 0.1, "k")
  assert not set(train) & set(ev) and len(train) + len(ev) == 1000
  assert 50 < len(ev) < 150
  for frac in (0.0, 1.0):
    two = sources.mix64(np.arange(2, dtype=np.uint64))
    assert len(sources.split_indices(two, "train", frac, "k")) == 1
    assert len(sources.split_indices(two, "eval", frac, "k")) == 1
  with pytest.raises(DataError, match="k:"):
    sources.split_indices(hashes[:1], "train", 0.1, "k")


def test_stdlib_default_excludes_third_party():
  files, root = sources.list_files("")
  assert len(files) > 100 and files == sorted(files)
  assert all(f.endswith(".py") and f.startswith(root) for f in files)
  assert not any("site-packages" in f or "dist-packages" in f for f in files)


def test_array_record_round_trip(data_cfg, text_corpus, tmp_path):
  root, docs = text_corpus
  assert write_array_record.main([f"--source_glob={root}/*.txt",
                                  f"--out={tmp_path}/ar/docs", "--num_shards=3"]) == 0
  glob = f"{tmp_path}/ar/docs-*"
  read = []
  for split in ("train", "eval"):
    ds = sources.array_record_documents(glob, split, 0.2, vocab_size=256)
    read += [bytes(ds[i].astype(np.uint8)) for i in range(len(ds))]
  assert sorted(read) == sorted(docs.values())

  cfg = data_cfg(source="array_record", path=glob, eval_fraction=0.2)
  batch = next(make_iterator(cfg, seq_len=16, global_batch_size=4, seed=0, split="train"))
  seg = batch["segment_ids"]
  for inp, tgt, s in zip(batch["inputs"], batch["targets"], seg):
    m = s == 1
    text = bytes(np.append(inp[m], tgt[m][-1]).astype(np.uint8))
    assert any(text in d for d in docs.values())


@pytest.mark.parametrize("bad", [300, -1])
def test_array_record_ids_outside_the_vocabulary_are_a_data_error(data_cfg, tmp_path, bad):
  """Files written with another tokenizer: the embedding would read another row, silently."""
  from array_record.python.array_record_module import ArrayRecordWriter
  writer = ArrayRecordWriter(str(tmp_path / "docs.array_record"), "group_size:1")
  for doc in ([1, 2, 3] * 20, [4, bad, 5] * 20):
    writer.write(sources.encode_record(doc))
  writer.close()
  cfg = data_cfg(source="array_record", path=str(tmp_path / "*.array_record"), eval_fraction=0.0)
  it = make_iterator(cfg, seq_len=16, global_batch_size=2, seed=0, split="train", vocab_size=256)
  with pytest.raises(DataError, match=rf"docs.array_record: record 1 holds token id {bad}, outside model.vocab_size="):
    for _ in range(8):
      next(it)


def test_array_record_records_of_other_widths_are_a_data_error(data_cfg, tmp_path):
  """Files of uint16 ids (another tool's): an odd count was a traceback, an even one ids merged in pairs."""
  from array_record.python.array_record_module import ArrayRecordWriter
  writer = ArrayRecordWriter(str(tmp_path / "docs.array_record"), "group_size:1")
  for _ in range(2):
    writer.write(np.arange(7, dtype="<u2").tobytes())
  writer.close()
  cfg = data_cfg(source="array_record", path=str(tmp_path / "*.array_record"), eval_fraction=0.0)
  ds = sources.open_documents(cfg, "train", seed=0, vocab_size=256)
  with pytest.raises(DataError, match=r"docs.array_record: record [01] is 14 bytes, not whole little-endian int32"):
    ds[0]


def test_a_file_gone_unreadable_is_a_data_error(data_cfg, tmp_path):
  for name in ("a", "b"):
    (tmp_path / f"{name}.txt").write_text(f"document {name} " * 20)
  ds = sources.open_documents(data_cfg(source="text", path=str(tmp_path / "*.txt"), eval_fraction=0.0), "train",
                              seed=0, vocab_size=256)
  (tmp_path / "a.txt").unlink()  # Listed, then gone (or unreadable) by the time a reader opens it.
  with pytest.raises(DataError, match=r"data.path: cannot read .*a.txt \("):
    [ds[i] for i in range(len(ds))]


def test_synthetic_is_deterministic_and_learnable(data_cfg):
  doc = sources.synthetic_document(0, 5, 256)
  np.testing.assert_array_equal(doc, sources.synthetic_document(0, 5, 256))
  assert not np.array_equal(doc[:32], sources.synthetic_document(1, 5, 256)[:32])
  # Patterned streams compress far better than uniform noise over the same vocabulary.
  stream = np.concatenate([sources.synthetic_document(0, i, 256) for i in range(50)])
  noise = np.random.default_rng(0).integers(0, 256, stream.size)
  ratio = len(zlib.compress(stream.astype(np.uint8).tobytes(), 9)) / stream.size
  noise_ratio = len(zlib.compress(noise.astype(np.uint8).tobytes(), 9)) / stream.size
  assert ratio < 0.5 * noise_ratio

  cfg = data_cfg(source="synthetic")
  kw = dict(seq_len=32, global_batch_size=4, seed=0, split="train", vocab_size=50)
  a, b = next(make_iterator(cfg, **kw)), next(make_iterator(cfg, **kw))
  np.testing.assert_array_equal(a["inputs"], b["inputs"])
  assert a["inputs"].max() < 50


@pytest.mark.skipif(importlib.util.find_spec("tensorflow_datasets") is not None,
                    reason="tensorflow-datasets is installed")
def test_tfds_without_the_extra_names_it(data_cfg):
  cfg = data_cfg(source="tfds", tfds_name="lm1b")
  with pytest.raises(DataError, match=r"\[tfds\]"):
    make_iterator(cfg, seq_len=8, global_batch_size=1, seed=0, split="train")


def test_unreadable_array_record_is_a_data_error(data_cfg, text_corpus):
  cfg = data_cfg(source="array_record", path=str(text_corpus[0] / "*.txt"))
  with pytest.raises(DataError, match="data.path") as e:
    make_iterator(cfg, seq_len=8, global_batch_size=1, seed=0, split="train")
  assert "\n" not in str(e.value)


def test_single_document_is_a_data_error(data_cfg, text_corpus):
  path = str(text_corpus[0] / "f00.txt")
  with pytest.raises(DataError, match="at least 2"):
    make_iterator(data_cfg(path=path), seq_len=8, global_batch_size=1, seed=0, split="train")
