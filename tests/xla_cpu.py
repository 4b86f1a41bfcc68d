"""The XLA options of the tests' CPU programs, in one place: conftest.py sets them for the session, and the tests
that start processes of their own (train.py, launch/local.sh) hand them on.

The tests' programs are small: their compiles, not their runs, take the time. LLVM's cheaper code generation (no
fast-math either way) compiles them in about 60% of the time, and XLA's older elemental emitters in place of its
MLIR fusion emitters in about 40% of what is left (a tiny train step: 5.9 s, 3.3 s, 1.3 s)."""

FAST_CPU_CODEGEN = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                    "--xla_cpu_use_fusion_emitters=false")

# The elemental emitters round a float32 -> E2M1 cast twice, through a narrower float (0.7499999 becomes 1.0, not
# 0.5), which XLA's CPU defaults and its GPU compiler do not: the tests of a cast's exact bytes compile with the
# fusion emitters (`jax.jit(f, compiler_options=EXACT_FP4_CASTS)`). A reference that runs op by op keeps each op's
# rounding when it is jitted whole: add `"xla_allow_excess_precision": False`.
EXACT_FP4_CASTS = {"xla_cpu_use_fusion_emitters": True}


def recipe_options(recipes) -> dict:
  """The per-compile options of a program running `recipes` (names): with E2M1 data (nvfp4), the fusion emitters,
  which round its casts once as the GPU compiler does, and which lower the bitcasts between E2M1 and uint4 that name
  its residuals for a remat policy (the elemental emitters, fusing such a bitcast with the cast, emit an LLVM
  bitcast from i8 to i4 that LLVM's verifier rejects)."""
  return EXACT_FP4_CASTS if "nvfp4" in set(recipes) else {}


def step_options(cfg) -> dict:
  """`recipe_options` of a step of settings `cfg`: its precision phases' recipes."""
  return recipe_options(recipe.name for _, recipe in cfg.phases)


# The programs compiled for described GPUs (tests/plan) are read, never run: ptxas, a third of their compile, skips
# its optimisations (the HLO, the buffers and the time floor do not depend on them).
FAST_GPU_CODEGEN = "--xla_gpu_disable_gpuasm_optimizations=true"


def cpu_xla_flags(devices: int) -> str:
  """XLA_FLAGS for a process of `devices` virtual CPU devices."""
  return f"{FAST_CPU_CODEGEN} {FAST_GPU_CODEGEN} --xla_force_host_platform_device_count={devices}"
