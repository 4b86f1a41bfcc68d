"""Train a SentencePiece tokenizer on the train split of a text source.

    python -m ember.data.train_tokenizer --source=text --path='corpus/*.txt' \\
        --vocab_size=8192 --out=tokenizers/corpus

writes `tokenizers/corpus.model` (and `.vocab`); use it with `--config.data.tokenizer=...model`.
An empty `--path` trains on this interpreter's standard-library source, as the default run does.

Only train-split documents are read, so the eval loss is measured on text the tokenizer
never saw. The settings suit source code as well as prose: no text normalisation, no
whitespace folding (indentation is meaningful), and byte fallback so any input encodes.
"""

import itertools
import os
import sys

from ember.config.defaults import EVAL_FRACTION
from ember.data import sources
from ember.errors import ArgumentParser, DataError, EmberError, fail_and_exit


def _sentences(docs, max_docs: int):
  """Lines of the first `max_docs` documents (0 = all): SentencePiece trains on lines."""
  n = len(docs) if max_docs <= 0 else min(max_docs, len(docs))
  for i in range(n):
    for line in docs[i].decode("utf-8", errors="replace").splitlines():
      if line.strip():
        yield line


def train(*, source: str, path: str, vocab_size: int, out: str, max_docs: int = 0,
          input_sentence_size: int = 1_000_000, model_type: str = "bpe",
          eval_fraction: float = EVAL_FRACTION, tfds_name: str = "", tfds_data_dir: str = "",
          tfds_text_key: str = "text") -> str:
  """Trains and writes `out + ".model"`; returns that path."""
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top
  if source == "text":
    docs = sources.text_documents(path, "train", eval_fraction)
  elif source == "tfds":
    docs = sources.tfds_documents(tfds_name, tfds_data_dir, tfds_text_key, "train", eval_fraction)
  else:
    raise DataError(f"--source: must be 'text' or 'tfds', got {source!r}")
  if os.path.dirname(out):
    os.makedirs(os.path.dirname(out), exist_ok=True)
  sentences = _sentences(docs, max_docs)
  if input_sentence_size > 0:
    sentences = itertools.islice(sentences, input_sentence_size)
  spm.SentencePieceTrainer.train(
      sentence_iterator=sentences,
      model_prefix=out,
      vocab_size=vocab_size,
      model_type=model_type,
      character_coverage=1.0,
      byte_fallback=True,
      normalization_rule_name="identity",
      remove_extra_whitespaces=False,
      allow_whitespace_only_pieces=True,
      split_digits=True,
      max_sentence_length=1 << 14,
      num_threads=max(1, min(8, os.cpu_count() or 1)),
      minloglevel=2,
  )
  return out + ".model"


def main(argv=None) -> int:
  p = ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--source", default="text", help="text | tfds")
  p.add_argument("--path", default="", help="glob of text files ('' = stdlib *.py)")
  p.add_argument("--vocab_size", type=int, default=8192)
  p.add_argument("--out", required=True, help="output prefix; writes PREFIX.model")
  p.add_argument("--max_docs", type=int, default=0, help="read at most this many documents")
  p.add_argument("--input_sentence_size", type=int, default=1_000_000,
                 help="train on at most this many lines")
  p.add_argument("--model_type", default="bpe", help="bpe | unigram")
  p.add_argument("--eval_fraction", type=float, default=EVAL_FRACTION,
                 help="must match data.eval_fraction (default: its default) so eval documents stay unseen")
  p.add_argument("--tfds_name", default="")
  p.add_argument("--tfds_data_dir", default="")
  p.add_argument("--tfds_text_key", default="text")
  try:
    model = train(**vars(p.parse_args(argv)))
  except (EmberError, RuntimeError) as e:  # SentencePiece reports bad settings as RuntimeErrors.
    fail_and_exit(e)
  print(model)
  return 0


if __name__ == "__main__":
  sys.exit(main())
