"""Pre-tokenize text files into ArrayRecord files for `data.source=array_record`.

    python -m ember.data.write_array_record --source_glob='corpus/*.txt' \\
        --out=data/corpus.array_record [--tokenizer=byte|PATH.model] [--num_shards=N]

Each record is one document (one file) as little-endian int32 token ids. Tokenizing once
up front moves the tokenizer off the training hosts' critical path. All documents are
written: the train/eval split is made at read time from each record's file name and
position, like every other source. With --num_shards > 1 the files are named
`OUT-00000-of-0000N`; documents go round-robin so shards are equal in size.
"""

import os
import sys

from array_record.python.array_record_module import ArrayRecordWriter

from ember.data import sources, tokenizers
from ember.data.sources import encode_record
from ember.errors import ArgumentParser, DataError, EmberError, fail_and_exit


def shard_paths(out: str, num_shards: int) -> list[str]:
  if num_shards == 1:
    return [out]
  return [f"{out}-{i:05d}-of-{num_shards:05d}" for i in range(num_shards)]


def write(*, source_glob: str, out: str, tokenizer: str = "byte", num_shards: int = 1) -> list[str]:
  """Tokenizes every file matching `source_glob` ("" = stdlib *.py); returns the paths written."""
  if num_shards < 1:
    raise DataError(f"--num_shards: must be >= 1, got {num_shards}")
  files, _ = sources.list_files(source_glob, key="--source_glob")
  tok = tokenizers.build_tokenizer(_TokenizerConfig(tokenizer))
  paths = shard_paths(out, num_shards)
  if os.path.dirname(out):
    os.makedirs(os.path.dirname(out), exist_ok=True)
  # group_size:1 makes each record independently readable: random access for the shuffle.
  writers = [ArrayRecordWriter(p, "group_size:1") for p in paths]
  try:
    for i, f in enumerate(files):
      with open(f, "rb") as fh:
        writers[i % num_shards].write(encode_record(tok.encode(fh.read())))
  finally:
    for w in writers:
      w.close()
  return paths


class _TokenizerConfig:
  """The one key `build_tokenizer` reads, so this tool needs no config file."""

  def __init__(self, tokenizer: str):
    self.tokenizer = tokenizer


def main(argv=None) -> int:
  p = ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--source_glob", default="", help="glob of text files ('' = stdlib *.py)")
  p.add_argument("--out", required=True, help="output file (or prefix with --num_shards > 1)")
  p.add_argument("--tokenizer", default="byte", help="'byte' or a SentencePiece .model path")
  p.add_argument("--num_shards", type=int, default=1)
  try:
    paths = write(**vars(p.parse_args(argv)))
  except EmberError as e:
    fail_and_exit(e)
  print("\n".join(paths))
  return 0


if __name__ == "__main__":
  sys.exit(main())
