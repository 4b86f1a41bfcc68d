"""The process environment a compile for a described GPU target needs, set before JAX is imported.

A GPU target (`--target=h100x8`) is described, not run: JAX must not bring up a CUDA backend (it fails
without a GPU, and compile-only devices need the CPU as the process's backend). Imports nothing of JAX.
"""

from __future__ import annotations

import os


def target_name(argv: list[str]) -> str:
  """The value of `--target=NAME` or `--target NAME` ("" if absent)."""
  for i, a in enumerate(argv):
    if a.startswith("--target="):
      return a.split("=", 1)[1]
    if a == "--target" and i + 1 < len(argv):
      return argv[i + 1]
  return ""


def prepare_environment(argv: list[str]) -> None:
  if target_name(argv) not in ("", "cpu"):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # The plugin's "no CUDA driver here" notices.
