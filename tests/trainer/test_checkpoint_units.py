"""Checkpointer pieces in one process: async saves vs donated buffers, shape and seed checks, data shards."""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from ember.config import defaults
from ember.data import ShardedIterator, make_iterator
from ember.data.pipeline import data_fingerprint
from ember.errors import CheckpointError
from ember.trainer.checkpointing import (
    Checkpointer, Stacked, _is_damage, check_shapes, restore_data_position, restore_from)
from ember.trainer.state import TrainState


def _state(mesh, value: float, step: int = 0):
  sh = NamedSharding(mesh, P("x"))
  params = {"layer": {"w": jax.device_put(jnp.full((8, 4), value, jnp.float32), sh)}}
  return TrainState(step=jnp.asarray(step, jnp.int32), params=params,
                    opt_state=({"mu": jax.tree.map(jnp.zeros_like, params)},), quant_state={})


def _abstract_and_shardings(state):
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
  return abstract, jax.tree.map(lambda a: a.sharding, state)


@pytest.fixture
def mesh():
  return jax.sharding.Mesh(np.asarray(jax.devices()[:4]), ("x",))


def test_async_save_keeps_the_values_of_its_step_while_the_state_is_donated(tmp_path, mesh):
  ckpt = Checkpointer(str(tmp_path / "ckpt"), every_steps=1, keep=2, async_save=True)
  state = _state(mesh, 1.0)
  update = jax.jit(lambda s: jax.tree.map(lambda a: a + 1, s), donate_argnums=0)
  ckpt.save(1, state, None, seed=0)
  for _ in range(20):  # Overwrite the (donated) buffers while the save may still be writing.
    state = update(state)
  ckpt.save(2, state, None, seed=0)
  ckpt.close()

  again = Checkpointer(str(tmp_path / "ckpt"), every_steps=1, keep=2)
  abstract, shardings = _abstract_and_shardings(state)
  first = again.restore(1, abstract, shardings, None)
  second = again.restore(2, abstract, shardings, None)
  np.testing.assert_array_equal(np.asarray(first.params["layer"]["w"]), 1.0)
  np.testing.assert_array_equal(np.asarray(second.params["layer"]["w"]), 21.0)
  assert int(second.step) == 20
  assert first.params["layer"]["w"].sharding == shardings.params["layer"]["w"]
  again.close()


def test_resume_checks_shapes_before_reading_and_names_the_parameter(tmp_path, mesh):
  ckpt = Checkpointer(str(tmp_path / "ckpt"), every_steps=1, keep=2, async_save=False)
  ckpt.save(3, _state(mesh, 1.0), None, seed=0)
  wider = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32),
                     params={"layer": {"w": jax.ShapeDtypeStruct((8, 6), jnp.float32)}},
                     opt_state=({"mu": {"layer": {"w": jax.ShapeDtypeStruct((8, 6), jnp.float32)}}},), quant_state={})
  shardings = jax.tree.map(lambda _: NamedSharding(mesh, P()), wider)
  with pytest.raises(CheckpointError, match=r"parameter layer/w has shape \(8, 4\) in the checkpoint but \(8, 6\)"):
    ckpt.restore_latest(lambda step: (shardings, wider), None, seed=0)
  assert ckpt.steps() == [3]  # A mismatch is never treated as damage.
  abstract, shardings = _abstract_and_shardings(_state(mesh, 0.0))
  with pytest.raises(CheckpointError, match=r"config\.seed: 5, but .* saved with seed 0"):
    ckpt.restore_latest(lambda step: (shardings, abstract), None, seed=5)
  state, step = ckpt.restore_latest(lambda step: (shardings, abstract), None, seed=0)
  assert step == 3 and float(state.params["layer"]["w"][0, 0]) == 1.0
  ckpt.close()


def test_when_no_step_restores_the_run_does_not_start_over(tmp_path, mesh):
  """Every step damaged: each is moved aside, then an error (not None, which would start a new run and truncate
  the run's metrics), and again on the next start, the steps already moved aside. Out of memory is not damage."""
  ckpt = Checkpointer(str(tmp_path / "ckpt"), every_steps=1, keep=2, async_save=False)
  for step in (1, 2):
    ckpt.save(step, _state(mesh, float(step)), None, seed=0)
    (tmp_path / "ckpt" / str(step) / "state" / "_METADATA").write_text("{")
  abstract, shardings = _abstract_and_shardings(_state(mesh, 0.0))
  for _ in range(2):
    with pytest.raises(CheckpointError, match=r"no step restores \(moved aside as damaged: 1\.corrupt, 2\.corrupt\)"):
      ckpt.restore_latest(lambda step: (shardings, abstract), None, seed=0)
  ckpt.close()
  assert not _is_damage(jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 8589934592 bytes"))
  assert _is_damage(ValueError("Error reading \"state/manifest.ocdbt\": unexpected end of data"))


@pytest.mark.parametrize("error", [
    ValueError("UNAVAILABLE: Error reading \"state/d/0\": HTTP response code: 503"),
    ValueError("DEADLINE_EXCEEDED: Error reading \"state/manifest.ocdbt\""), ConnectionResetError(104, "reset"),
    PermissionError(13, "Permission denied")])
def test_a_storage_failing_now_keeps_the_step(tmp_path, mesh, monkeypatch, error):
  """A read that fails on the storage (a timeout, an unavailable bucket, a permission), not on the step's files:
  the step is kept and the error raised, for a requeued run to read it again. Taken for damage, the newest step
  was renamed .corrupt and the run went back to the one before, losing the steps between."""
  ckpt = Checkpointer(str(tmp_path / "ckpt"), every_steps=1, keep=2, async_save=False)
  for step in (1, 2):
    ckpt.save(step, _state(mesh, float(step)), None, seed=0)
  abstract, shardings = _abstract_and_shardings(_state(mesh, 0.0))

  def failing_storage(*args, **kwargs):
    raise error

  with monkeypatch.context() as m:
    m.setattr(Checkpointer, "restore", failing_storage)
    with pytest.raises(type(error)):
      ckpt.restore_latest(lambda step: (shardings, abstract), None, seed=0)
  assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["1", "2"]
  state, step = ckpt.restore_latest(lambda step: (shardings, abstract), None, seed=0)
  assert step == 2 and float(state.params["layer"]["w"][0, 0]) == 2.0
  ckpt.close()


def test_resume_with_other_layers_fails_where_padding_would_hide_it(tmp_path, mesh):
  """4 layers saved, 3 resumed: a pipeline padding 3 layers to 4 rows would hold the same shapes."""
  ckpt = Checkpointer(str(tmp_path / "ckpt"), every_steps=1, keep=2, async_save=False)
  ckpt.save(3, _state(mesh, 1.0), None, seed=0, metadata={"config": {"model": {"num_layers": 4}}})
  abstract, shardings = _abstract_and_shardings(_state(mesh, 0.0))
  with pytest.raises(CheckpointError, match=r"the checkpoint's model has 4 layers, but model.num_layers=3 here"):
    ckpt.restore_latest(lambda step: (shardings, abstract), None, seed=0, stacked=Stacked(3, 0, 8))
  _, step = ckpt.restore_latest(lambda step: (shardings, abstract), None, seed=0, stacked=Stacked(4, 0, 8))
  assert step == 3
  ckpt.close()


def test_a_resume_in_other_dtypes_casts_a_sound_step_not_moves_it_aside(tmp_path, mesh):
  """optimizer_state_dtype (or param_dtype) changed on a resume: the step restores in its own dtypes, checked
  against its fingerprints, then cast; cast by the restore, it failed its fingerprints and was renamed .corrupt."""
  directory = str(tmp_path / "ckpt")
  ckpt = Checkpointer(directory, every_steps=1, keep=3, async_save=False)
  for step in (1, 2):
    saved = _state(mesh, float(step), step)
    saved = dataclasses.replace(saved, opt_state=({"mu": jax.tree.map(lambda a: a + 0.1, saved.params)},))
    ckpt.save(step, saved, None, seed=0)
  ckpt.close()
  want = jax.tree.map(lambda a: a.astype(jnp.bfloat16), saved)  # Every array in bf16 now.
  abstract, shardings = _abstract_and_shardings(want)
  again = Checkpointer(directory, every_steps=1, keep=3)
  state, step = again.restore_latest(lambda s: (shardings, abstract), None, seed=0)
  again.close()
  assert step == 2 and sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["1", "2"]
  for got, ref in zip(jax.tree.leaves(state), jax.tree.leaves(want)):
    assert got.dtype == ref.dtype and got.sharding == ref.sharding
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(ref, np.float32))
  params, _ = restore_from(directory, lambda s: (shardings, abstract), None, params_only=True, init=lambda: want)
  assert params.params["layer"]["w"].dtype == jnp.bfloat16


def test_params_only_keeps_the_routers_learned_biases(tmp_path, mesh):
  """A fine-tune from the parameters alone starts a fresh optimizer and quantization state, but the routers' biases
  (aux-loss-free balancing: routing state, not parameters) come with the model, as init_from_hf brings them."""
  sh = NamedSharding(mesh, P())
  put = lambda v: jax.device_put(jnp.full((4,), v, jnp.float32), sh)
  saved = dataclasses.replace(_state(mesh, 1.0, 3), quant_state={"layer": {"router_bias": put(0.5),
                                                                           "amax_history": put(7.0)}})
  ckpt = Checkpointer(str(tmp_path / "ckpt"), every_steps=1, keep=1, async_save=False)
  ckpt.save(3, saved, None, seed=0)
  ckpt.close()
  fresh = dataclasses.replace(_state(mesh, 0.0), quant_state={"layer": {"router_bias": put(0.0),
                                                                        "amax_history": put(0.0)}})
  abstract, shardings = _abstract_and_shardings(fresh)
  state, first = restore_from(str(tmp_path / "ckpt"), lambda s: (shardings, abstract), None, params_only=True,
                              init=lambda: fresh)
  assert first == 0 and int(state.step) == 0
  np.testing.assert_array_equal(np.asarray(state.params["layer"]["w"]), 1.0)
  np.testing.assert_array_equal(np.asarray(state.quant_state["layer"]["router_bias"]), 0.5)
  np.testing.assert_array_equal(np.asarray(state.quant_state["layer"]["amax_history"]), 0.0)


def test_check_shapes_reports_parameters_first():
  saved = {"params": {"a": np.zeros((2, 3))}, "opt_state": {"mu": {"a": np.zeros((2, 3))}}}
  want = {"params": {"a": np.zeros((2, 4))}, "opt_state": {"mu": {"a": np.zeros((2, 4))}}}
  with pytest.raises(CheckpointError, match=r"^X: parameter a has shape \(2, 3\)"):
    check_shapes(saved, want, "X")
  with pytest.raises(CheckpointError, match=r"the checkpoint's parameter b \(shape \(1,\)\) has no place"):
    check_shapes({"params": {"a": np.zeros(1), "b": np.zeros(1)}}, {"params": {"a": np.zeros(1)}}, "X")
  with pytest.raises(CheckpointError, match=r"the checkpoint's array quant_state/h/amax"):  # e.g. another recipe
    check_shapes({"params": {"a": np.zeros(1)}, "quant_state": {"h": {"amax": np.zeros(4)}}},
                 {"params": {"a": np.zeros(1)}, "quant_state": {}}, "X")


def _data_cfg():
  c = defaults.get_config()
  c.data.source = "synthetic"
  return c.data


def _sharded(num_shards, shards):
  make = functools.partial(make_iterator, _data_cfg(), seq_len=16, global_batch_size=8, seed=0, split="train",
                           process_count=num_shards)
  return ShardedIterator(lambda s: make(process_index=s), shards, num_shards)


def test_data_position_moves_from_two_processes_to_one(tmp_path):
  # Two processes, one shard each, 3 batches in; each writes its file as grain's handler does.
  procs = [_sharded(2, [0]), _sharded(2, [1])]
  for it in procs:
    for _ in range(3):
      next(it)
  for i, it in enumerate(procs):
    (tmp_path / f"process_{i}-of-2.json").write_text(it.get_state().decode())
  expected = [np.concatenate([b0["inputs"], b1["inputs"]]) for b0, b1 in ((next(procs[0]), next(procs[1]))
                                                                          for _ in range(2))]
  one = _sharded(2, [0, 1])
  restore_data_position(str(tmp_path), one)
  for want in expected:
    np.testing.assert_array_equal(next(one)["inputs"], want)


def test_data_position_for_another_shard_count_restarts_with_a_warning(tmp_path, capsys):
  it = _sharded(1, [0])
  next(it)
  (tmp_path / "process_0-of-1.json").write_text(it.get_state().decode())
  fresh = _sharded(2, [0, 1])
  first = next(_sharded(2, [0, 1]))
  restore_data_position(str(tmp_path), fresh)
  assert "data iterator starts from the beginning" in capsys.readouterr().err
  np.testing.assert_array_equal(next(fresh)["inputs"], first["inputs"])
  assert json.loads(fresh.get_state())["num_shards"] == 2


def test_restore_from_a_missing_or_empty_directory_names_the_key(tmp_path, mesh):
  abstract, shardings = _abstract_and_shardings(_state(mesh, 0.0))
  with pytest.raises(CheckpointError, match=r"config\.checkpoint\.restore_from: no checkpoint directory at"):
    restore_from(str(tmp_path / "nowhere"), lambda step: (shardings, abstract), None, params_only=False, init=None)
  (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
  with pytest.raises(CheckpointError, match=r"config\.checkpoint\.restore_from: no complete checkpoint"):
    restore_from(str(tmp_path / "empty"), lambda step: (shardings, abstract), None, params_only=False, init=None)


@pytest.mark.parametrize("source, key, value", [("hf", "hf_dataset", "other/corpus"), ("hf", "hf_config", "sample-10BT"),
                                               ("hf", "hf_split", "validation"), ("tfds", "tfds_text_key", "content")])
def test_a_dataset_librarys_dataset_is_in_the_data_fingerprint(source, key, value):
  """A resume onto another Hugging Face dataset, configuration or split (or TFDS field) is other data."""
  def data(source, **changes):
    d = _data_cfg().copy_and_resolve_references()
    d.update({"source": source, "tfds_name": "lm1b", "hf_dataset": "org/corpus", **changes})
    return d
  assert data_fingerprint(data(source, **{key: value}), "train") != data_fingerprint(data(source), "train")
  # Where no library is read its keys change nothing: earlier positions keep their fingerprint.
  assert data_fingerprint(data("text", **{key: value}), "train") == data_fingerprint(data("text"), "train")


def test_files_added_under_the_glob_are_other_data(tmp_path):
  """A saved position indexes the documents of the files the glob matched: a file added (the dataset grew) or one
  rewritten re-indexes them, so the position is of other data; mixture sources' files count too."""
  for name in ("a", "b"):
    (tmp_path / f"{name}.txt").write_text(f"document {name}\n" * 20)
  from tests.helpers import settings
  d = settings(**{"data.source": "text", "data.path": str(tmp_path / "*.txt")}).data
  mixed = settings(**{"data.mixture": (("web", "text", str(tmp_path / "*.txt"), "", 1.0),)}).data
  before = data_fingerprint(d, "train"), data_fingerprint(mixed, "train")
  assert data_fingerprint(d, "train") == before[0]  # The same files: the same data.
  (tmp_path / "c.txt").write_text("document c\n" * 20)
  after = data_fingerprint(d, "train"), data_fingerprint(mixed, "train")
  assert after[0] != before[0] and after[1] != before[1]
  (tmp_path / "c.txt").write_text("document c, longer\n" * 20)
  assert data_fingerprint(d, "train") != after[0]
  # A position saved before fingerprints held the files: compared on its keys, it resumes.
  from ember.data.pipeline import _same_data
  older = json.dumps({k: v for k, v in json.loads(after[0]).items() if k != "files"})
  assert _same_data(older, data_fingerprint(d, "train")) and not _same_data(after[0], data_fingerprint(d, "train"))


def test_data_position_of_other_data_restarts_with_a_warning(capsys):
  """A position saved for other data (the fingerprint differs) is not forced onto this pipeline: the
  iterator warns and starts from the beginning; nothing raises."""
  make = functools.partial(make_iterator, _data_cfg(), seq_len=16, global_batch_size=8, seed=0, split="train",
                           process_count=2)
  old = ShardedIterator(lambda s: make(process_index=s), [0, 1], 2, fingerprint="old")
  next(old)
  fresh = ShardedIterator(lambda s: make(process_index=s), [0, 1], 2, fingerprint="new")
  first = next(ShardedIterator(lambda s: make(process_index=s), [0, 1], 2, fingerprint="new"))
  fresh.set_state(old.get_state())
  assert "starts from the beginning" in capsys.readouterr().err
  np.testing.assert_array_equal(next(fresh)["inputs"], first["inputs"])


def test_stacked_rows_may_differ_by_padding_alone():
  """A pipeline's padding rows (parallel/pipeline.py, `padded_blocks`): a leaf of the last scan segment may differ in
  its rows where the checkpoint holds this config's layers (`padding`), each count at least the segment's own;
  no other leaf, and nothing else, may differ."""
  struct = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)

  def state(first, last, width=4):  # Two segments (a dense first layer, say), and a leaf outside the layers.
    return {"params": {"segments": {"0": {"w": struct(first, 4)}, "1": {"w": struct(last, width)}},
                       "head": struct(4, 4)}}

  padding = Stacked(layers=4, segment=1, rows=3)  # Layer 0 in segment 0, layers 1-3 in segment 1.
  check_shapes(state(1, 4), state(1, 3), "ckpt", padding=padding)
  check_shapes(state(1, 3), state(1, 4), "ckpt", padding=padding)
  with pytest.raises(CheckpointError, match="segments/1/w has shape"):
    check_shapes(state(1, 4), state(1, 3), "ckpt")  # Another model's layers.
  with pytest.raises(CheckpointError, match="segments/1/w has shape"):
    check_shapes(state(1, 4, 8), state(1, 3), "ckpt", padding=padding)  # Another row shape.
  with pytest.raises(CheckpointError, match="segments/0/w has shape"):
    check_shapes(state(2, 3), state(1, 4), "ckpt", padding=padding)  # A segment boundary moved.
  with pytest.raises(CheckpointError, match="segments/1/w has shape"):
    check_shapes(state(1, 2), state(1, 4), "ckpt", padding=padding)  # Fewer rows than the segment's layers.
  with pytest.raises(CheckpointError, match="head has shape"):
    check_shapes({"params": {**state(1, 4)["params"], "head": struct(5, 4)}}, state(1, 4), "ckpt", padding=padding)
