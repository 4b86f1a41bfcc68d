"""Tokenizers: bytes by default (no download, no training), a SentencePiece model, or a Hugging Face tokenizer.

All take `str` or raw `bytes` and return int32 numpy arrays, so the pipeline can hand a
file's bytes straight over: the byte tokenizer then keeps every byte exactly (invalid
UTF-8 included) and never pays for a decode.

Bytes and SentencePiece add no BOS/EOS tokens: the packed batch carries document boundaries in
`segment_ids`, and the byte vocabulary has no spare ids for them. A Hugging Face tokenizer (Llama-3's,
Qwen3's byte-level BPE: a `tokenizer.json`, or a directory holding one) gives each document the special
tokens it defines: its post-processor's (Llama-3's `<|begin_of_text|>`) and, when the directory's
`tokenizer_config.json` names an `eos_token`, that token at the end.
"""

import functools
import json
import os

import numpy as np

from ember.errors import DataError
from ember.config.settings import hf_tokenizer_json, tokenizer_file


class ByteTokenizer:
  """Token = byte value of the UTF-8 encoding; vocabulary of 256."""

  vocab_size = 256

  def encode(self, text: str | bytes, eos: bool = True) -> np.ndarray:
    """`eos`: as every tokenizer here takes it (`HFTokenizer.encode`); this one has no EOS token."""
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

  def encode(self, text: str | bytes, eos: bool = True) -> np.ndarray:
    """`eos`: as every tokenizer here takes it (`HFTokenizer.encode`); the model's own pieces decide."""
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


class HFTokenizer:
  """A Hugging Face `tokenizers` tokenizer: `path` is its `tokenizer.json` or a directory holding one (and
  possibly `tokenizer_config.json`, for the EOS token)."""

  def __init__(self, path: str):
    import tokenizers  # pylint: disable=g-import-not-at-top
    self.path = path
    self.json_path = hf_tokenizer_json(path)
    self._tok = tokenizers.Tokenizer.from_file(self.json_path)
    self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
    self.eos_id = None
    config = os.path.join(os.path.dirname(self.json_path), "tokenizer_config.json")
    if os.path.isfile(config):
      with open(config) as f:
        eos = json.load(f).get("eos_token")
      eos = eos.get("content") if isinstance(eos, dict) else eos
      self.eos_id = None if eos is None else self._tok.token_to_id(eos)

  def encode(self, text: str | bytes, eos: bool = True) -> np.ndarray:
    """A document's ids, ended with the EOS token where the tokenizer names one; `eos=False`: a text that goes on
    (a prompt to continue)."""
    if not isinstance(text, str):
      text = bytes(text).decode("utf-8", errors="replace")
    ids = self._tok.encode(text, add_special_tokens=True).ids
    if eos and self.eos_id is not None:
      ids = ids + [self.eos_id]
    return np.asarray(ids, np.int32)

  def decode(self, ids) -> str:
    return self._tok.decode([int(i) for i in np.asarray(ids).reshape(-1)], skip_special_tokens=False)

  def __getstate__(self):
    return {"path": self.path}

  def __setstate__(self, state):
    self.__init__(state["path"])


def build_tokenizer(data_cfg) -> ByteTokenizer | SentencePieceTokenizer | HFTokenizer:
  """The tokenizer named by `data.tokenizer`: "byte", the path of a SentencePiece model, or a Hugging Face
  `tokenizer.json` (or its directory); loaded once per process: every data shard shares it."""
  return _tokenizer(data_cfg.tokenizer)


@functools.lru_cache(maxsize=8)
def _tokenizer(name: str) -> ByteTokenizer | SentencePieceTokenizer | HFTokenizer:
  kind, path = tokenizer_file(name)
  if kind == "byte":
    return ByteTokenizer()
  if kind == "hf":
    try:
      return HFTokenizer(name)
    except Exception as e:  # tokenizers raises its own Exception type for a bad file.
      raise DataError(f"data.tokenizer: cannot load {name!r} as a Hugging Face tokenizer ({e})") from e
  try:
    return SentencePieceTokenizer(path)
  except (RuntimeError, OSError) as e:
    raise DataError(f"data.tokenizer: cannot load {name!r} as a SentencePiece model ({e})") from e
