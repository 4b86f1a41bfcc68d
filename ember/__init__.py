"""ember: JAX pretraining of decoder-only LLMs in low precision (FP8 / MXFP8 / NVFP4).

Floors, from the bottom up; each imports only itself and the floors listed before it (tests/test_structure.py):
  errors, keys, names,          leaves: user errors, config keys' declarations, the names everyone agrees
  xla_flags, native_output,     on, the XLA options ember needs, the native libraries' console lines (these
  hardware, platform, storage   three import no JAX), the GPUs' facts, the platform traced for, a workdir's
                                files (local or gs://)
  remat                         checkpoint names and remat presets
  quant                         pure-JAX quantization (formats, quantizers, the recipe table, VJPs)
  program                       a compiled step read: its kernels and traffic, roofline, predicted step, and
                                its compile with the scheduler told those predicted times
  parallel                      mesh, logical sharding rules, multi-process set-up
  config                        the config package: its defaults, load, validate, the typed sections
  layers, data, hf              the NNX model; the Grain input pipeline; the Hugging Face format
  trainer, inference            state, step, loss, loop, checkpoints, metrics; KV-cached generation
  plan                          trace, measure and compile a step; choose a remat policy
  tools                         command-line front ends
"""

import gc
from importlib import metadata

from ember import xla_flags as _xla_flags

_xla_flags.require()  # Before JAX starts a backend: the XLA options ember's numerics rely on.

try:
  __version__ = metadata.version("ember")
except metadata.PackageNotFoundError:  # A source tree that was never installed.
  __version__ = "0+unknown"


def collect_for_tracing() -> None:
  """Python's collector set for a process that traces steps (train.py, the tests). Tracing a step makes millions of
  short-lived objects, few of them in cycles, while the collector ran every 700 allocations and, now and then, over
  every object the imports made: a fifth of a step's lowering (CPU time). The objects made so far are set aside
  (the imports': they live as long as the process anyway) and the youngest generation is collected less often."""
  gc.freeze()
  gc.set_threshold(50_000, 20, 100)
