"""A GPU's achievable rates fit to ember's own measured steps, and the fit checked by leave-one-out.

A measured row (benchmarks/measured/<gpu>/steps.toml) is a program as it was timed: its optimised HLO and its
median measured step. The rates marked `fit = true` in ember/hardware/rates.toml are chosen, each within its
source's range, to minimise the squared log error of the predicted steps (ember/program/predict.py); the others stay
at their values. Leave-one-out: each row predicted with the rates fit on the others, the honest error of a
prediction for a program the fit has not seen.
"""

from __future__ import annotations

import dataclasses
import gzip
import math
import os
import tomllib

from ember import hardware
from ember.errors import ConfigError
from ember.program import cost, hlo, predict

MEASURED_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                            "benchmarks", "measured")


@dataclasses.dataclass(frozen=True)
class Row:
  name: str
  step_s: float  # Measured.
  walk: predict.Walk


def load(gpu: str, directory: str = "") -> list[Row]:
  """The measured rows of `gpu` (steps.toml and each row's `<name>.hlo.gz` in `directory`)."""
  directory = directory or os.path.join(MEASURED_DIR, gpu)
  path = os.path.join(directory, "steps.toml")
  if not os.path.exists(path):
    raise ConfigError(f"{path}: no measured steps for {gpu}")
  with open(path, "rb") as f:
    table = tomllib.load(f)
  rows = []
  for r in table["row"]:
    with gzip.open(os.path.join(directory, f"{r['name']}.hlo.gz"), "rt") as f:
      rows.append(Row(r["name"], r["step_ms"] / 1e3, predict.Walk(hlo.Program(f.read()))))
  return rows


def machine(gpu: str) -> cost.Machine:
  """One GPU of `gpu` (the measured rows ran on one)."""
  return cost.Machine.one_node(gpu)


def error(rows: list[Row], m: cost.Machine, rates: hardware.Rates) -> float:
  """The sum of the rows' squared log errors (predicted over measured)."""
  return sum(math.log(predict.predict(r.walk, m, rates).step_s / r.step_s) ** 2 for r in rows)


def fit(rows: list[Row], m: cost.Machine, rates: hardware.Rates | None = None) -> hardware.Rates:
  """The rates with their `fit = true` values chosen within their ranges (coordinate descent from the ranges'
  middles, each step halved when no coordinate improves, down to 1/256 of a range)."""
  rates = rates or m.rates
  free = [k for k, r in rates.table.items() if r.fit]
  values = {k: (rates.table[k].low + rates.table[k].high) / 2 for k in free}  # From the ranges' middles, not the
  best = error(rows, m, rates.with_values(values))  # values in use: the fit depends on the data alone.
  step = {k: (rates.table[k].high - rates.table[k].low) / 4 for k in free}
  while any(step[k] > (rates.table[k].high - rates.table[k].low) / 256 for k in free):
    improved = False
    for k in free:
      for sign in (1, -1):
        r = rates.table[k]
        trial = {**values, k: min(max(values[k] + sign * step[k], r.low), r.high)}
        e = error(rows, m, rates.with_values(trial))
        if e < best - 1e-12:
          best, values, improved = e, trial, True
          break
    if not improved:
      step = {k: s / 2 for k, s in step.items()}
  return rates.with_values(values)


@dataclasses.dataclass(frozen=True)
class Check:
  name: str
  measured_s: float
  predicted_s: float
  rates: dict[str, float]  # The fit rates it was predicted with.

  @property
  def ratio(self) -> float:
    return self.predicted_s / self.measured_s


def leave_one_out(rows: list[Row], m: cost.Machine) -> list[Check]:
  """Each row predicted with the rates fit on the other rows."""
  out = []
  for k, row in enumerate(rows):
    rates = fit(rows[:k] + rows[k + 1:], m)
    out.append(Check(row.name, row.step_s, predict.predict(row.walk, m, rates).step_s,
                     {n: r.value for n, r in rates.table.items() if r.fit}))
  return out
