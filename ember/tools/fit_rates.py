"""Fit a GPU's achievable rates to ember's measured steps on it, and check the fit by leave-one-out.

  python -m ember.tools.fit_rates --gpu=h100 [--dir=benchmarks/measured/h100]

Reads the measured rows (steps.toml and each row's optimised HLO, benchmarks/measured/<gpu>/), fits the rates
marked `fit = true` in ember/hardware/rates.toml within their sources' ranges (ember/plan/calibrate.py), and
prints: the fit rates beside rates.toml's, each row's predicted step with rates.toml's rates, and each row
predicted with the rates fit on the other rows (leave-one-out) with those rates. Exits 0; 2 for bad input.
No GPU and no compile: the HLO of each measured program is stored with its row.
"""

from __future__ import annotations

import sys

from ember.errors import ArgumentParser, EmberError, fail_and_exit
from ember.tools import cli


def _rates(values: dict[str, float]) -> str:
  return ", ".join(f"{k} {v:.3g}" for k, v in values.items())


def report(gpu: str, directory: str = "") -> str:
  from ember.plan import calibrate
  from ember.program import predict
  rows = calibrate.load(gpu, directory)
  m = calibrate.machine(gpu)
  fitted = calibrate.fit(rows, m)
  free = [k for k, r in m.rates.table.items() if r.fit]
  lines = [f"{gpu}: {len(rows)} measured steps; rates fit within their sources' ranges (ember/hardware/rates.toml)"]
  for k in free:
    r = m.rates.table[k]
    lines.append(f"  {k:<12} fit on all rows {fitted[k]:.4g}   rates.toml {r.value:.4g}   range [{r.low:g}, {r.high:g}]")
  lines.append(f"{'row':<22} {'measured':>9} {'predicted':>10} {'ratio':>6}   (rates.toml's rates)")
  for row in rows:
    step = predict.predict(row.walk, m).step_s
    lines.append(f"{row.name:<22} {row.step_s * 1e3:>7.1f}ms {step * 1e3:>8.1f}ms {step / row.step_s:>6.3f}")
  lines.append(f"{'left out':<22} {'measured':>9} {'predicted':>10} {'ratio':>6}   rates fit on the other rows")
  for c in calibrate.leave_one_out(rows, m):
    lines.append(f"{c.name:<22} {c.measured_s * 1e3:>7.1f}ms {c.predicted_s * 1e3:>8.1f}ms {c.ratio:>6.3f}   "
                 f"{_rates(c.rates)}")
  return "\n".join(lines)


def main(argv: list[str]) -> int:
  parser = ArgumentParser(prog="python -m ember.tools.fit_rates")
  parser.add_argument("--gpu", required=True, help="a GPU with measured steps, e.g. h100")
  parser.add_argument("--dir", default="", help="its measured rows (default benchmarks/measured/<gpu>)")
  try:
    args = cli.parse(parser, argv[1:])
    from ember import hardware
    from ember.errors import ConfigError
    if args.gpu not in hardware.GPUS:
      raise ConfigError(f"--gpu: unknown GPU {args.gpu!r}; ember knows {', '.join(hardware.GPUS)}")
    print(report(args.gpu, args.dir))
  except EmberError as e:
    fail_and_exit(e)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
