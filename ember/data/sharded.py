"""What one process feeds the train step: its data shards, read in lockstep, and the global batch.

A global batch of `train.batch_size` rows is cut into `data.num_shards` shards of consecutive rows
(0, the default: one shard per row), each its own pipeline over its own share of the documents, and
each process reads the shards of the rows its devices hold (processes that hold the same rows, such as
the stages of a pipeline across hosts, read the same shards): the rule is `distributed.data_shards`.
`global_batch` assembles the jax.Arrays from every process's rows. The global batches are therefore a
function of the seed and the data config alone: 1, 2, 4 or 8 processes feed the same rows at every
step, and a checkpoint's per-shard positions resume on any of them.
"""

from __future__ import annotations

import json
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import NamedSharding

from ember.config import Settings
from ember.data import sources
from ember.data.pipeline import make_iterator, mixture_components
from ember.errors import warn
from ember.names import BATCH_KEYS, SOURCE
from ember.parallel import distributed


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
