"""Tokenizer files for a Hugging Face directory, giving the same ids as ember's tokenizer.

Bytes: a `tokenizer.json` (the `tokenizers` library's format) with a byte-level pre-tokenizer and a
BPE model of 256 single-byte tokens and no merges, so each byte's id is its value, as in ember's
ByteTokenizer; its byte-level decoder turns ids back into the bytes. SentencePiece: the `.model`
file itself as `tokenizer.model`, read by LlamaTokenizer with BOS/EOS off (ember adds neither) and
SentencePiece's dummy-prefix space. transformers converts that model into its own tokenizer, which
gives SentencePiece's ids except for text that *starts* with spaces (SentencePiece merges the dummy
prefix with them); spaces anywhere else, indentation included, tokenize alike (tests/hf). A Hugging Face
tokenizer: its own `tokenizer.json`, and its `tokenizer_config.json` where it has one.
"""

from __future__ import annotations

import json
import os
import shutil

from ember.config.settings import hf_tokenizer_json


def _bytes_to_unicode() -> dict[int, str]:
  """The byte-level pre-tokenizer's printable character for each byte (GPT-2's table)."""
  printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
      range(ord("®"), ord("ÿ") + 1))
  chars, extra = {}, 0
  for b in range(256):
    if b in printable:
      chars[b] = chr(b)
    else:
      chars[b] = chr(256 + extra)
      extra += 1
  return chars


def byte_tokenizer_json() -> dict:
  byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
  return {
      "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
      "pre_tokenizer": byte_level, "post_processor": None, "decoder": byte_level,
      "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                "vocab": {c: b for b, c in _bytes_to_unicode().items()}, "merges": []},
  }


def source_files(tokenizer: str) -> set[str]:
  """The files `write` reads for `data.tokenizer` (absolute paths): an export into the directory that holds them
  keeps them."""
  if tokenizer in ("", "byte"):
    return set()
  source = hf_tokenizer_json(tokenizer)
  if source:
    return {os.path.abspath(source), os.path.abspath(os.path.join(os.path.dirname(source), "tokenizer_config.json"))}
  return {os.path.abspath(os.path.expanduser(tokenizer))}


def _copy(source: str, target: str) -> None:
  if os.path.abspath(source) != os.path.abspath(target):  # Exported into the tokenizer's own directory: in place.
    shutil.copyfile(source, target)


def write(directory: str, tokenizer: str, max_length: int) -> list[str]:
  """Writes the tokenizer files for ember's `data.tokenizer` ("byte", a SentencePiece .model path, or a Hugging
  Face tokenizer.json or its directory)."""
  source = hf_tokenizer_json(tokenizer) if tokenizer not in ("", "byte") else None
  if source:
    _copy(source, os.path.join(directory, "tokenizer.json"))
    config_path = os.path.join(os.path.dirname(source), "tokenizer_config.json")
    if os.path.isfile(config_path):
      _copy(config_path, os.path.join(directory, "tokenizer_config.json"))
    else:
      with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
                   "clean_up_tokenization_spaces": False}, f, indent=2)
    return ["tokenizer.json", "tokenizer_config.json"]
  common = {"model_max_length": max_length, "clean_up_tokenization_spaces": False, "add_bos_token": False,
            "add_eos_token": False, "bos_token": None, "eos_token": None, "pad_token": None, "unk_token": None}
  if tokenizer in ("", "byte"):
    with open(os.path.join(directory, "tokenizer.json"), "w") as f:
      json.dump(byte_tokenizer_json(), f, ensure_ascii=False)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **common}
    files = ["tokenizer.json", "tokenizer_config.json"]
  else:
    _copy(os.path.expanduser(tokenizer), os.path.join(directory, "tokenizer.model"))
    config = {"tokenizer_class": "LlamaTokenizer", "legacy": False, "add_prefix_space": True, **common,
              "unk_token": "<unk>"}
    files = ["tokenizer.model", "tokenizer_config.json"]
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump(config, f, indent=2)
  return files
