"""`quant.exclude`: which projections stay in bf16 under a quantized recipe. The one place the rule lives.

An entry selects projections by layer, by kind, or both:

  lm_head             the LM head
  wo                  every projection of that kind (qkv, out, wi, wo, moe_wi, moe_wo, shared_wi,
                      shared_wo) in every layer
  layers[0]           every projection of layer 0
  layers[-2:]         every projection of the last two layers
  layers[0:4].wo      the `wo` projection of layers 0, 1, 2 and 3
  layers[-1].qkv      the last layer's `qkv`
  mtp                 every projection of the multi-token-prediction modules (ember/layers/mtp.py)
  mtp.wo              their `wo` projections

Layer ranges are Python slices over `range(num_layers)` (negative indices count from the end, as
Megatron's "first/last N layers in bf16" does), so `layers[1]` never also means layer 10, as the
glob `layers.1*` did. They select decoder layers only: the prediction modules after them (the model's
layers num_layers, num_layers + 1, ...) are `mtp`'s. A malformed entry is an error naming it, never a
pattern that matches nothing.
"""

from __future__ import annotations

import dataclasses
import re

from ember.names import LAYER_PROJECTIONS, PROJECTIONS

_INT = r"-?\d+"
_LAYERS = re.compile(rf"^layers\[(?:(?P<index>{_INT})|(?P<start>{_INT})?:(?P<stop>{_INT})?)\]"
                     rf"(?:\.(?P<projection>\w+))?$")
_MTP = re.compile(r"^mtp(?:\.(?P<projection>\w+))?$")
MTP_LAYERS = "mtp"  # `Selector.layers` of an `mtp` entry: every layer past the decoder's.


@dataclasses.dataclass(frozen=True)
class Selector:
  """One parsed `quant.exclude` entry. `layers` is None (any layer, or the head), an index or a slice of the
  decoder's layers, or `MTP_LAYERS`."""
  text: str
  layers: int | slice | str | None
  projection: str | None

  def matches(self, projection: str, layer: int | None, num_layers: int) -> bool:
    if self.projection is not None and projection != self.projection:
      return False
    if self.layers is None:
      return True
    if layer is None:  # The LM head belongs to no layer.
      return False
    if self.layers == MTP_LAYERS:
      return layer >= num_layers
    chosen = range(num_layers)[self.layers]
    return layer in (chosen if isinstance(chosen, range) else (chosen,))


def parse(entry: str) -> Selector:
  """The selector an entry spells; ValueError (naming the entry and the grammar) if malformed."""
  if not isinstance(entry, str):
    raise ValueError(f"entry {entry!r} is not a string")
  text = entry.strip()
  if text in PROJECTIONS:
    return Selector(text, None, text)
  m = _LAYERS.match(text) or _MTP.match(text)
  if m is None:
    raise ValueError(f"entry {entry!r} is not a projection ({', '.join(PROJECTIONS)}) nor "
                     "layers[I], layers[A:B], mtp or any of them followed by .PROJECTION")
  projection = m.group("projection")
  if projection is not None and projection not in LAYER_PROJECTIONS:
    raise ValueError(f"entry {entry!r}: unknown projection {projection!r}; layers hold {', '.join(LAYER_PROJECTIONS)}")
  if m.re is _MTP:
    layers: int | slice | str = MTP_LAYERS
  elif m.group("index") is not None:
    layers = int(m.group("index"))
  else:
    to_int = lambda s: None if s is None else int(s)
    layers = slice(to_int(m.group("start")), to_int(m.group("stop")))
  return Selector(text, layers, projection)


def check_layers(selectors: tuple[Selector, ...], num_layers: int, mtp_depth: int = 0) -> None:
  """ValueError for a single-layer index outside the model (a range may select nothing: `layers[-4:]`
  of a 2-layer model is both layers), or an `mtp` entry for a model without prediction modules."""
  for s in selectors:
    if isinstance(s.layers, int) and not -num_layers <= s.layers < num_layers:
      raise ValueError(f"entry {s.text!r}: layer {s.layers} is outside a model of {num_layers} layers")
    if s.layers == MTP_LAYERS and mtp_depth == 0:
      raise ValueError(f"entry {s.text!r}: the model has no multi-token-prediction modules (model.mtp_depth=0)")


def excluded(selectors: tuple[Selector, ...], projection: str, layer: int | None, num_layers: int) -> bool:
  """Whether any selector keeps the projection `projection` of `layer` (None: the LM head) in bf16."""
  return any(s.matches(projection, layer, num_layers) for s in selectors)
