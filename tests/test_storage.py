"""A local file written through storage is replaced whole or not at all (ember/storage.py)."""
import os

import pytest

from ember import storage


def test_a_file_is_replaced_whole_when_its_writer_finishes(tmp_path):
  path = str(tmp_path / "model.safetensors")
  storage.write_bytes(path, b"old")
  with storage.local_file_replaced(path) as f:
    f.write(b"new, ")
    assert open(path, "rb").read() == b"old"  # Readers see the old file until the block ends.
    f.write(b"whole")
  assert open(path, "rb").read() == b"new, whole"
  assert os.listdir(tmp_path) == ["model.safetensors"]


def test_a_writer_that_fails_leaves_the_old_file_and_no_partial_one(tmp_path):
  path = str(tmp_path / "model.safetensors")
  storage.write_bytes(path, b"old")
  with pytest.raises(OSError, match="disk full"):
    with storage.local_file_replaced(path) as f:
      f.write(b"half")
      raise OSError("disk full")
  assert open(path, "rb").read() == b"old"
  assert os.listdir(tmp_path) == ["model.safetensors"]
