"""Quantization health in the metrics: per projection kind and role, over layers, and warnings.

The train step returns, with `log.quant_stats_every > 0`, the "gradient" of every projection's
QuantStats input: a tree shaped like the parameters whose leaves hold, per stacked layer, one row of
ember/quant/health.py's STATS per role (x, kernel, grad; MoE kernels one row per expert). `summarize`
turns it into flat records:

  quant/<projection>/<role>/<stat>         mean over layers
  quant/<projection>/<role>/<stat>_max     max over layers
  quant/<projection>/<role>/<stat>_layer   the layer of that max (the worst offender)

with <role> activation | weight | gradient and <stat> amax, scale, saturated, underflow (fractions of
the tensor's nonzero elements) and, for delayed scaling, staleness. `Watch` compares the maxima with
health.THRESHOLDS (or the recipe's own limits) and says, once per occurrence (until the statistic is back under its threshold),
which projection, role, layer and step crossed.
"""

from __future__ import annotations

import numpy as np

from ember.config.model import ModelConfig
from ember.layers.decoder import stacked_layers, tree_leaves
from ember.quant import health
from ember.quant.recipe import ACTIVATION, GRADIENT, SCHEMES, WEIGHT, Recipe

ROLES = (ACTIVATION, WEIGHT, GRADIENT)  # The rows of a QuantStats input, in order.
MTP = "mtp"  # The multi-token-prediction modules' subtree of the state (layers/decoder.py's `Transformer.mtp`).
_I = {name: i for i, name in enumerate(health.STATS)}


def _projection(path: tuple) -> str:
  """The projection kind (names.PROJECTIONS) of the module a stats leaf belongs to."""
  keys = [str(k) for k in path[:-1]]
  name = keys[-1]
  if keys[0] == MTP and len(keys) == 3:  # A prediction module's own projection (mtp/<i>/proj).
    return "mtp_proj"
  if "shared" in keys:
    return f"shared_{name}"
  if "moe" in keys:
    return f"moe_{name}"
  return name


def _by_role(rows: np.ndarray) -> np.ndarray:
  """[3, S] from a leaf's rows: dense [3, S]; MoE [E + 2, S] with the experts' kernels merged (amax max,
  scale min, counts summed, staleness max)."""
  if rows.shape[0] == 3:
    return rows
  kernels = rows[1:-1]
  merged = np.array([kernels[:, _I["amax"]].max(), kernels[:, _I["scale"]].min(), kernels[:, _I["saturated"]].sum(),
                     kernels[:, _I["underflow"]].sum(), kernels[:, _I["nonzero"]].sum(),
                     kernels[:, _I["staleness"]].max()], np.float32)
  return np.stack([rows[0], merged, rows[-1]])


def per_layer(stats_tree: dict, model: ModelConfig, recipe: Recipe) -> dict[tuple[str, str], dict[int, np.ndarray]]:
  """(projection, role) -> {layer: STATS vector}."""
  out: dict[tuple[str, str], dict[int, np.ndarray]] = {}
  for path, leaf in tree_leaves(stats_tree):
    leaf = np.asarray(leaf, np.float32)
    projection = _projection(path)
    layers = stacked_layers(model, recipe, path)
    if path[0] == MTP:  # Prediction module i (not stacked) is the model's layer num_layers + i (layers/mtp.py).
      layers, leaf = [model.num_layers + int(path[1])], leaf[None]
    for index, layer in enumerate(layers or []):  # Only layers collect them.
      rows = _by_role(leaf[index])
      for r, role in enumerate(ROLES):
        out.setdefault((projection, role), {})[layer] = rows[r]
  return out


def summarize(stats_tree: dict, model: ModelConfig, recipe: Recipe) -> dict[str, float]:
  """The flat `quant/...` records of one step's statistics (see the module doc)."""
  record: dict[str, float] = {}
  names = ["amax", "scale", "saturated", "underflow"] + (["staleness"] if recipe.delayed else [])
  for (projection, role), layers in sorted(per_layer(stats_tree, model, recipe).items()):
    order = sorted(layers)
    rows = np.stack([layers[layer] for layer in order])
    nonzero = np.maximum(rows[:, _I["nonzero"]], 1.0)
    values = {"amax": rows[:, _I["amax"]], "scale": rows[:, _I["scale"]],
              "saturated": rows[:, _I["saturated"]] / nonzero, "underflow": rows[:, _I["underflow"]] / nonzero,
              "staleness": rows[:, _I["staleness"]]}
    for stat in names:
      v = values[stat]
      key = f"quant/{projection}/{role}/{stat}"
      worst = int(np.argmax(v))
      record[key] = float(np.mean(v))
      record[f"{key}_max"] = float(v[worst])
      if stat not in ("amax", "scale"):
        record[f"{key}_layer"] = order[worst]
  return record


class Watch:
  """Warnings from summarized records: a statistic's max over layers above its threshold (per recipe),
  said once per occurrence: again only after it has been back under the threshold."""

  def __init__(self, recipe_name: str):
    self.thresholds = health.thresholds(SCHEMES[recipe_name].health_limits)
    self.active: set[str] = set()

  def check(self, record: dict, step: int) -> list[str]:
    warnings, now = [], set()
    for key, value in record.items():
      parts = key.split("/")
      if len(parts) != 4 or not parts[3].endswith("_max") or parts[3][:-4] not in self.thresholds:
        continue
      stat = parts[3][:-4]
      limit, meaning = self.thresholds[stat]
      if value > limit:
        base = key[: -len("_max")]
        now.add(base)
        if base not in self.active:
          layer = record.get(f"{base}_layer")
          amount = f"{value:.1%}" if stat != "staleness" else f"{value:.3g}x"
          warnings.append(f"step {step}: {parts[1]} {parts[2]} in layer {layer}: {amount} {meaning} "
                          f"(threshold {limit:.3g}{'x' if stat == 'staleness' else ''})")
    self.active = now
    return warnings
