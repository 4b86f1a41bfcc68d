"""Faults a long job meets: a non-finite step skipped (the state as if its batch had never come), too many in a row
ending the run, a hung stage ending the process with its stacks, stragglers named, XLA's timeouts matched."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest

from array_record.python.array_record_module import ArrayRecordWriter

from ember.data import ShardedIterator
from ember.data.sources import encode_record
from ember.errors import DIVERGED_EXIT_STATUS, OUT_OF_MEMORY_EXIT_STATUS, Diverged, fail_and_exit, out_of_memory
from ember.parallel.sharding import batch_sharding
from ember.tools import sweep
from ember.trainer import watchdog as watchdog_lib
from ember.trainer.loop import train
from ember.trainer.step import jit_train_step
from tests.helpers import ROOT, checked, config, random_batch, start


def test_a_non_finite_step_leaves_the_state_as_if_its_batch_never_came():
  """good, bad, good against good, good: the bad step (a token id past the vocabulary: NaN embeddings) changes no
  leaf, is flagged, and the third step equals the second of the clean run bit for bit (same state, same key)."""
  s = start(config("tiny", **{"model.dtype": "float32", "quant.recipe": "fp8_delayed"}), 1)
  good = [random_batch(s.cfg, seed=i) for i in (1, 2)]
  bad = dict(good[0], inputs=np.full_like(good[0]["inputs"], 1 << 30))
  sharding = batch_sharding(s.cfg.mesh.rules_dict, s.mesh)
  put = lambda b: {k: jax.device_put(v, sharding) for k, v in b.items()}
  with s.rules():
    step = jit_train_step(s.cfg, s.mesh, s.graphdef, s.tx, s.schedule, s.shardings, donate=False)
    after_good, m1 = step(s.state, put(good[0]))
    after_bad, m_bad = step(after_good, put(bad))
    with_bad, _ = step(after_bad, put(good[1]))
    clean, _ = step(after_good, put(good[1]))
  assert int(m1["skipped"]) == 0 and int(m_bad["skipped"]) == 1
  assert not np.isfinite(float(m_bad["loss"]))
  assert int(after_bad.step) == int(after_good.step) == 1
  for a, b in zip(jax.tree.leaves(after_bad), jax.tree.leaves(after_good)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert jax.tree.leaves(after_good.quant_state)  # fp8_delayed: the amax histories are among the leaves compared.
  for a, b in zip(jax.tree.leaves(with_bad), jax.tree.leaves(clean)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_step_whose_new_amax_history_is_not_finite_is_skipped():
  """An Inf in a delayed-scaling operand saturates in the cast: loss and gradient norm stay finite, but the new
  history holds the Inf and would set that operand's scale to 1 for as many steps as the history is long (small
  gradients flushed to zero all that time). The step is skipped instead."""
  import jax.numpy as jnp
  from ember.trainer.state import TrainState
  from ember.trainer.step import unless_non_finite
  old = TrainState(step=jnp.asarray(3), params={"w": jnp.ones(2)}, opt_state=(), quant_state={"h": jnp.zeros(4)})
  new = TrainState(step=jnp.asarray(4), params={"w": jnp.full(2, 0.5)}, opt_state=(),
                   quant_state={"h": jnp.asarray([jnp.inf, 0.0, 0.0, 0.0])})
  kept, metrics = unless_non_finite(old, new, {"loss": jnp.asarray(2.0)}, jnp.asarray(1.0))
  assert int(metrics["skipped"]) == 1 and int(kept.step) == 3 and float(kept.quant_state["h"].max()) == 0.0
  finite = TrainState(step=new.step, params=new.params, opt_state=(), quant_state={"h": jnp.asarray([5.0, 0, 0, 0])})
  kept, metrics = unless_non_finite(old, finite, {"loss": jnp.asarray(2.0)}, jnp.asarray(1.0))
  assert int(metrics["skipped"]) == 0 and int(kept.step) == 4


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """Pre-tokenized documents (ArrayRecord)."""
  root = tmp_path_factory.mktemp("corpus")
  rng = np.random.default_rng(0)
  writer = ArrayRecordWriter(str(root / "docs.array_record"), "group_size:1")
  for _ in range(60):
    writer.write(encode_record(rng.integers(0, 256, size=int(rng.integers(40, 120)), dtype=np.int32)))
  writer.close()
  return root


POISONED_BATCH = 4  # The training batch (1-based) that reaches the step with a token id past the vocabulary.


@pytest.fixture
def poisoned(monkeypatch):
  """Every data iterator's POISONED_BATCH-th batch holds an id past the vocabulary (NaN embeddings, a non-finite
  step): what a tokenizer mismatch did before the pipeline checked its ids, put in past that check."""
  served = ShardedIterator.__next__

  def next_batch(self):
    batch = served(self)
    self.served = getattr(self, "served", 0) + 1
    if self.served == POISONED_BATCH:
      batch = dict(batch, inputs=np.where(np.arange(batch["inputs"].shape[1]) == 5, 1 << 20, batch["inputs"]))
    return batch

  monkeypatch.setattr(ShardedIterator, "__next__", next_batch)


def _run(tmp_path, corpus, **overrides):
  cfg = config("tiny", **{"workdir": str(tmp_path), "steps": 11, "log.every_steps": 1, "checkpoint.every_steps": -1,
                          "data.source": "array_record", "data.path": str(corpus / "*.array_record"),
                          "data.eval_fraction": 0.0, "data.chunk_shuffle_window": 0, "model.seq_len": 64, "train.batch_size": 8, **overrides})
  return cfg


@pytest.mark.long
def test_skipped_steps_are_counted_and_the_run_goes_on_or_ends_past_the_limit(tmp_path, corpus, poisoned, capsys):
  train(checked(_run(tmp_path / "on", corpus, **{"train.max_skipped_steps": 2})))
  records = [json.loads(line) for line in (tmp_path / "on" / "metrics.jsonl").read_text().splitlines()]
  records = [r for r in records if "loss" in r]
  assert [r["step"] for r in records] == list(range(1, 12))  # The run went on to its last step.
  bad = [r["step"] for r in records if r["loss"] is None]
  assert bad == [POISONED_BATCH], bad
  for r in records:  # skipped_steps counts the non-finite steps up to each record's.
    assert r["skipped_steps"] == sum(b <= r["step"] for b in bad)
  assert all(np.isfinite(r["loss"]) for r in records if r["step"] not in bad)
  err = capsys.readouterr().err
  assert f"warning: step {bad[0]}: loss nan" in err and "not finite, the step is skipped" in err
  # The same data with a limit of one: the first skipped step ends the run with a line naming the key.
  with pytest.raises(Diverged, match=rf"train.max_skipped_steps: 1 steps in a row \({bad[0]}-{bad[0]}\)"):
    train(checked(_run(tmp_path / "limit", corpus, **{"train.max_skipped_steps": 1})))
  with pytest.raises(SystemExit) as exit_info:
    fail_and_exit(Diverged("x"))
  assert exit_info.value.code == DIVERGED_EXIT_STATUS == 3


def test_the_watchdog_ends_the_process_past_a_deadline_with_its_stacks():
  fired, out = threading.Event(), io.StringIO()
  statuses = []
  dog = watchdog_lib.Watchdog(process_index=1, out=out, exit=lambda code: (statuses.append(code), fired.set()))
  try:
    dog.expect("step 4", 0.3, watchdog_lib.STEP_KEY)
    dog.expect("step 5", 0.3, watchdog_lib.STEP_KEY)  # Re-armed in time: step 4's deadline is gone.
    assert fired.wait(5)
  finally:
    dog.close()
  assert statuses == [watchdog_lib.HUNG_EXIT_STATUS]
  text = out.getvalue()
  assert text.startswith("error: process 1: step 5 made no progress in 0 s (train.step_timeout_s)")
  assert "test_the_watchdog_ends_the_process_past_a_deadline_with_its_stacks" in text  # The main thread's stack.
  quiet = watchdog_lib.Watchdog(exit=lambda code: statuses.append(code))
  quiet.expect("step 1", 0.2, watchdog_lib.STEP_KEY)
  quiet.disarm()
  threading.Event().wait(0.4)
  quiet.close()
  assert statuses == [watchdog_lib.HUNG_EXIT_STATUS]  # Disarmed: nothing more.


def test_deadlines_follow_the_measured_steps_and_xla_timeouts_sit_past_them():
  step, compile_ = watchdog_lib.STEP_KEY, watchdog_lib.COMPILE_KEY
  auto = watchdog_lib.Deadlines(0.0, 900.0)
  # Nothing timed yet: the compile's deadline, and its key named (the line a hang prints says which key to raise).
  assert auto.step() == (900.0, compile_) and auto.long() == (900.0, compile_)
  for seconds in (1.0, 30.0, 2.0, 3.0, 2.5):
    auto.timed(seconds)
  assert auto.step() == (120.0, step)  # 10 x the median (2.5 s) is under the floor.
  for seconds in (20.0,) * 5:
    auto.timed(seconds)
  assert auto.step() == (200.0, step)  # 10 x the median of (1, 30, 2, 3, 2.5, 20 x 5) = 10 x 20.
  assert watchdog_lib.Deadlines(45.0, 900.0).step() == (45.0, step)
  assert watchdog_lib.Deadlines(7200.0, 3600.0).long() == (7200.0, step)  # The longer of the two, by its own key.
  off = watchdog_lib.Deadlines(-1.0, 900.0)
  assert off.step()[0] is None and off.long()[0] is None
  flags = watchdog_lib.xla_flags("--xla_foo=1 --xla_gpu_first_collective_call_terminate_timeout_seconds=5", 45.0,
                                 900.0)
  assert flags.split() == ["--xla_foo=1", "--xla_gpu_first_collective_call_terminate_timeout_seconds=5",
                           "--xla_gpu_nccl_termination_timeout_seconds=105"]  # The user's value stays.
  assert "termination_timeout_seconds=960" in watchdog_lib.xla_flags("", 0.0, 900.0)
  assert watchdog_lib.xla_flags("--a=1", -1.0, 900.0) == "--a=1"


def test_stragglers_name_the_slowest_prober_and_the_longest_input_wait():
  gather = lambda mine: np.stack([[0.010, 0.001], [0.025, 0.000], [0.011, 0.004], mine])
  s = watchdog_lib.Stragglers(warn_ratio=1.3)
  s.add_input_wait(0.002)
  s.add_input_wait(0.004)
  record, warning = s.take(gather, probe=lambda: 0.012)
  assert record["straggler_process"] == 1 and record["straggler_probe_s"] == 0.025
  # The others' median: of 0.010, 0.011 and 0.012.
  assert record["median_probe_s"] == 0.011 and record["straggler_ratio"] == pytest.approx(0.025 / 0.011)
  assert record["input_wait_process"] == 2 and record["input_wait_s"] == 0.004
  assert warning.startswith("process 1 is a straggler")
  calm, warning = watchdog_lib.Stragglers(warn_ratio=3.0).take(gather, probe=lambda: 0.012)
  assert calm["straggler_process"] == 1 and warning is None
  assert watchdog_lib.probe_seconds(jax.local_devices()[:1]) > 0


def test_the_probe_runs_twice_on_a_device_the_first_time_and_once_after(monkeypatch):
  """A device's first probe compiles it (an untimed run first); at every later log step one timed run."""
  runs = []
  probe = watchdog_lib._probe_fn
  monkeypatch.setattr(watchdog_lib, "_warm", set())
  monkeypatch.setattr(watchdog_lib, "_probe_fn", lambda *a: lambda x: runs.append(x.device) or probe(*a)(x))
  devices = jax.local_devices()[:2]
  watchdog_lib.probe_seconds(devices)
  assert runs == [devices[0], devices[0], devices[1], devices[1]]
  runs.clear()
  watchdog_lib.probe_seconds(devices)
  assert runs == devices


def test_out_of_memory_ends_train_py_with_one_line_and_status_4(tmp_path):
  """XLA's RESOURCE_EXHAUSTED (here a real one: 256 TB asked of the CPU's allocator, past any address space) ends
  train.py with one line that says so and what to change, exit 4; a sweep reads it as `oom`."""
  code = ("import sys, jax, jax.numpy as jnp, train\n"
          "from ember.trainer import loop\n"
          "def prepare(settings):\n"
          "  jax.jit(lambda: jnp.ones((2 ** 46,), jnp.float32))().block_until_ready()\n"
          "loop.prepare = prepare\n"
          "sys.exit(train.main(['train.py', '--config=configs/default.py:tiny', "
          f"'--config.workdir={tmp_path}']))\n")
  run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
  errors = [line for line in run.stderr.splitlines() if line.startswith("error")]
  assert run.returncode == OUT_OF_MEMORY_EXIT_STATUS, run.stderr
  assert errors == [run.stderr.strip().splitlines()[-1]] and "Traceback" not in run.stderr, run.stderr
  assert errors[0].startswith("error: out of memory: RESOURCE_EXHAUSTED: Out of memory allocating "
                              "281474976710656 bytes; the step does not fit: keep fewer residuals (remat.policy)")
  assert sweep.classify(run.returncode, run.stderr) == "oom"


def test_a_storage_librarys_resource_exhausted_is_not_out_of_memory():
  """tensorstore (a checkpoint's write) says RESOURCE_EXHAUSTED for a full disk or too many open files: that is
  no step too large for the device, and ends as the unexpected error it is."""
  full = ValueError("RESOURCE_EXHAUSTED: Error writing local file \"/ckpt/3/state/d/63\": No space left on device "
                    "[os_error_code='28']")
  assert out_of_memory(full) is None
