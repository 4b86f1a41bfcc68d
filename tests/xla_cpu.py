"""The XLA options of the tests' CPU programs, in one place: conftest.py sets them for the session, and the tests
that start processes of their own (train.py, launch/local.sh) hand them on.

The tests' programs are small: their compiles, not their runs, take the time. LLVM's cheaper code generation (no
fast-math either way, so the same floating-point results) compiles them in about 60% of the time."""

FAST_CPU_CODEGEN = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def cpu_xla_flags(devices: int) -> str:
  """XLA_FLAGS for a process of `devices` virtual CPU devices."""
  return f"{FAST_CPU_CODEGEN} --xla_force_host_platform_device_count={devices}"
