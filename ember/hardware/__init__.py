"""The GPUs ember knows, each in one place: its XLA device spec (`<gpu>.txtpb`, a GpuTargetConfigProto in text
form: SMs, memory size and bandwidth, compute capability, the cuDNN version XLA compiles for) and its row of
`facts.toml` (dense peak TFLOP/s per GEMM precision, NVLink and network bandwidth, with their sources) and
its row of `rates.toml` (what its kernels reach in practice: fractions of those peaks, a kernel's launch cost,
each with its source's range).

Each GPU is read once into a `Gpu` (`gpu(name)`): the spec's figures, the facts row and the rates. The compile
targets (ember/plan/target.py) and the roofline read it, the predicted step (ember/program/predict.py) its rates;
a run's MFU (ember/trainer/perf.py) reads the peaks.
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
  tflops: dict[str, float]  # Dense peak per GEMM precision (ember/program/hlo.py's PRECISIONS).
  nvlink_gb_s: float
  nic_gb_s: float
  host_gb_s: float  # The link to host memory, one direction.
  mfu_precision: str  # facts.toml's: the precision whose dense peak MFU is quoted against.

  def peak_flops(self, precision: str) -> float:
    """FLOP/s of a GEMM in `precision`; the `mfu_precision` peak for one the chip has no tensor cores for
    (XLA emulates it: dequantizes, then multiplies in that precision)."""
    return self.tflops.get(precision, self.tflops[self.mfu_precision]) * 1e12

  @property
  def mfu_peak_flops(self) -> float:
    """The dense peak MFU is measured against, whatever the recipe (FP8 and FP4 GEMMs run faster than it)."""
    return self.peak_flops(self.mfu_precision)


@functools.cache
def _table(name: str = "facts.toml") -> dict[str, dict]:
  """A TOML table beside this file, read once."""
  with open(os.path.join(_DIR, name), "rb") as f:
    return tomllib.load(f)


def _rows() -> dict[str, dict]:
  """facts.toml's GPU rows (its tables; the scalars above them hold for every row)."""
  return {k: v for k, v in _table().items() if isinstance(v, dict)}


def facts(gpu: str) -> DeviceFacts:
  row = _rows()[gpu]
  return DeviceFacts(gpu, dict(row["tflops"]), row["nvlink_gb_s"], row["nic_gb_s"], row["host_gb_s"],
                     _table()["mfu_precision"])


def facts_for_kind(device_kind: str) -> DeviceFacts | None:
  """The facts of a running device by JAX's `device_kind` ("NVIDIA H100 80GB HBM3"); None if unknown."""
  kind = device_kind.lower()
  for gpu, row in _rows().items():
    if any(k in kind for k in row["device_kinds"]):
      return facts(gpu)
  return None


@dataclasses.dataclass(frozen=True)
class Rate:
  """One achievable rate: the value used, its source's published range, and whether it was fit to ember's own
  measured steps (benchmarks/measured/<gpu>/)."""
  value: float
  low: float
  high: float
  source: str
  fit: bool = False


@dataclasses.dataclass(frozen=True)
class Rates:
  """A GPU's rows of rates.toml (its header says what each rate is), with the spec's SM count."""
  gpu: str
  table: dict[str, Rate]
  sms: int

  def __getitem__(self, name: str) -> float:
    return self.table[name].value

  def gemm(self, precision: str) -> float:
    """The fraction of the dense peak a large GEMM reaches in `precision` (bf16's where the GPU has no entry)."""
    return self.table.get(f"gemm_{precision}", self.table["gemm_bf16"]).value

  def with_values(self, values: dict[str, float]) -> "Rates":
    """The same rates with some values replaced (a fit's candidates)."""
    table = {k: dataclasses.replace(r, value=values[k]) if k in values else r for k, r in self.table.items()}
    return dataclasses.replace(self, table=table)

  def outside_range(self) -> list[str]:
    return [f"{k} = {r.value:g} outside [{r.low:g}, {r.high:g}]" for k, r in self.table.items()
            if not r.low <= r.value <= r.high]


def rates(name: str) -> Rates:
  """The achievable rates of GPU `name` (one of GPUS)."""
  row = _table("rates.toml")[name]
  row = _table("rates.toml")[row["inherit"]] if "inherit" in row else row
  table = {k: Rate(float(v["value"]), float(v["low"]), float(v["high"]), v["source"], bool(v.get("fit", False)))
           for k, v in row.items()}
  return Rates(name, table, gpu(name).sms)


@dataclasses.dataclass(frozen=True)
class Gpu:
  """One GPU: its XLA spec (the text JAX builds compile-only devices from) and the figures read from it."""
  name: str
  spec: str  # The GpuTargetConfigProto, as text.
  facts: DeviceFacts
  memory_bytes: int  # device_memory_size
  hbm_bytes_per_s: float  # memory_bandwidth
  device_kind: str  # device_description_str, as JAX's device_kind names it.
  compute_capability: tuple[int, int]  # cuda_compute_capability
  cudnn_version: int  # dnn_version_info as cuDNN numbers it (9.8 -> 90800): what XLA compiles cuDNN calls for.
  sms: int  # core_count: streaming multiprocessors.


@functools.cache
def gpu(name: str) -> Gpu:
  """The GPU `name` (one of GPUS), its spec parsed once."""
  with open(os.path.join(_DIR, f"{name}.txtpb")) as f:
    text = f.read()
  field = lambda pattern: re.search(pattern, text).groups(default="0")
  cc = field(r"cuda_compute_capability\s*\{\s*major:\s*(\d+)(?:\s*minor:\s*(\d+))?")
  dnn = field(r"dnn_version_info\s*\{\s*major:\s*(\d+)(?:\s*minor:\s*(\d+))?")
  return Gpu(name=name, spec=text, facts=facts(name), memory_bytes=int(field(r"device_memory_size:\s*(\d+)")[0]),
             hbm_bytes_per_s=float(field(r"memory_bandwidth:\s*(\d+)")[0]),
             device_kind=field(r'device_description_str:\s*"([^"]+)"')[0],
             compute_capability=(int(cc[0]), int(cc[1])), cudnn_version=int(dnn[0]) * 10000 + int(dnn[1]) * 100,
             sms=int(field(r"core_count:\s*(\d+)")[0]))
