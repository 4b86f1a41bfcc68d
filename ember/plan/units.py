"""Human units for the planning reports."""

from __future__ import annotations

GiB = 2**30


def format_bytes(n: float | None) -> str:
  if n is None:
    return "-"
  for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if abs(n) >= size:
      return f"{n / size:.2f} {unit}"
  return f"{n:.0f} B"


def format_flops(n: float | None) -> str:
  if n is None:
    return "-"
  for unit, size in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
    if abs(n) >= size:
      return f"{n / size:.2f} {unit}"
  return f"{n:.0f} FLOP"
