"""Tokenizers: the byte round trip and a SentencePiece model trained by the CLI."""
import inspect
import os
import subprocess
import sys

import numpy as np
import pytest

from ember.config import derive
from ember.data import ByteTokenizer, DataError, build_tokenizer, make_iterator
from ember.tools.sample import prompt_ids
from ember.errors import ConfigError
from tests.helpers import checked, config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_byte_round_trip(data_cfg):
  tok = build_tokenizer(data_cfg())
  assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 256
  text = "def f(x):\n  return x  # ünïcødé ✓ 🚀\t"
  ids = tok.encode(text)
  assert ids.dtype == np.int32 and ids.max() < 256
  np.testing.assert_array_equal(ids, list(text.encode()))
  assert tok.decode(ids) == text
  assert tok.decode(list(ids)) == text
  np.testing.assert_array_equal(tok.encode(b"\xff\x00a"), [255, 0, 97])


def test_missing_model_is_a_data_error(data_cfg, tmp_path):
  with pytest.raises(DataError, match="data.tokenizer"):
    build_tokenizer(data_cfg(tokenizer=str(tmp_path / "nope.model")))


def test_train_sentencepiece_cli(data_cfg, tmp_path):
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  words = ["alpha", "beta", "gamma", "delta", "return", "lambda", "import", "class"]
  rng = np.random.default_rng(0)
  for i in range(12):
    lines = [" ".join(rng.choice(words, size=8)) for _ in range(40)]
    (corpus / f"{i}.txt").write_text("\n".join(lines) + "\n")
  out = tmp_path / "tok" / "tiny"
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  proc = subprocess.run(
      [sys.executable, "-m", "ember.data.train_tokenizer", "--source=text",
       f"--path={corpus}/*.txt", "--vocab_size=300", f"--out={out}", "--max_docs=8",
       "--input_sentence_size=500"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  model = f"{out}.model"
  assert os.path.isfile(model)

  cfg = data_cfg(path=f"{corpus}/*.txt", tokenizer=model, eval_fraction=0.2)
  tok = build_tokenizer(cfg)
  assert tok.vocab_size == 300
  text = "alpha beta return lambda"
  ids = tok.encode(text)
  assert ids.dtype == np.int32 and len(ids) < len(text)  # merges learned
  assert tok.decode(ids) == text

  batch = next(make_iterator(cfg, seq_len=32, global_batch_size=2, seed=0, split="train"))
  assert batch["inputs"].shape == (2, 32) and batch["inputs"].max() < 300

  # model.vocab_size 0 (the default) takes the tokenizer's, rounded up to a multiple of 128; a value set stays.
  vocab = lambda **o: derive(config("tiny", **{"data.source": "text", "data.path": f"{corpus}/*.txt",
                                               "data.tokenizer": model, **o}), 1).model.vocab_size
  assert vocab() == 384 and vocab(**{"model.vocab_size": 320}) == 320
  assert derive(config("tiny"), 1).model.vocab_size == 256  # The byte tokenizer.


def test_a_hugging_face_tokenizer_ends_documents_with_eos_but_not_prompts(tmp_path):
  """A tokenizer whose tokenizer_config.json names an EOS token: training documents end with it, a prompt to
  continue (ember.tools.sample) does not, or the model would start a new document."""
  tokenizers = pytest.importorskip("tokenizers")
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<s>": 0, "</s>": 1, "hello": 2, "world": 3, "[UNK]": 4},
                                                         unk_token="[UNK]"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
  hf = build_tokenizer(config(**{"data.tokenizer": str(tmp_path / "tokenizer.json")}).data)
  assert hf.encode("hello world").tolist() == [2, 3, 1]
  assert [ids.tolist() for ids in prompt_ids(hf, ["hello world", "world"])] == [[2, 3], [3]]


def _bos_tokenizer(directory):
  """A Hugging Face tokenizer that opens every text with BOS (as Llama 3's does) and names its EOS."""
  tokenizers = pytest.importorskip("tokenizers")
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<s>": 0, "</s>": 1, "hello": 2, "world": 3, "[UNK]": 4},
                                                         unk_token="[UNK]"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
  tok.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
  return str(directory / "tokenizer.json")


def test_an_empty_document_is_no_tokens_not_bos_then_eos(tmp_path):
  """Empty texts and skipped bad records are empty documents: with a tokenizer that adds BOS they were [BOS, EOS],
  a two-token segment the loss trained on."""
  path = _bos_tokenizer(tmp_path)
  lines = ['{"text": "hello world hello"}', '{"text": ""}', '{"id": 3}', "not json"] * 8
  (tmp_path / "docs.jsonl").write_text("\n".join(lines) + "\n")
  # A shuffle window as the other data tests take: the default's 16,384 chunks are 2,000 passes over these 8 texts.
  cfg = config(**{"data.source": "jsonl", "data.path": str(tmp_path / "docs.jsonl"), "data.tokenizer": path,
                  "data.eval_fraction": 0.0, "data.chunk_shuffle_window": 256}).data
  batch = next(make_iterator(cfg, seq_len=16, global_batch_size=4, seed=0, split="train", vocab_size=5))
  for inputs, segments in zip(batch["inputs"], batch["segment_ids"]):
    for s in set(segments.tolist()) - {0}:
      assert inputs[segments == s].tolist() == [0, 2, 3, 2]  # BOS hello world hello; its target row ends in EOS.


def test_weights_from_hugging_face_need_their_own_tokenizer(tmp_path):
  """checkpoint.init_from_hf with the byte default (or any tokenizer of another vocabulary) would train the
  weights on other ids, silently: the config names data.tokenizer."""
  _bos_tokenizer(tmp_path)
  (tmp_path / "config.json").write_text("{}")
  run = lambda **o: checked(config(**{"data.source": "text", "checkpoint.init_from_hf": str(tmp_path), **o}))
  with pytest.raises(ConfigError, match=r"config.data.tokenizer: 'byte' \(256 ids\) is not the tokenizer the "
                     r"weights of checkpoint.init_from_hf were trained with \(.*tokenizer.json, 5 ids"):
    run()
  run(**{"data.tokenizer": str(tmp_path)})  # Its own: accepted.
  run(**{"data.source": "synthetic"})  # No text read: nothing to tokenize.


def test_the_tokenizer_trainer_holds_out_the_run_eval_documents():
  from ember.config.defaults import get_config
  from ember.data.train_tokenizer import train
  assert inspect.signature(train).parameters["eval_fraction"].default == get_config().data.eval_fraction
