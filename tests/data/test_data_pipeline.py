"""The iterator: determinism, resumable state, process shards and the eval split."""
import json

import numpy as np
import pytest

from ember.data import DataError, make_iterator, sources


def _take(it, n):
  return [next(it) for _ in range(n)]


def _assert_same(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])


def _doc_ids(batches):
  """Document ids seen in the mono corpus (token 33 + i belongs to document i)."""
  ids = set()
  for b in batches:
    ids |= set(np.unique(b["inputs"][b["segment_ids"] > 0]).tolist())
    ids |= set(np.unique(b["targets"][b["segment_ids"] > 0]).tolist())
  return ids


def test_same_seed_same_batches(data_cfg, text_corpus):
  cfg = data_cfg(path=str(text_corpus[0] / "*.txt"), eval_fraction=0.1)
  kw = dict(seq_len=16, global_batch_size=4, split="train")
  a = _take(make_iterator(cfg, seed=7, **kw), 6)
  _assert_same(a, _take(make_iterator(cfg, seed=7, **kw), 6))
  c = _take(make_iterator(cfg, seed=8, **kw), 6)
  assert any((x["inputs"] != y["inputs"]).any() for x, y in zip(a, c))


@pytest.mark.parametrize("source", ["text", "synthetic"])
def test_state_restores_following_batches(data_cfg, text_corpus, source):
  cfg = data_cfg(source=source, path=str(text_corpus[0] / "*.txt"), eval_fraction=0.1)
  kw = dict(seq_len=16, global_batch_size=4, seed=1, split="train", vocab_size=64)
  it = make_iterator(cfg, **kw)
  _take(it, 7)
  state = it.get_state()
  saved = json.loads(json.dumps(state))  # The checkpoint stores it as JSON.
  following = _take(it, 5)

  fresh = make_iterator(cfg, **kw)
  fresh.set_state(saved)
  _assert_same(following, _take(fresh, 5))
  it.set_state(state)
  _assert_same(following, _take(it, 5))


def test_processes_read_disjoint_documents(data_cfg, mono_corpus):
  cfg = data_cfg(path=str(mono_corpus / "*.txt"), eval_fraction=0.1)
  kw = dict(seq_len=32, global_batch_size=8, seed=0, split="train", process_count=2)
  p0 = _take(make_iterator(cfg, process_index=0, **kw), 12)
  p1 = _take(make_iterator(cfg, process_index=1, **kw), 12)
  assert p0[0]["inputs"].shape == (4, 32)
  d0, d1 = _doc_ids(p0), _doc_ids(p1)
  assert d0 and d1 and not d0 & d1
  for b in p0 + p1:  # Every piece of a row comes from one document.
    for inp, seg in zip(b["inputs"], b["segment_ids"]):
      for s in np.unique(seg[seg > 0]):
        assert len(np.unique(inp[seg == s])) == 1


@pytest.mark.long
def test_train_and_eval_are_disjoint(data_cfg, mono_corpus):
  cfg = data_cfg(path=str(mono_corpus / "*.txt"), eval_fraction=0.2)
  kw = dict(seq_len=32, global_batch_size=8, seed=0)
  train = _doc_ids(_take(make_iterator(cfg, split="train", **kw), 40))
  ev = _doc_ids(_take(make_iterator(cfg, split="eval", **kw), 10))
  held_out = sources.text_documents(cfg.path, "eval", 0.2)
  assert ev == {held_out[i][0] for i in range(len(held_out))}
  assert 1 <= len(ev) < 20 and len(train) > 25 and not train & ev


@pytest.mark.long
def test_fresh_eval_iterators_repeat_the_same_batches(data_cfg, text_corpus):
  cfg = data_cfg(path=str(text_corpus[0] / "*.txt"), eval_fraction=0.1)
  kw = dict(seq_len=16, global_batch_size=2, seed=0, split="eval")
  a = make_iterator(cfg, **kw)
  first = _take(a, 30)  # Longer than the eval split: it repeats rather than ends.
  a.close()
  _assert_same(first, _take(make_iterator(cfg, **kw), 30))


def test_batch_must_divide_over_processes(data_cfg, text_corpus):
  cfg = data_cfg(path=str(text_corpus[0] / "*.txt"))
  with pytest.raises(ValueError, match="process count"):
    make_iterator(cfg, seq_len=16, global_batch_size=6, seed=0, split="train", process_count=4)


@pytest.mark.parametrize("rel", ["missing/*.txt", "missing_dir", "empty/*.txt"])
def test_unmatched_path_is_a_one_line_data_error(data_cfg, tmp_path, rel):
  (tmp_path / "empty").mkdir()
  (tmp_path / "empty" / "blank.txt").write_text("")
  path = str(tmp_path / rel)
  for source in ("text", "array_record"):
    with pytest.raises(DataError) as e:
      make_iterator(data_cfg(source=source, path=path), seq_len=8, global_batch_size=1, seed=0,
                    split="train")
    assert isinstance(e.value, ValueError)
    msg = str(e.value)
    assert "data.path" in msg and path in msg and "\n" not in msg


def test_unknown_source_is_a_data_error(data_cfg):
  with pytest.raises(DataError, match="data.source"):
    make_iterator(data_cfg(source="csv"), seq_len=8, global_batch_size=1, seed=0,
                  split="train")


def test_fewer_documents_than_shards_warns_once_with_both_counts(data_cfg, tmp_path, capsys):
  root = tmp_path / "three"
  root.mkdir()
  for i in range(3):
    (root / f"doc{i}.txt").write_bytes(bytes([40 + i]) * 50)
  cfg = data_cfg(source="text", path=str(root / "*.txt"), eval_fraction=0.0)
  for shard in range(8):
    next(make_iterator(cfg, seq_len=16, global_batch_size=8, seed=0, split="train", process_index=shard,
                       process_count=8))
  lines = [l for l in capsys.readouterr().err.splitlines() if l.startswith("warning:")]
  assert len(lines) == 1, lines
  train_docs = len(sources.documents(cfg, "train", seed=0, vocab_size=256))
  assert 0 < train_docs < 8
  assert f"source text at {cfg.path} has {train_docs} train documents for 8 data shards" in lines[0], lines[0]
  next(make_iterator(cfg, seq_len=16, global_batch_size=8, seed=0, split="train", process_index=0, process_count=2))
  assert "warning:" not in capsys.readouterr().err  # Enough documents for 2 shards: nothing to say.
