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


def test_the_loop_pipelining_flags_a_step_can_switch_off_are_those_the_launch_file_sets():
  """launch/xla_flags.sh's own XLA_FLAGS (read from the script, loop pipelining on and off) name each flag
  `xla_flags.loop_pipelining_off` may switch off, and only under EMBER_LOOP_PIPELINING=1: a flag renamed in one
  place and not the other would leave a step compiled with what slows it. A run says which it switched off."""
  script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch", "xla_flags.sh")

  def sourced(pipelining: str) -> str:
    env = {"PATH": os.environ.get("PATH", ""), "EMBER_LOOP_PIPELINING": pipelining}
    return subprocess.run(["bash", "-c", f"source {script} && printf %s \"$XLA_FLAGS\""], env=env, text=True,
                          capture_output=True, check=True).stdout

  switched = set(xla_flags.loop_pipelining_off(scanned_layers=False, stages=8))
  assert switched >= set(xla_flags.loop_pipelining_off(scanned_layers=False, stages=1)) and switched
  for option in switched:
    assert xla_flags.xla_flag_value(sourced("1"), f"--{option}") == "true"
    assert xla_flags.xla_flag_value(sourced("0"), f"--{option}") is None
  assert xla_flags.loop_pipelining_off(scanned_layers=True, stages=1) == {}
  # What a run prints where it switches the file's flags off, and only there.
  assert xla_flags.loop_pipelining_note(sourced("1"), scanned_layers=False, stages=1) == (
      "note: the train step compiles with --xla_gpu_enable_pipelined_all_gather off, whatever XLA_FLAGS says (they "
      "slow a step of layers run one after another, model.scan_layers=false)")
  note = xla_flags.loop_pipelining_note(sourced("1"), scanned_layers=True, stages=4)
  assert all(f"{flag} " in note or f"{flag}," in note for flag in xla_flags.LOOP_PIPELINING)
  assert "(they slow a step over 4 pipeline stages)" in note
  assert xla_flags.loop_pipelining_note(sourced("0"), scanned_layers=False, stages=4) is None
  assert xla_flags.loop_pipelining_note(sourced("1"), scanned_layers=True, stages=1) is None


def test_a_steps_default_options_yield_to_xla_flags():
  """xla_flags.STEP_DEFAULTS go into a step's compile unless XLA_FLAGS sets the option, either way."""
  option = "xla_gpu_enable_dus_accumulator_zero_init_elimination"
  assert xla_flags.step_defaults("") == xla_flags.STEP_DEFAULTS and xla_flags.STEP_DEFAULTS[option] is True
  assert xla_flags.step_defaults(f"--xla_gpu_enable_latency_hiding_scheduler=true --{option}=false") == {}
  assert option in xla_flags.step_defaults(f"--{option}_not=false")
  # And a step asks whether its XLA has the option before taking it: an older one fails the compile over it.
  assert platform.knows_compile_option(option, True)
  assert not platform.knows_compile_option("xla_gpu_an_option_no_xla_has", True)


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
