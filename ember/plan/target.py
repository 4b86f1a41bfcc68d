"""Named compile targets: `cpu` (the local devices) or `<gpu>x<count>`, a described GPU cluster.

A GPU is its XLA device spec in ember/hardware/ (`<gpu>.txtpb`: an XLA GpuTargetConfigProto in text
form: SM count, shared memory, memory size and bandwidth, clock, compute capability, cuDNN version) with
its row of peaks and link bandwidths there (`facts.toml`). JAX builds compile-only devices from it (`jax.experimental.topologies`), so the real train
step compiles through XLA's GPU pipeline on any machine with the CUDA plugin installed (no GPU, no
cuDNN, no CUDA toolkit): `h100x8` is one node of 8, `h100x16` two nodes of 8 (the mesh's `dcn_*` axes
span nodes). The process must not have initialised a CUDA backend: `JAX_PLATFORMS=cpu` (the tools set
it before importing JAX).

What a compile-only program can and cannot tell: its kernels, collectives and XLA's memory estimate
are those of the real program for the pinned `COMPILER_OPTIONS`; with no device there is no
autotuning (XLA would put an untuned Triton kernel on every GEMM, which is why Triton GEMMs are off:
cuBLAS / cuBLASLt then take them, FP8 ones included) and cuDNN's workspace is unknown, so memory
figures are estimates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re

import jax

from ember import hardware
from ember.errors import ConfigError, one_line
from ember.platform import on_platform
from ember.xla_flags import xla_flag_value

NODE_SIZE = 8  # GPUs per node: counts above it are whole nodes.

# XLA options every target compile uses (pinned: the census and memory figures depend on them).
# Triton GEMMs off: see the module doc. XLA's own rematerialisation pass off, as launch/xla_flags.sh has it for a
# run: the remat policy decides what is recomputed, and with the pass on a compile-only program recomputed values
# to hold a peak under a limit the run does not keep (llama3_8b fp8_current at 16 micro-batches of 8 on h100x8:
# 60.7 GiB with the pass, 62.9 GiB without it, as a run has it). The last two only change LLVM/PTX code
# generation (the optimised HLO is byte-identical) and cut the compile time by a third.
COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False, "xla_disable_hlo_passes": "rematerialization",
                    "xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}

# The share of a GPU's memory a run gives XLA's allocator: XLA_PYTHON_CLIENT_MEM_FRACTION as launch/xla_flags.sh
# sets it (or as the environment says), the rest left to NCCL and cuDNN workspaces. The planner's default budget.
RUN_MEMORY_FRACTION = 0.9
XLA_SCHEDULER_SHARE = 0.8  # What XLA's scheduler starts from when it knows no allocator: 80% of the GPU's memory.
XLA_SLOP_FACTOR = 95  # XLA's default --xla_gpu_memory_limit_slop_factor (percent).


def run_memory_fraction() -> float:
  """The share of each GPU's memory the run's allocator takes (`RUN_MEMORY_FRACTION` unless the environment sets
  XLA_PYTHON_CLIENT_MEM_FRACTION)."""
  return float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION") or RUN_MEMORY_FRACTION)


def scheduler_memory_options(memory_bytes: int, live_bytes: int) -> dict:
  """The compile option that gives a compile-only program the memory limit XLA's latency-hiding scheduler has in
  a run on the GPU. A run's jit hands XLA its allocator's limit (`run_memory_fraction` of `memory_bytes`), and
  the scheduler may then hold (that limit - the bytes live through the whole step) x the slop factor / 100
  before it delays collectives to save memory; a compile with no device starts from `XLA_SCHEDULER_SHARE` of the
  memory instead. On a step near its budget that smaller limit had the scheduler serialise the collectives a run
  overlaps: llama3_70b in the planner's pipeline layout on h100x64 (64.8 GiB peak, 14.9 GiB of state) waited
  3.0 s a step on its gradients' reduce-scatters (docs/performance.md, "The scheduler's memory limit").
  `live_bytes`: per device, the step's inputs and outputs (the train state, donated, counted once; the batch)."""
  slop = int(xla_flag_value(os.environ.get("XLA_FLAGS", ""), "--xla_gpu_memory_limit_slop_factor") or XLA_SLOP_FACTOR)
  run = run_memory_fraction() * memory_bytes - live_bytes
  compile_only = XLA_SCHEDULER_SHARE * memory_bytes - live_bytes
  if run <= 0 or compile_only <= 0:
    return {}
  return {"xla_gpu_memory_limit_slop_factor": round(slop * run / compile_only)}


@dataclasses.dataclass(frozen=True)
class Target:
  name: str  # As given: "cpu", "h100x8".
  gpu: str | None  # None: the local devices.
  count: int

  @property
  def is_gpu(self) -> bool:
    return self.gpu is not None

  @property
  def nodes(self) -> int:
    return max(self.count // NODE_SIZE, 1)

  @property
  def per_node(self) -> int:
    return self.count // self.nodes

  @property
  def gpu_spec(self) -> hardware.Gpu | None:
    """The GPU's spec and facts (ember/hardware/), None for `cpu`."""
    return hardware.gpu(self.gpu) if self.is_gpu else None

  @property
  def facts(self) -> hardware.DeviceFacts | None:
    """Peaks and link bandwidths (None for `cpu`)."""
    return self.gpu_spec.facts if self.is_gpu else None

  @property
  def hbm_bytes_per_s(self) -> float | None:
    return self.gpu_spec.hbm_bytes_per_s if self.is_gpu else None

  @property
  def device_memory_bytes(self) -> int | None:
    if not self.is_gpu:
      stats = jax.local_devices()[0].memory_stats() or {}
      return stats.get("bytes_limit")
    return self.gpu_spec.memory_bytes

  @property
  def device_kind(self) -> str:
    return self.gpu_spec.device_kind if self.is_gpu else jax.devices()[0].device_kind

  @property
  def compute_capability(self) -> tuple[int, int] | None:
    """The GPU's CUDA compute capability (major, minor) from its spec; None for `cpu`."""
    return self.gpu_spec.compute_capability if self.is_gpu else None

  def devices(self) -> list:
    """The target's devices: local ones for `cpu`, compile-only ones (node-major) for a GPU cluster."""
    if not self.is_gpu:
      return list(jax.devices())
    from jax.experimental import topologies
    try:
      topology = topologies.get_topology_desc(platform="cuda", target_config=self.gpu_spec.spec,
                                              topology=f"{self.nodes}x1x{self.per_node}")
    except Exception as e:  # No plugin, or a CUDA backend already initialised.
      raise ConfigError(f"--target: cannot describe {self.name} here ({one_line(e)}); install the CUDA plugin "
                        "(launch/install_compile_plugin.sh) and run with JAX_PLATFORMS=cpu") from None
    return sorted(topology.devices, key=lambda d: (d.process_index, d.id))


def parse(name: str) -> Target:
  """`cpu` or `<gpu>x<count>` (count 1..8, or a multiple of 8); ConfigError naming the choices otherwise."""
  if name == "cpu":
    return Target("cpu", None, jax.device_count())
  m = re.fullmatch(r"([a-z0-9]+)x(\d+)", name or "")
  if m is None or m.group(1) not in hardware.GPUS:
    raise ConfigError(f"--target: unknown target {name!r}; choose cpu or <gpu>x<count> with gpu in "
                      f"{', '.join(hardware.GPUS)} (e.g. h100x8)")
  count = int(m.group(2))
  if count < 1 or (count > NODE_SIZE and count % NODE_SIZE):
    raise ConfigError(f"--target: {name!r} has {count} GPUs; use 1 to {NODE_SIZE}, or whole nodes of {NODE_SIZE}")
  return Target(name, m.group(1), count)


def plugin_available() -> bool:
  """Whether the CUDA plugin that describes GPU targets is installed (the target tests skip without it).
  Never raises: `find_spec` of a submodule raises when its parent package (`jax_plugins`, which only a plugin
  installs) is missing."""
  import importlib.util
  try:
    return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
  except (ImportError, ValueError):
    return False


@contextlib.contextmanager
def targeting(target: Target):
  """Everything traced inside the block is traced for `target`: ember's own platform decisions
  (attention, MoE dispatch, block-scaled GEMMs: `ember.platform.on_platform`), and JAX's cuDNN attention checks, which otherwise
  ask the *default* backend (the CPU here) for the compute capability, so refuse what Hopper takes
  (head_dim 256), and ask libcudnn for its version, which a compile-only machine need not have (XLA
  compiles the cuDNN custom calls without it). Private JAX API: if it moves, JAX's checks stay as
  they are."""
  if not target.is_gpu:
    yield
    return
  with on_platform("gpu", target.compute_capability), _cudnn_checks_for(target):
    yield


@contextlib.contextmanager
def _cudnn_checks_for(target: Target):
  try:
    from jax._src.cudnn import fused_attention_stablehlo as fa
    saved = {k: getattr(fa, k) for k in ("check_compute_capability", "is_cuda_compute_capability_equal",
                                         "check_cudnn_version")}
  except (ImportError, AttributeError):
    yield
    return
  cc = target.compute_capability
  version = lambda c: tuple(int(x) for x in c.split("."))
  fa.check_compute_capability = lambda c: cc >= version(c)
  fa.is_cuda_compute_capability_equal = lambda c: cc == version(c)
  try:
    saved["check_cudnn_version"]()
  except Exception:  # No libcudnn on this machine: the version the spec compiles for.
    fa.check_cudnn_version = lambda: target.gpu_spec.cudnn_version
  try:
    yield
  finally:
    for k, v in saved.items():
      setattr(fa, k, v)
