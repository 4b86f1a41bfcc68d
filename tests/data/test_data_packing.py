"""Packing: next-token pairs, segment ids, positions and padding."""
import numpy as np
import pytest

from ember.data import make_iterator
from ember.data.pipeline import chunk_document


@pytest.mark.parametrize("n", [0, 1, 2, 5, 8, 9, 10, 17, 40])
def test_chunks_cover_every_target_once(n):
  seq_len = 8
  tokens = np.arange(100, 100 + n, dtype=np.int32)
  chunks = chunk_document(tokens, seq_len)
  assert all(1 <= len(c["inputs"]) <= seq_len for c in chunks)
  for c in chunks:
    np.testing.assert_array_equal(c["inputs"][1:], c["targets"][:-1])
  targets = np.concatenate([c["targets"] for c in chunks]) if chunks else np.zeros(0, np.int32)
  np.testing.assert_array_equal(targets, tokens[1:])


def _check_rows(batch, seq_len):
  """Structural invariants of packed rows; returns each piece as (inputs, targets)."""
  pieces = []
  for k in ("inputs", "targets", "segment_ids", "positions"):
    assert batch[k].dtype == np.int32 and batch[k].shape[1] == seq_len
  for inp, tgt, seg, pos in zip(batch["inputs"], batch["targets"], batch["segment_ids"],
                                batch["positions"]):
    pad = seg == 0
    assert not (inp[pad].any() or tgt[pad].any() or pos[pad].any())
    used = int((~pad).sum())
    assert not pad[:used].any(), "padding only at the end of a row"
    ids = seg[:used]
    assert ids[0] == 1 and np.all(np.diff(ids) >= 0) and np.all(np.diff(ids) <= 1)
    for s in range(1, int(ids.max()) + 1 if used else 1):
      m = seg == s
      np.testing.assert_array_equal(pos[m], np.arange(m.sum()))
      np.testing.assert_array_equal(inp[m][1:], tgt[m][:-1])  # targets are next tokens
      pieces.append((inp[m], tgt[m]))
  return pieces


def test_packed_pieces_are_document_substrings(data_cfg, text_corpus):
  root, docs = text_corpus
  cfg = data_cfg(path=str(root / "*.txt"), eval_fraction=0.1)
  it = make_iterator(cfg, seq_len=16, global_batch_size=4, seed=3, split="train")
  saw_padding = saw_multi = False
  for _ in range(60):
    batch = next(it)
    saw_padding |= bool((batch["segment_ids"] == 0).any())
    saw_multi |= bool((batch["segment_ids"] > 1).any())
    for inp, tgt in _check_rows(batch, 16):
      text = bytes(np.append(inp, tgt[-1]).astype(np.uint8))
      assert any(text in d for d in docs.values())
  assert saw_padding and saw_multi


def test_default_stdlib_rows(data_cfg):
  it = make_iterator(data_cfg(), seq_len=64, global_batch_size=4, seed=0, split="train")
  batch = next(it)
  assert batch["inputs"].shape == (4, 64)
  _check_rows(batch, 64)
  assert batch["inputs"].max() < 256
