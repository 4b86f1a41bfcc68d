"""The XLA options ember relies on (ember/xla_flags.py): added to XLA_FLAGS by `import ember` unless the user set
them, merged into a user's own --xla_backend_extra_options, accepted by the CPU backend; and the division probe."""

import os
import subprocess
import sys

import jax
import numpy as np

from ember import platform, xla_flags

DIV = "--xla_backend_extra_options=-nvptx-prec-divf32=2"


def test_required_flags_are_added_once_and_a_users_own_value_wins():
  rest = "--xla_gpu_enable_triton_gemm=false --xla_gpu_dot_merger_threshold_mb=0"
  assert xla_flags.with_required_xla_flags("") == f"{DIV} {rest}"
  assert xla_flags.with_required_xla_flags(xla_flags.with_required_xla_flags("--a=1")) == f"--a=1 {DIV} {rest}"
  mine = ("--xla_gpu_enable_triton_gemm=true --xla_backend_extra_options=-nvptx-prec-divf32=1 "
          "--xla_gpu_dot_merger_threshold_mb=32")
  assert xla_flags.with_required_xla_flags(mine) == mine
  # The user's own division option wins wherever it is; their tokens are never edited (XLA merges repeated
  # --xla_backend_extra_options into one map), quoted ones included.
  twice = "--xla_backend_extra_options=-nvptx-prec-divf32=1 --xla_backend_extra_options=-x"
  assert xla_flags.with_required_xla_flags(twice) == f"{twice} {rest}"
  quoted = '--xla_backend_extra_options="-x=1"'
  assert xla_flags.with_required_xla_flags(quoted) == f"{quoted} {DIV} {rest}"
  assert xla_flags.with_required_xla_flags("/etc/xla.flags") == "/etc/xla.flags"  # A file of flags: XLA's to read.


def test_importing_ember_sets_them_before_a_backend_starts_and_the_cpu_accepts_them():
  code = ("import os, ember, jax, jax.numpy as jnp; print(os.environ['XLA_FLAGS']); "
          "print(float(jax.jit(lambda a: a / 3)(jnp.float32(1))))")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  out = subprocess.run([sys.executable, "-c", code], env=dict(env, JAX_PLATFORMS="cpu"), capture_output=True,
                       text=True, check=True, timeout=120).stdout.splitlines()
  assert out[0] == xla_flags.with_required_xla_flags("") and float(out[1]) == float(np.float32(1) / np.float32(3))


def test_the_cpu_divides_exactly():
  assert platform.divides_exactly(jax.devices()[0])


def test_a_pipeline_under_the_loop_pipelining_flags_is_warned_about():
  """launch/xla_flags.sh's own XLA_FLAGS (read from the script, loop pipelining on and off) against a pipelined
  mesh and a mesh without stages."""
  script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch", "xla_flags.sh")

  def sourced(pipelining: str) -> str:
    env = {"PATH": os.environ.get("PATH", ""), "EMBER_LOOP_PIPELINING": pipelining}
    return subprocess.run(["bash", "-c", f"source {script} && printf %s \"$XLA_FLAGS\""], env=env, text=True,
                          capture_output=True, check=True).stdout

  warning = xla_flags.pipeline_flags_warning(sourced("1"), 8)
  assert warning.startswith("warning: 8 pipeline stages under XLA_FLAGS' loop-pipelining flags "
                            "(--xla_gpu_enable_pipelined_all_gather,") and "EMBER_LOOP_PIPELINING=0" in warning
  assert xla_flags.pipeline_flags_warning(sourced("0"), 8) is None
  assert xla_flags.pipeline_flags_warning(sourced("1"), 1) is None


def test_warnings_are_process_zeros_whichever_launcher_started_it(monkeypatch, capsys):
  """Under SLURM (no EMBER_PROCESS_ID) only task 0 warns; once the job is joined JAX's index decides."""
  from ember import errors
  monkeypatch.setattr(errors, "_process_index", None)
  monkeypatch.delenv("EMBER_PROCESS_ID", raising=False)
  monkeypatch.setenv("SLURM_PROCID", "3")
  errors.warn("from task 3")
  errors.note_process_index(0)  # JAX's index wins over the variables.
  errors.warn("from process 0")
  errors.note_process_index(2)
  errors.warn("from process 2")
  assert capsys.readouterr().err == "warning: from process 0\n"
