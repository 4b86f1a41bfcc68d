"""Mixing sources by their share of tokens.

`TokenMix` draws the next chunk from the source that is furthest behind its weight in *tokens*:
the one with the smallest `tokens_so_far / weight` (ties to the first). Token shares then follow the
weights whatever the sources' document lengths (Grain's own `mix` draws elements by weight, so a
source of short documents would get far fewer tokens than its weight). Deterministic: no randomness,
only counts; checkpointable: the state is the counts and the sources' own iterator states.
"""

from __future__ import annotations

from typing import Sequence

import grain
import numpy as np

from ember.names import INPUTS


class TokenMix(grain.IterDataset):
  def __init__(self, parents: Sequence[grain.IterDataset], weights: Sequence[float]):
    super().__init__(list(parents))
    total = float(sum(weights))
    self._weights = np.asarray([w / total for w in weights], np.float64)

  def __iter__(self) -> "_TokenMixIterator":
    return _TokenMixIterator([p.__iter__() for p in self._parents], self._weights)


class _TokenMixIterator(grain.DatasetIterator):
  def __init__(self, parents, weights: np.ndarray):
    super().__init__(parents)
    self._weights = weights
    self._tokens = np.zeros(len(parents), np.int64)

  def __next__(self):
    i = int(np.argmin(self._tokens / self._weights))
    chunk = next(self._parents[i])
    self._tokens[i] += len(chunk[INPUTS])
    return chunk

  def get_state(self) -> dict:
    return {"tokens": self._tokens.tolist(), "parents": [p.get_state() for p in self._parents]}

  def set_state(self, state: dict) -> None:
    self._tokens = np.asarray(state["tokens"], np.int64)
    for p, s in zip(self._parents, state["parents"]):
      p.set_state(s)
