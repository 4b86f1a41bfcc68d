"""End-to-end checkpointing: `python train.py` in subprocesses, killed, preempted, resumed, resharded.

Every run is the tiny model on synthetic data (1 layer, 16 tokens, batch 8, bf16 unless a test
names a recipe) with a fixed LR schedule (`train.decay_steps`), so a run's losses do not depend on `steps`. Reference runs are
made once per session and shared between xdist workers (file lock); compiled programs are shared
through JAX's persistent compilation cache.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.xla_cpu import cpu_xla_flags

ROOT = Path(__file__).resolve().parents[2]
BASE = ["--config=configs/default.py:tiny", "--config.model.num_layers=1", "--config.model.seq_len=16",
        "--config.train.batch_size=8", "--config.data.source=synthetic", "--config.train.eval_every_steps=0",
        "--config.log.every_steps=1", "--config.log.tensorboard=false", "--config.checkpoint.every_steps=5",
        "--config.train.decay_steps=100"]
F32 = ["--config.model.dtype=float32"]

# One worker runs this module (`--dist loadgroup`): its tests share module-scoped state.
pytestmark = pytest.mark.xdist_group("test_checkpoint_e2e")


@pytest.fixture(scope="session")
def shared(tmp_path_factory) -> Path:
  """A directory shared by all xdist workers of this session (each worker's basetemp's parent)."""
  base = tmp_path_factory.getbasetemp()
  root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "ember_ckpt_shared"
  root.mkdir(exist_ok=True)
  return root


def _env(shared: Path, devices: int) -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_xla_flags(devices),
             JAX_COMPILATION_CACHE_DIR=str(shared / "jax_cache"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  env.pop("EMBER_COORDINATOR_ADDRESS", None)
  return env


def _cmd(workdir: Path, steps: int, extra) -> list[str]:
  recipe = [] if any(a.startswith("--config.quant.recipe=") for a in extra) else ["--config.quant.recipe=bf16"]
  return [sys.executable, "train.py", *BASE, *recipe, f"--config.workdir={workdir}", f"--config.steps={steps}", *extra]


def train(shared, workdir, steps, *extra, devices=8, expect_rc=0) -> subprocess.CompletedProcess:
  p = subprocess.run(_cmd(workdir, steps, extra), cwd=ROOT, env=_env(shared, devices), capture_output=True,
                     text=True, timeout=300)
  assert p.returncode == expect_rc, f"exit {p.returncode}\n{p.stderr[-3000:]}"
  return p


def start(shared, workdir, steps, *extra, devices=8) -> subprocess.Popen:
  return subprocess.Popen(_cmd(workdir, steps, extra), cwd=ROOT, env=_env(shared, devices),
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def records(workdir) -> list[dict]:
  path = Path(workdir) / "metrics.jsonl"
  return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def losses(workdir) -> dict[int, float]:
  return {r["step"]: r["loss"] for r in records(workdir) if "loss" in r}


def wait_for_step(proc, workdir, step, timeout=240.0) -> None:
  deadline = time.time() + timeout
  while time.time() < deadline:
    try:
      if any(r.get("step", 0) >= step for r in records(workdir)):
        return
    except json.JSONDecodeError:  # A line being written.
      pass
    assert proc.poll() is None, f"the run ended before step {step}:\n{proc.stderr.read()[-3000:]}"
    time.sleep(0.005)
  raise AssertionError(f"no step {step} in {timeout}s")


def checkpoint_steps(workdir) -> list[int]:
  d = Path(workdir) / "checkpoints"
  return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.exists() else []


def shared_run(shared: Path, name: str, make) -> Path:
  """`make(workdir)` once per session across workers; returns the workdir."""
  workdir = shared / name
  with open(shared / f"{name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not (workdir / "DONE").exists():
      shutil.rmtree(workdir, ignore_errors=True)
      make(workdir)
      (workdir / "DONE").touch()
  return workdir


def reference(shared, recipe: str) -> Path:
  """An uninterrupted 20-step run (checkpoints 10, 15, 20 kept)."""
  return shared_run(shared, f"ref_{recipe}", lambda w: train(shared, w, 20, f"--config.quant.recipe={recipe}"))


def copy_run(src: Path, dst: Path) -> Path:
  shutil.copytree(src, dst, ignore=shutil.ignore_patterns("DONE"))
  return dst


def assert_steps_once(workdir, last: int) -> None:
  steps = [r["step"] for r in records(workdir)]
  assert steps == list(range(1, last + 1)), steps


# --- Resume after SIGKILL -------------------------------------------------------------------


@pytest.mark.parametrize("recipe", ["bf16", pytest.param("fp8_delayed", marks=pytest.mark.extended)])
@pytest.mark.long
def test_sigkill_then_resume_logs_the_uninterrupted_losses(shared, tmp_path, recipe):
  ref = losses(reference(shared, recipe))
  run = tmp_path / "run"
  proc = start(shared, run, 20, f"--config.quant.recipe={recipe}")
  wait_for_step(proc, run, 12)
  proc.kill()
  proc.wait(timeout=60)
  proc.stderr.close()
  saved = checkpoint_steps(run)  # 10 (or 15, or 5 if the kill caught the save of 10 in flight).
  assert saved and max(losses(run)) > saved[-1]  # Records past the checkpoint exist and must go.
  # A kill in the middle of an asynchronous save leaves a temporary directory, never renamed. If
  # this kill did not land in one, make what it would have left (half a step).
  partial = run / "checkpoints" / f"{saved[-1] + 5}.orbax-checkpoint-tmp"
  if not partial.exists():
    shutil.copytree(run / "checkpoints" / str(saved[-1]) / "state", partial / "state")

  p = train(shared, run, 20, f"--config.quant.recipe={recipe}")
  assert f"resumed from {run / 'checkpoints'} at step {saved[-1]}" in p.stderr
  assert_steps_once(run, 20)
  got = losses(run)
  assert [got[s] for s in range(11, 21)] == [ref[s] for s in range(11, 21)]  # Bitwise.
  assert not partial.exists()
  assert checkpoint_steps(run)[-1] == 20


@pytest.mark.extended
def test_muon_bfloat16_state_and_router_bias_resume_bitwise(shared, tmp_path):
  """Muon's momentum and AdamW's moments stored in bfloat16, and an MoE's router biases, come back from a
  checkpoint exactly: a run stopped at step 15 and resumed logs the uninterrupted run's losses and loads."""
  extra = ("--config.train.optimizer=muon", "--config.train.optimizer_state_dtype=bfloat16",
           "--config.model.num_experts=4", "--config.model.router_bias_update_rate=0.01")
  ref_dir = shared_run(shared, "ref_muon", lambda w: train(shared, w, 20, *extra))
  run = tmp_path / "run"
  train(shared, run, 15, *extra)
  p = train(shared, run, 20, *extra)
  assert "at step 15" in p.stderr
  got, ref = records(run), records(ref_dir)
  for key in ("loss", "moe_load_max_over_mean"):
    assert [r[key] for r in got[15:20]] == [r[key] for r in ref[15:20]], key
  assert ref[19]["loss"] < ref[0]["loss"]


# --- Preemption -----------------------------------------------------------------------------------


# A preemption notice (exiting as launch/jobset.yaml asks, 143: a Kubernetes Job takes 0 for done), and Ctrl-C in a
# terminal (the default status, 0).
@pytest.mark.parametrize("notice,status", [("SIGTERM", 143), ("SIGINT", 0)])
@pytest.mark.long
def test_sigterm_saves_synchronously_exits_as_asked_and_resumes(shared, tmp_path, notice, status):
  ref = losses(reference(shared, "bf16"))
  run = tmp_path / "run"
  proc = start(shared, run, 1000, *([f"--config.train.preempted_exit_status={status}"] if status else []))
  wait_for_step(proc, run, 3)
  proc.send_signal(getattr(signal, notice))
  _, stderr = proc.communicate(timeout=120)
  assert proc.returncode == status, stderr[-3000:]
  assert "Traceback" not in stderr, stderr[-3000:]
  stopped = max(losses(run))
  assert stopped < 1000
  assert f"preempted ({notice}): saved a checkpoint at step {stopped}" in stderr
  assert checkpoint_steps(run)[-1] == stopped
  assert not list((run / "checkpoints").glob("*tmp*"))  # The save completed before the exit.

  p = train(shared, run, stopped + 2)
  assert f"at step {stopped}" in p.stderr
  assert_steps_once(run, stopped + 2)
  got = losses(run)
  assert all(got[s] == ref[s] for s in got if s <= 20)


# --- A damaged checkpoint ---------------------------------------------------------------------------


# Each kind of file of a step, by its path under the step (the array chunk: the largest file OCDBT wrote).
DAMAGED_FILES = {
    "array chunk": "state/ocdbt.process_0/d/*", "OCDBT manifest": "state/manifest.ocdbt",
    "array metadata": "state/array_metadatas/process_0", "tree metadata": "state/_METADATA",
    "shardings": "state/_sharding", "rng": "rng/metadata", "data position": "data/process_0-of-1.json",
    "fingerprints": "fingerprints/metadata",
    "data position, deleted": "data/process_0-of-1.json",  # The file gone, not damaged: the step is incomplete.
}


# With --long, one file of each reader that meets the damage: the array chunk and the fingerprints (the fingerprint
# check), the OCDBT manifest (Orbax's state reader), the rng (the seed check's JSON), the data position (Grain's), a
# deleted file (an incomplete step). The state's other files, which Orbax's state reader meets as it meets the
# manifest, are extended cases.
READ_AS_ANOTHER = ("array metadata", "tree metadata", "shardings")


@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.extended) if k in READ_AS_ANOTHER else k
                                  for k in DAMAGED_FILES])
@pytest.mark.variants
def test_a_damaged_newest_checkpoint_is_one_warning_and_the_previous_one(shared, tmp_path, kind):
  """100 random bytes in the middle of one file of step 20 (as a bad disk or a truncated copy would leave it):
  the resumed run says so in one warning line, moves the step aside, resumes from step 15 and logs what the
  uninterrupted run logged; nothing of the failed restore reaches stderr. Random bytes inside an array chunk
  restore without an error: the arrays' fingerprints catch them (ember/trainer/integrity.py)."""
  ref_dir = reference(shared, "bf16")
  run = copy_run(ref_dir, tmp_path / "run")
  assert checkpoint_steps(run) == [10, 15, 20]
  target = max((run / "checkpoints" / "20").glob(DAMAGED_FILES[kind]), key=lambda f: f.stat().st_size)
  data = bytearray(target.read_bytes())
  middle = max(len(data) // 2 - 50, 0)
  data[middle:middle + 100] = random.Random(0).randbytes(min(100, len(data)))
  if kind.endswith("deleted"):
    target.unlink()
  else:
    target.write_bytes(bytes(data))

  p = train(shared, run, 20)
  warnings = [line for line in p.stderr.splitlines() if "warning: skipping checkpoint step 20" in line]
  assert len(warnings) == 1 and "moved it to 20.corrupt" in warnings[0], p.stderr[-3000:]
  assert "Traceback" not in p.stderr and "Exception ignored" not in p.stderr, p.stderr[-3000:]
  assert "resumed from" in p.stderr and "at step 15" in p.stderr
  assert_steps_once(run, 20)
  ref, got = losses(ref_dir), losses(run)
  assert [got[s] for s in range(16, 21)] == [ref[s] for s in range(16, 21)]
  assert (run / "checkpoints" / "20.corrupt").is_dir() and checkpoint_steps(run)[-1] == 20


def test_starting_from_a_damaged_checkpoint_is_one_line_exit_2(shared, tmp_path):
  """`checkpoint.restore_from` names one step: damaged, it is an error (exit 2, one line), not a fallback."""
  source = copy_run(reference(shared, "bf16"), tmp_path / "source")
  chunk = max((source / "checkpoints" / "20").glob(DAMAGED_FILES["array chunk"]), key=lambda f: f.stat().st_size)
  data = bytearray(chunk.read_bytes())
  data[len(data) // 2:len(data) // 2 + 100] = random.Random(0).randbytes(100)
  chunk.write_bytes(bytes(data))
  p = train(shared, tmp_path / "run", 22, f"--config.checkpoint.restore_from={source}/checkpoints/20", expect_rc=2)
  last = p.stderr.strip().splitlines()[-1]
  # The bytes land in stored data (caught by the fingerprint) or in a chunk's encoding (caught by the reader):
  # which one depends on the file's layout, and either way it is the one line naming the key.
  assert last.startswith("error: config.checkpoint.restore_from:") and (
      "does not match the fingerprint saved with it" in last or "damaged (" in last), last
  assert "Traceback" not in p.stderr


# --- Starting from another run's checkpoint -------------------------------------------------------------------


def test_restore_from_full_state_continues_that_run(shared, tmp_path):
  ref_dir = reference(shared, "bf16")
  run = tmp_path / "run"
  p = train(shared, run, 12, f"--config.checkpoint.restore_from={ref_dir / 'checkpoints' / '10'}")
  assert "started from" in p.stderr
  ref, got = losses(ref_dir), losses(run)
  assert sorted(got) == [11, 12]
  assert [got[11], got[12]] == [ref[11], ref[12]]  # Same state, same data position: bitwise.



@pytest.mark.long
def test_restore_from_a_step_past_a_precision_switch_continues_that_run(shared, tmp_path):
  """fp8_current, then fp8_delayed from step 6 on (the state gains amax histories): a new run of the same config
  started from step 10 takes that step's state as its phase has it and logs what the first run logged after it.
  (It was read as phase 0's state: one false line, exit 2.)"""
  switch = ["--config.quant.recipe=fp8_current", "--config.quant.schedule=((5, {'recipe': 'fp8_delayed'}),)"]
  ref_dir = shared_run(shared, "ref_switch", lambda w: train(shared, w, 20, *switch))
  run = tmp_path / "run"
  p = train(shared, run, 12, *switch, f"--config.checkpoint.restore_from={ref_dir / 'checkpoints' / '10'}")
  assert "started from" in p.stderr
  ref, got = losses(ref_dir), losses(run)
  assert sorted(got) == [11, 12] and [got[11], got[12]] == [ref[11], ref[12]]

def test_restore_from_params_only_starts_at_step_zero(shared, tmp_path):
  ref_dir = reference(shared, "bf16")
  run = tmp_path / "run"
  p = train(shared, run, 2, f"--config.checkpoint.restore_from={ref_dir}", "--config.checkpoint.params_only=true")
  assert "started from the parameters of" in p.stderr
  ref, got = losses(ref_dir), losses(run)
  assert sorted(got) == [1, 2]
  # Trained parameters on the first batch: well below a fresh model's loss, and not the full-state run's.
  assert got[1] < ref[1] - 0.05
  assert got[1] != ref[11] and got[2] != ref[12]


def _one_line_error(p: subprocess.CompletedProcess) -> str:
  lines = [l for l in p.stderr.splitlines() if l.strip()]
  assert len(lines) == 1, p.stderr[-3000:]
  assert lines[0].startswith("error: ") and "Traceback" not in p.stderr
  return lines[0]


def test_restore_from_with_other_shapes_fails_in_one_line(shared, tmp_path):
  ref_dir = reference(shared, "bf16")
  p = train(shared, tmp_path / "run", 2, f"--config.checkpoint.restore_from={ref_dir}", "--config.model.d_ff=64",
            expect_rc=2)
  line = _one_line_error(p)
  assert "config.checkpoint.restore_from" in line and "parameter " in line and "mlp/wi" in line
  assert "(1, 64, 2, 128)" in line and "(1, 64, 2, 64)" in line


def test_resume_with_other_shapes_fails_in_one_line_and_keeps_the_checkpoints(shared, tmp_path):
  run = copy_run(reference(shared, "bf16"), tmp_path / "run")
  p = train(shared, run, 25, "--config.model.d_model=32", expect_rc=2)
  line = _one_line_error(p)
  assert "checkpoints/20" in line and "parameter " in line and "has shape" in line
  assert checkpoint_steps(run) == [10, 15, 20]  # Nothing skipped, renamed or overwritten.
  assert max(losses(run)) == 20


# --- Resharding -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mesh,devices", [pytest.param(("data=2", "fsdp=2", "tensor=2"), 8, id="data2_fsdp2_tensor2", marks=pytest.mark.extended),
                                        pytest.param(("data=2", "fsdp=4"), 8, id="data2_fsdp4"),
                                        pytest.param(("fsdp=4",), 4, id="4_devices")])
@pytest.mark.long
def test_checkpoint_restores_onto_another_mesh(shared, tmp_path, mesh, devices):
  """data 2: the optimizer state saved whole on each FSDP device restores split over the data replicas."""
  # fsdp=8: 6 steps, checkpoints at 5 and 6; the loss of step 6 on the original mesh is the reference.
  base = shared_run(shared, "fsdp8_f32", lambda w: train(shared, w, 6, *F32))
  run = copy_run(base, tmp_path / "run")
  shutil.rmtree(run / "checkpoints" / "6")
  p = train(shared, run, 6, *F32, *[f"--config.mesh.{m}" for m in mesh], devices=devices)
  assert "at step 5" in p.stderr
  assert losses(run)[6] == pytest.approx(losses(base)[6], rel=1e-5)


PIPELINED = ["--config.checkpoint.every_steps=3"]
STAGES = ["--config.mesh.pipeline=4", "--config.train.grad_accum_steps=4"]  # fsdp fills the other 2 devices.
UNEVEN = ["--config.mesh.pipeline=2", "--config.train.grad_accum_steps=2"]  # 3 layers: 4 rows, one of padding.


@pytest.mark.parametrize("layers,saved_on,resumed_on", [
    pytest.param(4, STAGES, [], id="pipeline4_to_fsdp8"),
    pytest.param(4, [], STAGES, id="fsdp8_to_pipeline4", marks=pytest.mark.extended),
    pytest.param(3, UNEVEN, [], id="uneven_pipeline2_to_fsdp8"),
    pytest.param(3, [], UNEVEN, id="fsdp8_to_uneven_pipeline2", marks=pytest.mark.extended)])
@pytest.mark.long
def test_pipelined_checkpoints_resume_without_a_pipeline_and_back(shared, tmp_path, layers, saved_on, resumed_on):
  """A pipeline's stages hold rows of the same stacked layers: a checkpoint saved at step 3 by 4 stages (x fsdp 2, 4
  micro-batches) resumes on fsdp 8 alone, and the reverse, with the uninterrupted runs' losses (float32). With 3
  layers in 2 stages the pipelined state holds a padding row, which the restore drops (or adds, zeros)."""
  model = [f"--config.model.num_layers={layers}", *PIPELINED]
  stages = STAGES if layers == 4 else UNEVEN
  runs = {name: shared_run(shared, f"pipe{layers}_{name}", lambda w, m=mesh: train(shared, w, 6, *F32, *model, *m))
          for name, mesh in (("stages", stages), ("flat", []))}
  assert [losses(runs["stages"])[i] for i in range(1, 7)] == pytest.approx(
      [losses(runs["flat"])[i] for i in range(1, 7)], rel=1e-6)
  run = copy_run(runs["stages" if saved_on else "flat"], tmp_path / "run")
  shutil.rmtree(run / "checkpoints" / "6")
  kept = [r for r in records(run) if r.get("step", 0) <= 3]  # Steps 4-6 must come from the resumed run.
  (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
  p = train(shared, run, 6, *F32, *model, *resumed_on)
  assert "at step 3" in p.stderr
  assert [losses(run)[i] for i in (4, 5, 6)] == pytest.approx([losses(runs["flat"])[i] for i in (4, 5, 6)], rel=1e-6)


# --- Precision schedules ----------------------------------------------------------------------------

SCHEDULE = ["--config.quant.recipe=nvfp4", "--config.quant.schedule=((12, {'forward': 'bf16'}),)"]


@pytest.mark.long
def test_sigkill_and_resume_across_a_precision_switch_is_bitwise(shared, tmp_path):
  """nvfp4, forward GEMMs in bf16 after 12 steps: the switch is at step 13 in every run, and runs killed before
  the switch (resumed from step 5 or 10) and after it (resumed from 15) log the uninterrupted run's losses."""
  ref_dir = shared_run(shared, "ref_schedule", lambda w: train(shared, w, 20, *SCHEDULE))
  ref = records(ref_dir)
  assert {r["step"]: r["quant_phase"] for r in ref if "loss" in r} == {s: int(s > 12) for s in range(1, 21)}
  run = tmp_path / "run"
  for kill_at in (8, 17):
    proc = start(shared, run, 20, *SCHEDULE)
    wait_for_step(proc, run, kill_at)
    proc.kill()
    proc.wait(timeout=60)
    proc.stderr.close()
  assert checkpoint_steps(run)[-1] >= 10
  p = train(shared, run, 20, *SCHEDULE)
  assert "resumed from" in p.stderr
  assert_steps_once(run, 20)
  assert losses(run) == losses(ref_dir)  # Bitwise, every step.
