"""Tokenizers: bytes by default (no download, no training), or a SentencePiece model.

Both take `str` or raw `bytes` and return int32 numpy arrays, so the pipeline can hand a
file's bytes straight over: the byte tokenizer then keeps every byte exactly (invalid
UTF-8 included) and never pays for a decode.

No BOS/EOS tokens are added: the packed batch carries document boundaries in
`segment_ids`, and the byte vocabulary has no spare ids for them.
"""

import functools
import os

import numpy as np

from ember.errors import DataError


class ByteTokenizer:
  """Token = byte value of the UTF-8 encoding; vocabulary of 256."""

  vocab_size = 256

  def encode(self, text: str | bytes) -> np.ndarray:
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return np.frombuffer(data, np.uint8).astype(np.int32)

  def decode(self, ids) -> str:
    ids = np.asarray(ids, np.int64).reshape(-1)
    return bytes(ids[(ids >= 0) & (ids < 256)].astype(np.uint8)).decode("utf-8", errors="replace")


class SentencePieceTokenizer:
  """A trained SentencePiece `.model` (see `ember.data.train_tokenizer`)."""

  def __init__(self, model_path: str):
    import sentencepiece as spm  # pylint: disable=g-import-not-at-top
    self.model_path = model_path
    self._sp = spm.SentencePieceProcessor(model_file=model_path)
    self.vocab_size = int(self._sp.get_piece_size())

  def encode(self, text: str | bytes) -> np.ndarray:
    if not isinstance(text, str):
      text = bytes(text).decode("utf-8", errors="replace")
    return np.asarray(self._sp.encode(text, out_type=int), np.int32)

  def decode(self, ids) -> str:
    return self._sp.decode([int(i) for i in np.asarray(ids).reshape(-1)])

  # SentencePieceProcessor is picklable only through its serialized proto; keep the path.
  def __getstate__(self):
    return {"model_path": self.model_path}

  def __setstate__(self, state):
    self.__init__(state["model_path"])


def build_tokenizer(data_cfg) -> ByteTokenizer | SentencePieceTokenizer:
  """The tokenizer named by `data.tokenizer`: "byte" or the path of a SentencePiece model (loaded once per
  process: every data shard shares it)."""
  return _tokenizer(data_cfg.tokenizer)


@functools.lru_cache(maxsize=8)
def _tokenizer(name: str) -> ByteTokenizer | SentencePieceTokenizer:
  if name in ("", "byte"):
    return ByteTokenizer()
  if not os.path.isfile(name):
    raise DataError(f"data.tokenizer: {name!r} is neither 'byte' nor an existing "
                    "SentencePiece .model file")
  try:
    return SentencePieceTokenizer(name)
  except (RuntimeError, OSError) as e:
    raise DataError(f"data.tokenizer: cannot load {name!r} as a SentencePiece model ({e})") from e
