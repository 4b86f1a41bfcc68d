"""The input pipeline: what one process feeds the train step, and the Grain pipeline of each of its data shards.

What one process feeds (`data_iterator`, `ShardedIterator`, `global_batch`): its data shards, read in lockstep,
and the global batch. A global batch of `train.batch_size` rows is cut into `data.num_shards` shards of
consecutive rows (0, the default: one shard per row), each its own pipeline over its own share of the documents,
and each process reads the shards of the rows its devices hold (processes that hold the same rows, such as the
stages of a pipeline across hosts, read the same shards): the rule is `distributed.data_shards`. `global_batch`
assembles the jax.Arrays from every process's rows. The global batches are therefore a function of the seed and
the data config alone: 1, 2, 4 or 8 processes feed the same rows at every step, and a checkpoint's per-shard
positions resume on any of them.

The Grain pipeline of one shard (`make_iterator`): documents -> the shard's share -> shuffled epochs -> packed
rows; its `process_index` / `process_count` arguments are the shard's index and the number of shards.

    documents (lazy MapDataset of one split)
      [process_index::process_count]    a fixed, disjoint share per shard
      .shuffle(seed).repeat()           a new order every epoch, forever
      .map(tokenize)                    read + tokenize, `num_threads` threads ahead
      chunk, window-shuffle, pack       `next_token_chunks`, `pack_rows`
      .batch(global_batch // processes)

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

Chunks and rows: a document of n tokens becomes chunks of at most seq_len + 1 tokens that overlap by one,
so every token after the first is a target exactly once:
`inputs = chunk[:-1]`, `targets = chunk[1:]`. Chunks are then packed first-fit into rows
of exactly seq_len by Grain's `FirstFitPackIterDataset`, whose iterator state is a small
dict (the parent's state at the start of the current packed group), so packing stays
checkpointable without storing any tokens. Row layout: `segment_ids` numbers the pieces of a row 1, 2, 3, ...
(0 = padding), `positions` restart at 0 for each piece, and padding has inputs = targets = 0. Chunks of a
mixture's sources carry `source` (1 + the source's index) on every token, packed alike.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable

import grain
import jax
import numpy as np
from jax.sharding import NamedSharding

from ember.config import Settings
from ember.data import sources, tokenizers
from ember.data.mixing import TokenMix
from ember.errors import warn
from ember.names import BATCH_KEYS, INPUTS, POSITIONS, SEGMENT_IDS, SOURCE, TARGETS
from ember.parallel import distributed


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
    chunk_ds = next_token_chunks(tokens(data_cfg, 0), seq_len=seq_len)
  else:  # Chunks drawn so that each source's share of tokens follows its weight.
    parts = [next_token_chunks(tokens(cfg, i), seq_len=seq_len, source=i) for i, (_, cfg, _) in enumerate(mixture)]
    chunk_ds = TokenMix(parts, [w for _, _, w in mixture])

  # The window is the whole batch's: each of `process_count` shards (pipelines) shuffles its share.
  window = -(-data_cfg.chunk_shuffle_window // process_count)
  if not mixture and data_cfg.source == "synthetic":
    # Synthetic documents are short (at most 512 tokens) and drawn on their own: a window of SYNTHETIC_WINDOW
    # batches' worth of chunks already puts a different document in nearly every row, and a larger one only costs
    # its fill (seconds at every start of a small run).
    window = min(window, SYNTHETIC_WINDOW * batch)
  rows = pack_rows(chunk_ds, seq_len=seq_len, num_bins=max(batch, MIN_PACKING_BINS), shuffle_window=window,
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


def chunk_document(tokens: np.ndarray, seq_len: int, source: int | None = None) -> list[dict[str, np.ndarray]]:
  """(inputs, targets) pairs of at most seq_len tokens; none for a document under 2 tokens. With a
  `source` index, each chunk also carries `source + 1` on every token."""
  tokens = np.asarray(tokens, np.int32)
  chunks = [{INPUTS: c[:-1], TARGETS: c[1:]}
            for c in (tokens[s:s + seq_len + 1] for s in range(0, len(tokens) - 1, seq_len))]
  if source is not None:
    for c in chunks:
      c[SOURCE] = np.full(len(c[INPUTS]), source + 1, np.int32)
  return chunks


@dataclasses.dataclass(frozen=True)
class ChunkDocument(grain.experimental.FlatMapTransform):
  """`chunk_document` as a Grain flat-map (the fan-out bound is advisory for iter datasets)."""

  seq_len: int
  source: int | None = None
  max_fan_out: int = 1 << 20

  def flat_map(self, element):
    if isinstance(element, list):  # Several documents read together (a Parquet row group).
      return [c for doc in element for c in chunk_document(doc, self.seq_len, self.source)]
    return chunk_document(element, self.seq_len, self.source)


def _rename(packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Grain names the packing features per key; inputs and targets (and sources) share them here."""
  row = {
      INPUTS: packed[INPUTS],
      TARGETS: packed[TARGETS],
      SEGMENT_IDS: packed[f"{INPUTS}_segment_ids"].astype(np.int32),
      POSITIONS: packed[f"{INPUTS}_positions"].astype(np.int32),
  }
  if SOURCE in packed:
    row[SOURCE] = packed[SOURCE].astype(np.int32)
  return row


def next_token_chunks(tokens: grain.IterDataset, *, seq_len: int, source: int | None = None) -> grain.IterDataset:
  """Token arrays -> next-token chunks (tagged with `source` for a mixture)."""
  return grain.experimental.FlatMapIterDataset(tokens, ChunkDocument(seq_len, source))


def pack_rows(chunk_ds: grain.IterDataset, *, seq_len: int, num_bins: int, shuffle_window: int, seed: int,
         with_source: bool = False) -> grain.IterDataset:
  """Chunks -> packed rows {inputs, targets, segment_ids, positions[, source]}, each [seq_len].

  `shuffle_window` chunks are shuffled together before packing (0 = off): a long file
  otherwise fills many consecutive rows, and a batch would hold one document.
  """
  if shuffle_window > 1:
    chunk_ds = grain.experimental.WindowShuffleIterDataset(chunk_ds, window_size=shuffle_window, seed=seed)
  lengths = {INPUTS: seq_len, TARGETS: seq_len, **({SOURCE: seq_len} if with_source else {})}
  packed = grain.experimental.FirstFitPackIterDataset(chunk_ds, length_struct=lengths, num_packing_bins=num_bins,
                                                      shuffle_bins=False)
  return packed.map(_rename)


class ShardedIterator:
  """This process's data shards, read in lockstep; a batch is their rows concatenated in shard order.

  Its state (JSON) maps each shard to its Grain iterator state, so the position of shard k can be
  restored by whichever process reads shard k next time. It is saved through Grain's
  `grain.checkpoint.CheckpointSave` (get_state as bytes) and restored from every process's file merged
  (ember/trainer/checkpointing.py's `restore_data_position`, set_state).
  """

  def __init__(self, make: Callable[[int], Any], shards: list[int], num_shards: int, fingerprint: str = "",
               primary: bool = True):
    self.shards, self.num_shards, self.fingerprint = list(shards), num_shards, fingerprint
    self.primary = primary  # No lower process reads these shards: counts over processes take this one's.
    self._make = make
    self._its = [make(s) for s in self.shards]

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    parts = [next(it) for it in self._its]
    if len(parts) == 1:
      return parts[0]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

  def shard_states(self) -> dict[str, Any]:
    return {str(s): it.get_state() for s, it in zip(self.shards, self._its)}

  def get_state(self) -> bytes:
    return json.dumps({"num_shards": self.num_shards, "fingerprint": self.fingerprint,
                       "shards": self.shard_states()}).encode()

  def set_state(self, state: bytes | str | dict) -> None:
    """Resumes every shard's position: the one resume rule, whatever process count saved it (the state
    of several processes' files merged, ember/trainer/checkpointing.py). A position saved for other data
    (another shard count, sources, mixture or window: the fingerprint) cannot be mapped: the iterator
    then starts from the beginning with a warning, and the checkpoint's model state is restored all the
    same."""
    state = json.loads(state) if isinstance(state, (bytes, str)) else state
    reason = None
    if state.get("num_shards") != self.num_shards:
      reason = (f"{state.get('num_shards')} data shards, this run reads {self.num_shards} "
                "(data.num_shards or train.batch_size changed)")
    elif not _same_data(state.get("fingerprint", ""), self.fingerprint):
      reason = ("other data (data.source, path, text_key, the dataset, tokenizer, mixture or shuffle window changed, "
                "or the files a path matches)")
    elif not all(str(s) in state.get("shards", {}) for s in self.shards):
      reason = "other shards"
    if reason is None:
      try:
        for s, it in zip(self.shards, self._its):
          it.set_state(state["shards"][str(s)])
        return
      except Exception as e:  # A Grain state of another pipeline layout.
        reason = f"a pipeline this run cannot resume ({type(e).__name__})"
    warn(f"the saved data position is for {reason}: the data iterator starts from the beginning")
    self.close()
    self._its = [self._make(s) for s in self.shards]

  def close(self) -> None:
    for it in self._its:
      getattr(it, "close", lambda: None)()


def data_iterator(cfg: Settings, split: str, sharding: NamedSharding | None = None) -> ShardedIterator:
  """This process's rows of each global batch of `split`: those its devices hold under the batch's `sharding`
  (None: every row, one process); ember/parallel/distributed.py's `data_shards` is the rule."""
  rows = None if sharding is None else distributed.process_rows(sharding, cfg.train.batch_size, cfg.model.seq_len)
  if rows is None and jax.process_count() > 1:
    raise ValueError("data_iterator: several processes read the rows the batch's sharding gives them; pass it")
  shards = distributed.data_shards(cfg.data.num_shards, cfg.train.batch_size, rows)
  threads = max(1, int(cfg.data.num_threads) // len(shards.mine))  # The process's read threads, over its shards.
  make = lambda shard: make_iterator(cfg.data, seq_len=cfg.model.seq_len, global_batch_size=cfg.train.batch_size,
                                     seed=cfg.seed, split=split, process_index=shard, process_count=shards.count,
                                     vocab_size=cfg.model.vocab_size, read_threads=threads)
  return ShardedIterator(make, list(shards.mine), shards.count, data_fingerprint(cfg.data, split),
                         primary=shards.primary)


# What a dataset library's source reads besides data.source and text_key: which dataset, configuration, split
# and field. In a fingerprint only where that source is read, so the other sources' saved positions keep theirs.
_LIBRARY_KEYS = {"tfds": ("tfds_text_key",), "hf": ("hf_dataset", "hf_config", "hf_split")}


def data_fingerprint(data_cfg, split: str) -> str:
  """What a saved data position belongs to: the keys that change the document streams, and the files each file
  source matches (`sources.files_digest`: files added under a glob re-index its documents)."""
  keys = ("source", "path", "text_key", "tfds_name", "tokenizer", "eval_fraction", "chunk_shuffle_window", "mixture")
  keys += _LIBRARY_KEYS.get(data_cfg.source, ())
  if split == "eval":
    keys += ("eval_mixture",)
  read = [c for _, c, _ in mixture_components(data_cfg, split)] or [data_cfg]
  files = {c.path: sources.files_digest(c.path) for c in read if c.source in sources.FILE_SOURCES}
  return json.dumps({**{k: getattr(data_cfg, k) for k in keys}, "files": files}, sort_keys=True, default=str)


def _same_data(saved: str, ours: str) -> bool:
  """Whether a saved position's fingerprint is this run's data; one saved before fingerprints held the files
  (`data_fingerprint`) is compared on its keys alone, so a run resumes across that change."""
  if saved == ours:
    return True
  try:
    saved_keys, our_keys = json.loads(saved), json.loads(ours)
  except ValueError:
    return False
  return isinstance(saved_keys, dict) and "files" not in saved_keys and {**our_keys, "files": None} == \
      {**saved_keys, "files": None}


def source_shares(cfg: Settings) -> SourceShares:
  """The share counter of the training mixture (counts nothing without one)."""
  return SourceShares([name for name, _, _ in mixture_components(cfg.data, "train")])


def global_batch(batch: dict[str, np.ndarray], sharding: NamedSharding, batch_size: int) -> dict[str, jax.Array]:
  """This process's rows of a batch of `batch_size` rows as global jax.Arrays on `sharding` (every process calls
  it); only the model's inputs (names.BATCH_KEYS) go to the devices. A process holds whole rows
  (`distributed.process_rows`), so the global shape is stated: where the sequence is split over processes (a
  context group across hosts) JAX would otherwise take each process's rows for its share of the length."""
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(batch[k]),
                                                    (batch_size,) + np.shape(batch[k])[1:]) for k in BATCH_KEYS}


class SourceShares:
  """Each mixture source's share of the real tokens fed since the last report, over all processes."""

  def __init__(self, names: list[str]):
    self.names = list(names)
    self.counts = np.zeros(len(self.names), np.int64)

  def count(self, rows: dict[str, np.ndarray]) -> None:
    if self.names and SOURCE in rows:
      self.counts += np.bincount(np.asarray(rows[SOURCE]).ravel(), minlength=len(self.names) + 1)[1:]

  def report(self) -> dict[str, float]:
    """{"data_share/<name>": share}, then starts counting again (every process calls it at the same step)."""
    if not self.names:
      return {}
    counts = distributed.sum_over_processes(self.counts)
    self.counts = np.zeros_like(self.counts)
    total = max(int(counts.sum()), 1)
    return {f"data_share/{n}": float(c) / total for n, c in zip(self.names, counts)}
