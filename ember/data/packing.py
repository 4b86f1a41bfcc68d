"""Chunk token streams into next-token pairs and pack them into fixed-length rows.

A document of n tokens becomes chunks of at most seq_len + 1 tokens that overlap by one,
so every token after the first is a target exactly once:
`inputs = chunk[:-1]`, `targets = chunk[1:]`. Chunks are then packed first-fit into rows
of exactly seq_len by Grain's `FirstFitPackIterDataset`, whose iterator state is a small
dict (the parent's state at the start of the current packed group), so packing stays
checkpointable without storing any tokens.

Row layout: `segment_ids` numbers the pieces of a row 1, 2, 3, ... (0 = padding),
`positions` restart at 0 for each piece, and padding has inputs = targets = 0. Chunks of a
mixture's sources carry `source` (1 + the source's index) on every token, packed alike.
"""

import dataclasses

import grain
import numpy as np

from ember.names import INPUTS, POSITIONS, SEGMENT_IDS, SOURCE, TARGETS



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


def chunks(tokens: grain.IterDataset, *, seq_len: int, source: int | None = None) -> grain.IterDataset:
  """Token arrays -> next-token chunks (tagged with `source` for a mixture)."""
  return grain.experimental.FlatMapIterDataset(tokens, ChunkDocument(seq_len, source))


def pack(chunk_ds: grain.IterDataset, *, seq_len: int, num_bins: int, shuffle_window: int, seed: int,
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
