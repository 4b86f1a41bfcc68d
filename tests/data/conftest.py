"""Shared fixtures for the data tests: a data config and small corpora written to tmp_path."""
import numpy as np
import pytest

from ember.config import defaults
from ember.config.settings import Data, section


def make_data_cfg(**overrides) -> Data:
  """The typed `data` section of ember/config/defaults.py (the real defaults but a shuffle window sized for these
  corpora of a few dozen files: the default's 16,384 chunks repeat one of them hundreds of times and take seconds
  to fill), then `overrides`."""
  cfg = defaults.get_config().data
  cfg.update({"chunk_shuffle_window": 256, **overrides})
  return section(Data, cfg)


@pytest.fixture
def data_cfg():
  return make_data_cfg


@pytest.fixture
def mono_corpus(tmp_path):
  """40 files, file i holding one distinct byte value repeated: a token names its document."""
  rng = np.random.default_rng(0)
  root = tmp_path / "mono"
  root.mkdir()
  for i in range(40):
    (root / f"doc{i:02d}.txt").write_bytes(bytes([33 + i]) * int(rng.integers(20, 400)))
  return root


@pytest.fixture
def text_corpus(tmp_path):
  """30 files of random lowercase text with lengths from 1 to 700 bytes, and their contents."""
  rng = np.random.default_rng(1)
  root = tmp_path / "text"
  root.mkdir()
  docs = {}
  for i in range(30):
    n = int(rng.integers(1, 700))
    data = bytes(rng.integers(ord("a"), ord("z") + 1, size=n).astype(np.uint8))
    (root / f"f{i:02d}.txt").write_bytes(data)
    docs[f"f{i:02d}.txt"] = data
  return root, docs
