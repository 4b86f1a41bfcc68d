"""The GPUs ember knows, each in one place: its XLA device spec (`<gpu>.txtpb`, a GpuTargetConfigProto in text
form: SMs, memory size and bandwidth, compute capability, the cuDNN version XLA compiles for) and its row of
`facts.toml` (dense peak TFLOP/s per GEMM precision, NVLink and network bandwidth, with their sources).

The compile targets (ember/plan/target.py) read both; a run's MFU (ember/trainer/perf.py) reads the peaks.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import tomllib

_DIR = os.path.dirname(os.path.abspath(__file__))
GPUS = tuple(sorted(f[: -len(".txtpb")] for f in os.listdir(_DIR) if f.endswith(".txtpb")))


@dataclasses.dataclass(frozen=True)
class DeviceFacts:
  name: str  # The facts.toml row: "h100", "b200", ...
  tflops: dict[str, float]  # Dense peak per GEMM precision (ember/plan/hlo.py's PRECISIONS).
  nvlink_gb_s: float
  nic_gb_s: float

  def peak_flops(self, precision: str) -> float:
    """FLOP/s of a GEMM in `precision`; the bf16 peak for one the chip has no tensor cores for."""
    return self.tflops.get(precision, self.tflops["bf16"]) * 1e12


@functools.cache
def _table() -> dict[str, dict]:
  with open(os.path.join(_DIR, "facts.toml"), "rb") as f:
    return tomllib.load(f)


def facts(gpu: str) -> DeviceFacts:
  row = _table()[gpu]
  return DeviceFacts(gpu, dict(row["tflops"]), row["nvlink_gb_s"], row["nic_gb_s"])


def facts_for_kind(device_kind: str) -> DeviceFacts | None:
  """The facts of a running device by JAX's `device_kind` ("NVIDIA H100 80GB HBM3"); None if unknown."""
  kind = device_kind.lower()
  for gpu, row in _table().items():
    if any(k in kind for k in row["device_kinds"]):
      return facts(gpu)
  return None


@functools.cache
def spec(gpu: str) -> str:
  """The GPU's XLA spec, as text."""
  with open(os.path.join(_DIR, f"{gpu}.txtpb")) as f:
    return f.read()


def hbm_bytes_per_s(gpu: str) -> float:
  return float(re.search(r"memory_bandwidth:\s*(\d+)", spec(gpu)).group(1))
