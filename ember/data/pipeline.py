"""The Grain pipeline of one data shard: documents -> the shard's share -> shuffled epochs -> packed rows.

A shard is a block of rows of every global batch (ember/data/sharded.py; by default one row); the
`process_index` / `process_count` arguments here are the shard's index and the number of shards.

    documents (lazy MapDataset of one split)
      [process_index::process_count]    a fixed, disjoint share per shard
      .shuffle(seed).repeat()           a new order every epoch, forever
      .map(tokenize)                    read + tokenize, `num_threads` threads ahead
      chunk, window-shuffle, pack       see packing.py
      .batch(global_batch // processes)
      thread prefetch

Each shard takes its share *before* shuffling, so shard shares stay disjoint in every
epoch even when shards drift apart (packing consumes documents at data-dependent
rates); the shuffle is then a per-epoch permutation of that share. Every stage is a Grain
dataset with a small JSON-able state, so `get_state()` / `set_state()` on the returned
iterator resume the exact batch sequence.

Both splits repeat forever. The eval iterator is built the same way with the same seed, so
a fresh `make_iterator(split="eval")` yields the same batches every time: take the first
`train.eval_batches` and `close()` it.

There is no thread prefetch after batching: reading and tokenizing, the costly stages, already
run `data.num_threads` documents ahead; chunking and packing cost well under a millisecond
per row and overlap with the device through JAX's asynchronous dispatch. (Grain 0.2.18's
`ThreadPrefetchIterDataset` also prints errors at interpreter exit if its iterator is alive.)
"""

import dataclasses

import grain
import numpy as np

from ember.data import packing, sources, tokenizers
from ember.data.mixing import TokenMix
from ember.errors import warn

MIN_PACKING_BINS = 32  # Rows packed at once; more bins, less padding.
SYNTHETIC_WINDOW = 64  # The most batches of synthetic chunks shuffled together (`make_dataset`).


def _tokenize(tokenizer):
  """Text documents to token ids; a list (a Parquet row group) stays a list of documents."""
  def one(doc):
    if not isinstance(doc, bytes):
      return doc
    # An empty document (a skipped bad record, or empty text) is no tokens: encoded, a tokenizer that adds BOS
    # would make it [BOS, EOS], two tokens the packer keeps and the loss trains on.
    return tokenizer.encode(doc) if doc else np.zeros(0, np.int32)
  return lambda doc: [one(d) for d in doc] if isinstance(doc, list) else one(doc)


def make_dataset(data_cfg, *, seq_len: int, global_batch_size: int, seed: int, split: str,
                 process_index: int = 0, process_count: int = 1,
                 vocab_size: int = 256, read_threads: int | None = None) -> grain.IterDataset:
  """The pipeline as a Grain `IterDataset` (see `make_iterator`)."""
  if seq_len < 1:
    raise ValueError(f"seq_len must be positive, got {seq_len}")
  if global_batch_size < 1 or global_batch_size % process_count:
    raise ValueError(f"global batch size {global_batch_size} is not a positive multiple of "
                     f"the process count {process_count}")
  batch = global_batch_size // process_count
  seed32 = int(seed) % 2**32
  # Seeds differ per shard (and per mixture source): shards that share documents (a split with fewer
  # documents than shards wraps) still draw different streams. The single-shard seeds are the old ones.
  shard_seed = (seed32 + 7919 * process_index) % 2**32
  threads = int(data_cfg.num_threads) if read_threads is None else read_threads
  tokens = lambda cfg, component: _tokens(cfg, split, seed=seed, shuffle_seed=(shard_seed + 1000003 * component) % 2**32,
                                          shard=(process_index, process_count), vocab_size=vocab_size,
                                          threads=threads)
  mixture = mixture_components(data_cfg, split)
  if not mixture:
    chunk_ds = packing.chunks(tokens(data_cfg, 0), seq_len=seq_len)
  else:  # Chunks drawn so that each source's share of tokens follows its weight.
    parts = [packing.chunks(tokens(cfg, i), seq_len=seq_len, source=i) for i, (_, cfg, _) in enumerate(mixture)]
    chunk_ds = TokenMix(parts, [w for _, _, w in mixture])

  # The window is the whole batch's: each of `process_count` shards (pipelines) shuffles its share.
  window = -(-data_cfg.chunk_shuffle_window // process_count)
  if not mixture and data_cfg.source == "synthetic":
    # Synthetic documents are short (at most 512 tokens) and drawn on their own: a window of SYNTHETIC_WINDOW
    # batches' worth of chunks already puts a different document in nearly every row, and a larger one only costs
    # its fill (seconds at every start of a small run).
    window = min(window, SYNTHETIC_WINDOW * batch)
  rows = packing.pack(chunk_ds, seq_len=seq_len, num_bins=max(batch, MIN_PACKING_BINS), shuffle_window=window,
                      seed=(shard_seed + 1) % 2**32, with_source=bool(mixture))
  return rows.batch(batch, drop_remainder=True)


def _tokens(data_cfg, split: str, *, seed: int, shuffle_seed: int, shard: tuple[int, int], vocab_size: int,
            threads: int) -> grain.IterDataset:
  """One source's documents: this shard's share, shuffled every epoch, forever, tokenized ahead."""
  docs = sources.documents(data_cfg, split, seed=seed, vocab_size=vocab_size)
  if len(docs) < shard[1]:
    _warn_once(f"data: source {data_cfg.source}{f' at {data_cfg.path}' if data_cfg.path else ''} has "
               f"{len(docs)} {split} documents for {shard[1]} data shards: shards share documents (each its "
               "own shuffle), so rows repeat data within an epoch; lower data.num_shards or add documents")
  docs = sources.shard(docs, *shard).shuffle(shuffle_seed).repeat()
  tokenizer = None if data_cfg.source == "synthetic" else tokenizers.build_tokenizer(data_cfg)
  return docs.map(_tokenize(tokenizer)).to_iter_dataset(
      grain.ReadOptions(num_threads=threads, prefetch_buffer_size=max(4, 4 * threads)))


_WARNED: set[str] = set()


def _warn_once(msg: str) -> None:
  """Every shard's pipeline would say it: once per process."""
  if msg not in _WARNED:
    _WARNED.add(msg)
    warn(msg)


def mixture_components(data_cfg, split: str) -> list[tuple[str, object, float]]:
  """(name, the data config of that source, weight) for each source of `data.mixture` (`data.eval_mixture`
  for eval, when set); [] without a mixture. An entry is (name, source, path, text_key, weight)."""
  entries = data_cfg.eval_mixture if split == "eval" and data_cfg.eval_mixture else data_cfg.mixture
  return [(name, dataclasses.replace(data_cfg, source=source, path=path, text_key=text_key), float(weight))
          for name, source, path, text_key, weight in entries]


def make_iterator(data_cfg, *, seq_len: int, global_batch_size: int, seed: int, split: str,
                  process_index: int = 0, process_count: int = 1,
                  vocab_size: int = 256, read_threads: int | None = None) -> grain.DatasetIterator:
  """An endless iterator of this process's batches.

  Each batch is a dict of int32 arrays [global_batch_size // process_count, seq_len]:
  `inputs`, `targets`, `segment_ids` (0 = padding), `positions`. `vocab_size` (the model's): the
  synthetic source draws its ids below it, and an array_record id at or past it is a DataError; the
  text sources' ids are the tokenizer's (config validation checks it against the model's).
  """
  return iter(make_dataset(
      data_cfg, seq_len=seq_len, global_batch_size=global_batch_size, seed=seed, split=split,
      process_index=process_index, process_count=process_count, vocab_size=vocab_size,
      read_threads=read_threads))
