"""The XLA options ember's numerics and recipes rely on (`REQUIRED_XLA_FLAGS`), and the one rule for adding flags to
XLA_FLAGS: `import ember` adds these before JAX starts a backend (platform.divides_exactly checks on a device that
they took effect). Also the options a train step compiles with where XLA_FLAGS leaves them unset
(`step_defaults`), and the launch file's loop-pipelining flags a train step switches off where they cost it
(`loop_pipelining_off`). Standard library only: importing it does not import JAX.
"""

from __future__ import annotations

import os

_EXTRA_OPTIONS = "--xla_backend_extra_options"  # A comma-separated map of LLVM options: merged key by key.
REQUIRED_XLA_FLAGS = {
    # Float32 division rounded as IEEE says (PTX div.rn.f32). XLA's GPU default, div.full.f32, is up to 2 ulp off:
    # on an H100 it gave 29% of 2688 / amax and 57% of x / s one ulp away, and 4% of an NVFP4 tensor's E2M1
    # codes differed from the rules docs/quantization.md states (which the CPU and the Pallas kernels follow).
    _EXTRA_OPTIONS: "-nvptx-prec-divf32=2",
    # GEMMs, FP8 ones included, to cuBLAS(Lt). With XLA's Triton GEMMs on, an H100 ran fp8_current's step with
    # no FP8 GEMM at all (the `fp8_gemms` count of ember.tools.bench was 0), slower than bf16.
    "--xla_gpu_enable_triton_gemm": "false",
    # No two dots that share an operand merged into one. A step reads each kernel's quantized copies made once
    # (layers/linear.py's `once_a_step`), so a 1F1B tick's forward GEMM and the remat of another micro-batch's
    # share their kernel; merged, their rows carry two scales and XLA ran the one GEMM in bf16 (tiny, data 2 x
    # tensor 2 x 2 stages, remat `full`: 3 of the projections' GEMMs). XLA merges up to 32 MB by default.
    "--xla_gpu_dot_merger_threshold_mb": "0",
}


def with_required_xla_flags(xla_flags: str) -> str:
  """`xla_flags` (an XLA_FLAGS value) with each of REQUIRED_XLA_FLAGS added that it does not set itself
  (`with_xla_flags`)."""
  return with_xla_flags(xla_flags, REQUIRED_XLA_FLAGS)


def with_xla_flags(xla_flags: str, wanted: dict[str, str]) -> str:
  """`xla_flags` (an XLA_FLAGS value) with each flag of `wanted` ({flag: value}) added that it does not set itself,
  as a flag of its own after the user's (XLA merges repeated --xla_backend_extra_options into one map): a value the
  user set wins, and the user's tokens are never edited. A value that is not flags (XLA reads one that does not
  start with '-' as a file of flags) is left as it is."""
  if xla_flags.strip() and not xla_flags.lstrip().startswith("-"):
    return xla_flags
  tokens = xla_flags.split()
  for flag, value in wanted.items():
    given = [t for t in tokens if t.split("=", 1)[0] == flag]
    key = value.split("=")[0] if flag == _EXTRA_OPTIONS else None  # An LLVM option: the user's own key wins.
    if not given or (key is not None and not any(key in t for t in given)):
      tokens.append(f"{flag}={value}")
  return " ".join(tokens)


def xla_flag_value(xla_flags: str, flag: str) -> str | None:
  """The value `xla_flags` (an XLA_FLAGS value) gives `flag` (its last, as XLA reads them), or None."""
  given = [t.split("=", 1)[1] for t in xla_flags.split() if t.split("=", 1)[0] == flag and "=" in t]
  return given[-1] if given else None


def user_xla_flags(xla_flags: str) -> list[str]:
  """The flags of `xla_flags` (an XLA_FLAGS value) that are not REQUIRED_XLA_FLAGS: those a user or
  launch/xla_flags.sh chose, which a compile for a target and the run it plans should share."""
  return [t for t in xla_flags.split() if t.split("=", 1)[0] not in REQUIRED_XLA_FLAGS]


# XLA options a train step compiles with on GPUs unless XLA_FLAGS sets them itself (`step_defaults`).
STEP_DEFAULTS = {
    # A loop's stacked outputs (scanned layers' saved activations, their weights' gradients) are written a slot an
    # iteration, every slot before any read of it, yet XLA zeroes each whole buffer ahead of the loop. This pass
    # proves the cover and allocates the buffer unwritten instead. llama3_8b, `full`, scanned, batch 8 on h100x8
    # (no XLA_FLAGS): 5.6 GB a step of writes gone, floor -1.7 ms, predicted -1.1 ms (bf16) and -1.7 ms
    # (fp8_delayed); unrolled layers gain 0.02 ms. Under launch/xla_flags.sh it drops none (its loop-pipelining
    # flags rewrite those loops first), and nothing changes.
    "xla_gpu_enable_dus_accumulator_zero_init_elimination": True,
}


def step_defaults(xla_flags: str) -> dict[str, bool]:
  """STEP_DEFAULTS less each option `xla_flags` (an XLA_FLAGS value) sets: a value the user set wins."""
  return {option: value for option, value in STEP_DEFAULTS.items() if xla_flag_value(xla_flags, f"--{option}") is None}


# launch/xla_flags.sh's loop-pipelining flags (EMBER_LOOP_PIPELINING=0 leaves them out).
LOOP_PIPELINING = ("--xla_gpu_enable_pipelined_all_gather", "--xla_gpu_enable_pipelined_reduce_scatter",
                   "--xla_gpu_enable_pipelined_all_reduce", "--xla_gpu_enable_while_loop_double_buffering")


def loop_pipelining_off(scanned_layers: bool, stages: int) -> dict[str, bool]:
  """The XLA options a train step's compile takes ({option: False}) to switch off the loop-pipelining flags where
  they cost that step, whatever XLA_FLAGS says; {} where they pay. Compiled for described H100s
  (docs/performance.md, "XLA's scheduling flags, layout by layout"):
  - pipeline stages: all four slow the step and raise its peak (llama3_70b's planned layout: 80.97 GiB, not 63.90);
  - layers one after another (not scanned): a pipelined all-gather has XLA run each micro-batch's forward GEMMs
    twice (llama3_8b's preset at 16 micro-batches of 8 on 8 H100s, under the file: 1.66x the model's FLOPs and
    97.49 GiB, not 1.00x and 51.73 GiB);
  - scanned layers in one stage: they take 2.4-2.8% off the step (a layer's gathers overlap the layer before)."""
  if stages > 1:
    return {flag.removeprefix("--"): False for flag in LOOP_PIPELINING}
  if not scanned_layers:
    return {LOOP_PIPELINING[0].removeprefix("--"): False}
  return {}


def loop_pipelining_note(xla_flags: str, scanned_layers: bool, stages: int) -> str | None:
  """The line a run prints where its step switches off flags `xla_flags` (an XLA_FLAGS value) turns on
  (`loop_pipelining_off`), or None."""
  off = [f"--{o}" for o in loop_pipelining_off(scanned_layers, stages) if xla_flag_value(xla_flags, f"--{o}") == "true"]
  if not off:
    return None
  why = f"over {stages} pipeline stages" if stages > 1 else "of layers run one after another, model.scan_layers=false"
  return f"note: the train step compiles with {', '.join(off)} off, whatever XLA_FLAGS says (they slow a step {why})"


def require() -> None:
  """Adds REQUIRED_XLA_FLAGS to the environment's XLA_FLAGS (`import ember` does it). XLA reads them when JAX
  starts a backend: a process whose backend started before ember was imported keeps its own, which
  `divides_exactly` reveals."""
  os.environ["XLA_FLAGS"] = with_required_xla_flags(os.environ.get("XLA_FLAGS", ""))
