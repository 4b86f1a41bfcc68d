"""The platform the code being traced will run on, and for a GPU its compute capability: what attention
(cuDNN or not), the MoE exchange and the block-scaled GEMM path (quant/gemm.py) are chosen by; and how many
devices the traced program is partitioned over (`traced_device_count`: a kernel that shards by whole blocks
checks that its operands split evenly, quant/fused.py).

A compile for a described GPU cluster traces on the CPU backend, so JAX's default backend is not the
answer: `on_platform` names the platform outright (ember/plan/target.py), `on_device` takes it from a
mesh's devices (compile-only devices of a described GPU included; `parallel.sharding.use_rules` enters
it), and JAX's default device answers otherwise. An outright `on_platform` wins over any `on_device`
inside it.

`divides_exactly` checks on a device that the XLA options ember's numerics rely on (ember/xla_flags.py) took
effect; `knows_compile_option` whether this JAX's XLA has an option at all.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import numpy as np

# (platform, compute capability or None, named outright?)
_TARGET: contextvars.ContextVar[tuple[str, tuple[int, int] | None, bool] | None] = contextvars.ContextVar(
    "ember_target", default=None)
_DEVICE_COUNT: contextvars.ContextVar[int] = contextvars.ContextVar("ember_device_count", default=1)


@contextlib.contextmanager
def _set(target):
  token = _TARGET.set(target)
  try:
    yield
  finally:
    _TARGET.reset(token)


def on_platform(platform: str, compute_capability: tuple[int, int] | None = None):
  """Traces inside the block as for `platform` ("gpu", "cpu", ...) and, for a GPU, its CUDA compute
  capability, whatever the mesh or backend."""
  return _set((_normalized(platform), compute_capability, True))


def on_device(device):
  """Traces inside the block as for `device`'s platform, unless an `on_platform` block already named one."""
  current = _TARGET.get()
  if current is not None and current[2]:
    return contextlib.nullcontext()
  return _set(_describe(device) + (False,))


@contextlib.contextmanager
def over_devices(count: int):
  """Traces inside the block for a program partitioned over `count` devices (a mesh's size)."""
  token = _DEVICE_COUNT.set(count)
  try:
    yield
  finally:
    _DEVICE_COUNT.reset(token)


def traced_device_count() -> int:
  """The devices the program traced now is partitioned over: the active mesh's size, 1 outside one."""
  return _DEVICE_COUNT.get()


def target_platform() -> str:
  """"gpu" (CUDA and ROCm), "cpu", ...: see the module doc."""
  return _current()[0]


def target_compute_capability() -> tuple[int, int] | None:
  """(major, minor) of the target GPU; None for other platforms."""
  platform, cc = _current()
  return cc if platform == "gpu" else None


def _current() -> tuple[str, tuple[int, int] | None]:
  target = _TARGET.get()
  return target[:2] if target is not None else _describe(jax.devices()[0])


def _describe(device) -> tuple[str, tuple[int, int] | None]:
  cc = getattr(device, "compute_capability", None)
  return _normalized(device.platform), (tuple(int(v) for v in str(cc).split(".")[:2]) if cc else None)


def _normalized(platform: str) -> str:
  return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


def divides_exactly(device) -> bool:
  """Whether float32 division compiled for `device` rounds as IEEE says: quotients that div.full.f32 (XLA's GPU
  default without REQUIRED_XLA_FLAGS) gets one ulp wrong in about half the cases, against NumPy's."""
  a, b = np.random.default_rng(0).uniform(0.1, 10.0, (2, 4096)).astype(np.float32)
  got = jax.jit(lambda x, y: x / y)(jax.device_put(a, device), jax.device_put(b, device))
  return bool(np.array_equal(np.asarray(got), a / b))


@functools.cache
def knows_compile_option(option: str, value) -> bool:
  """Whether this JAX's XLA takes the compile option `option` (set to `value`): a jit handed an option its XLA
  does not have fails to compile ("No such compile option"), and ember's step defaults (xla_flags.STEP_DEFAULTS)
  are newer than some JAX releases ember installs with. Asked by compiling the identity on the default backend:
  every XLA backend reads the same table of options."""
  try:
    jax.jit(lambda x: x, compiler_options={option: value}).lower(np.float32(0)).compile()
  except jax.errors.JaxRuntimeError as e:
    if "No such compile option" in str(e):
      return False
    raise
  return True
