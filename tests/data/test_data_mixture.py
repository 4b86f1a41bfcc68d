"""Weighted mixtures of sources: token shares follow the weights, deterministic, resumable, logged."""

import dataclasses
import json
import os

import numpy as np
import pytest

from ember.data import make_iterator
from ember.names import SEGMENT_IDS, SOURCE
from ember.trainer.loop import train
from tests.helpers import checked, config


def _corpus(root, letter: bytes, n: int, seed: int):
  """Files of one repeated byte with random lengths: every token names its corpus."""
  rng = np.random.default_rng(seed)
  root.mkdir()
  for i in range(n):
    (root / f"d{i:03d}.txt").write_bytes(letter * int(rng.integers(50, 900)))
  return str(root / "*.txt")


def _mixture_cfg(data_cfg, tmp_path, weights=(0.8, 0.2)):
  a = _corpus(tmp_path / "a", b"a", 60, 0)
  b = _corpus(tmp_path / "b", b"b", 60, 1)
  return data_cfg(mixture=(("alpha", "text", a, "", weights[0]), ("beta", "text", b, "", weights[1])),
                  num_threads=1, chunk_shuffle_window=256)


def _iterator(cfg):
  return make_iterator(cfg, seq_len=64, global_batch_size=8, seed=0, split="train")


def test_token_shares_follow_the_weights(tmp_path, data_cfg):
  it = _iterator(_mixture_cfg(data_cfg, tmp_path))
  counts = np.zeros(3, np.int64)
  for _ in range(200):
    batch = next(it)
    real = batch[SEGMENT_IDS] > 0
    counts += np.bincount(batch[SOURCE][real], minlength=3)
    # The source tag is right: alpha's tokens are "a", beta's "b".
    assert set(np.unique(batch["inputs"][batch[SOURCE] == 1])) <= {ord("a")}
    assert set(np.unique(batch["inputs"][batch[SOURCE] == 2])) <= {ord("b")}
  it.close()
  assert counts[0] == 0
  share = counts[1] / counts[1:].sum()
  assert abs(share - 0.8) < 0.02, share


def test_mixture_is_deterministic_and_resumes_exactly(tmp_path, data_cfg):
  cfg = _mixture_cfg(data_cfg, tmp_path, (0.5, 0.5))
  first = _iterator(cfg)
  for _ in range(30):
    next(first)
  state = first.get_state()
  expected = [next(first) for _ in range(10)]
  first.close()
  resumed = _iterator(cfg)
  resumed.set_state(state)
  for want in expected:
    got = next(resumed)
    for k in want:
      np.testing.assert_array_equal(got[k], want[k])
  resumed.close()
  again = _iterator(cfg)
  np.testing.assert_array_equal(next(again)["inputs"], next(_iterator(cfg))["inputs"])


def test_eval_mixture_may_differ(tmp_path, data_cfg):
  cfg = _mixture_cfg(data_cfg, tmp_path)
  cfg = dataclasses.replace(cfg, eval_mixture=(cfg.mixture[1][:4] + (1.0,),))  # Held-out documents of beta only.
  it = make_iterator(cfg, seq_len=64, global_batch_size=8, seed=0, split="eval")
  batch = next(it)
  assert set(np.unique(batch[SOURCE][batch[SEGMENT_IDS] > 0])) == {1}
  assert set(np.unique(batch["inputs"][batch[SEGMENT_IDS] > 0])) == {ord("b")}
  it.close()


@pytest.mark.extended
def test_train_logs_each_source_share(tmp_path):
  a = _corpus(tmp_path / "a", b"a", 30, 0)
  b = _corpus(tmp_path / "b", b"b", 30, 1)
  cfg = config("tiny", **{"workdir": str(tmp_path / "run"), "steps": 4, "log.every_steps": 2,
                          "train.eval_every_steps": 0, "checkpoint.every_steps": -1, "quant.recipe": "bf16",
                          "data.mixture": (("alpha", "text", a, "", 3.0), ("beta", "text", b, "", 1.0))})
  train(checked(cfg))
  records = [json.loads(line) for line in open(os.path.join(tmp_path, "run", "metrics.jsonl"))]
  assert [r["step"] for r in records if "data_share/alpha" in r] == [2, 4]
  shares = [r["data_share/alpha"] for r in records]
  for r in records:
    assert abs(r["data_share/alpha"] + r["data_share/beta"] - 1.0) < 1e-9
  # The mixer keeps each shard's drawn tokens within a document of 3:1; the shuffle window moves tokens between
  # log intervals, so each interval's share is looser than the run's (two intervals of equal token counts).
  assert all(abs(s - 0.75) < 0.15 for s in shares), shares
  assert abs(np.mean(shares) - 0.75) < 0.03, shares


def test_token_shares_follow_the_weights_whatever_the_document_lengths(tmp_path, data_cfg):
  """Source alpha has 10-byte documents, beta 2,000-byte ones: the weights still set the token shares."""
  (tmp_path / "a").mkdir()
  for i in range(200):
    (tmp_path / "a" / f"d{i:03d}.txt").write_bytes(b"a" * 10)
  (tmp_path / "b").mkdir()
  for i in range(60):
    (tmp_path / "b" / f"d{i:03d}.txt").write_bytes(b"b" * 2000)
  cfg = data_cfg(mixture=(("alpha", "text", str(tmp_path / "a" / "*.txt"), "", 0.5),
                          ("beta", "text", str(tmp_path / "b" / "*.txt"), "", 0.5)), num_threads=1,
                 chunk_shuffle_window=256)
  it = _iterator(cfg)
  counts = np.zeros(3, np.int64)
  for _ in range(100):
    batch = next(it)
    counts += np.bincount(batch[SOURCE][batch[SEGMENT_IDS] > 0], minlength=3)
  it.close()
  assert abs(counts[1] / counts[1:].sum() - 0.5) < 0.02, counts
