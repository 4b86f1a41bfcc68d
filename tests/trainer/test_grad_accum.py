"""Gradient accumulation: a step of micro-batches is the step of the whole batch (8 CPU devices), resumes
exactly, and its throughput counts the whole step."""

import json
import types

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from ember.layers import linear
from ember.names import MESH_AXES
from ember.parallel.sharding import batch_sharding
from ember.program import hlo
from ember.trainer import step as step_lib
from ember.trainer.loop import train
from ember.trainer.step import micro_batches
from tests.helpers import checked, compiled_text, config, one_step, random_batch, rel_error, settings, start

MESH = {"mesh.data": 2, "mesh.fsdp": 4}
MOE_MESH = {"mesh.data": 2, "mesh.fsdp": 2, "mesh.expert": 2}
REPLICAS_ONLY = {"mesh.data": 2, "mesh.fsdp": 1, "mesh.expert": 4}  # Every axis of more than one device a replica.


@pytest.mark.parametrize("preset,recipe,mesh", [
    pytest.param("tiny", "bf16", MESH, id="tiny-bf16", marks=pytest.mark.extended), pytest.param("tiny_moe", "bf16", MESH, id="tiny_moe-bf16", marks=pytest.mark.extended),
    pytest.param("tiny", "fp8_delayed", MESH, id="tiny-fp8_delayed"),
    pytest.param("tiny_moe", "fp8_delayed", MOE_MESH, id="tiny_moe-fp8_delayed-expert2", marks=pytest.mark.extended),
    pytest.param("tiny_moe", "fp8_delayed", REPLICAS_ONLY, id="tiny_moe-fp8_delayed-replicas_only", marks=pytest.mark.extended)])
@pytest.mark.long
def test_four_micro_batches_equal_one_batch(preset, recipe, mesh):
  """float32, 32 sequences: 4 micro-batches of 8 give the loss, the metrics, the gradients (the optimizer's first
  and second moments), the updated parameters and the delayed-scaling histories (each rolls in the largest
  micro-batch amax: the whole batch's) and health statistics of one batch of 32. data 2 x fsdp 4: the replicas
  are the data axis; data 2 x fsdp 2 x expert 2: the data and expert axes, the experts' weights, histories and
  statistics split over the latter; data 2 x expert 4: no axis left to the compiler (the replicas' shard_map is
  manual over every axis). tiny_moe: dropless and without the load-balance loss, which is per
  micro-batch by design (docs/moe.md)."""
  overrides = {"model.dtype": "float32", "quant.recipe": recipe, "train.batch_size": 32, "train.z_loss_weight": 1e-3,
               **mesh}
  if preset == "tiny_moe":
    overrides.update({"model.capacity_factor": 0.0, "model.load_balance_weight": 0.0})
  if recipe == "fp8_delayed":  # Health statistics too: counts add up, amaxes and staleness take the max.
    overrides["log.quant_stats_every"] = 1
  batch = random_batch(config(preset, **overrides))  # Packed, with padding.
  one, state_one = one_step(config(preset, **overrides), batch, 8)
  four, state_four = one_step(config(preset, **overrides, **{"train.grad_accum_steps": 4}), batch, 8)
  for k in one:
    if k != "moe_load_balance_loss":
      for a, b in zip(jax.tree.leaves(one[k]), jax.tree.leaves(four[k]), strict=True):
        assert rel_error(b, a) < 1e-6, (k, b, a)
  flat_one = jax.tree_util.tree_flatten_with_path(state_one)[0]
  flat_four = jax.tree.leaves(state_four)
  assert len(flat_one) == len(flat_four)
  for (path, a), b in zip(flat_one, flat_four):
    assert rel_error(b, a) < 1e-6, jax.tree_util.keystr(path)


@pytest.mark.long
@pytest.mark.parametrize("recipe", ["fp8_current", pytest.param("nvfp4", marks=pytest.mark.extended)])
def test_a_step_over_replicas_equals_the_step_over_one_group(recipe):
  """4 micro-batches on data 2 x fsdp 4 (each replica sums its own, reduced once a step) equal them on fsdp 8
  (one program over the mesh): the same micro-batches, each quantized with the amax of the whole micro-batch
  (the replicas reduce theirs). NVFP4 rounds to nearest here: a replica's stochastic rounding draws noise of
  its own."""
  overrides = {"model.dtype": "float32", "quant.recipe": recipe, "quant.nvfp4_stochastic_rounding": False,
               "train.batch_size": 32, "train.grad_accum_steps": 4}
  batch = random_batch(config("tiny", **overrides))
  replicas = one_step(config("tiny", **overrides, **MESH), batch, 8)
  one_group = one_step(config("tiny", **overrides, **{"mesh.data": 1, "mesh.fsdp": 8}), batch, 8)
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(one_group)[0], jax.tree.leaves(replicas), strict=True):
    assert rel_error(b, a) < 1e-6, jax.tree_util.keystr(path)


@pytest.mark.parametrize("recipe", ["fp8_current", "bf16", pytest.param("fp8_delayed", marks=pytest.mark.extended)])
@pytest.mark.long
def test_kernels_quantized_once_a_step_change_no_bit(recipe, monkeypatch):
  """A step of micro-batches takes each kernel's amax and makes its quantized copies (bf16: its cast) once, before
  its scan (linear.once_a_step): bit for bit the step whose every micro-batch (and remat recomputation) quantizes
  or casts each kernel itself. fsdp 8: the amax of the sharded kernels is the global one, the copies are the
  shards'. The LM head's GEMMs are the loss's: it is handed nothing."""
  cfg = lambda: config("tiny", **{"quant.recipe": recipe, "train.batch_size": 16, "train.grad_accum_steps": 2})
  s = start(cfg(), 1)
  taken = linear.once_a_step(nnx.merge(s.graphdef, s.state.params, s.state.quant_state))
  assert len(taken) == 4 and all(t.copies for t in taken.values())  # qkv / out / wi / wo.
  batch = random_batch(cfg())
  once = one_step(cfg(), batch, 8)
  monkeypatch.setattr(linear, "once_a_step", lambda model, *args, **kwargs: {})
  every = one_step(cfg(), batch, 8)
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(once)[0], jax.tree.leaves(every), strict=True):
    np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


@pytest.mark.variants
@pytest.mark.parametrize("scan", [False, True])
def test_every_projection_of_a_step_of_micro_batches_is_handed_its_kernel_once(scan, monkeypatch):
  """Each projection a step of micro-batches runs (latent attention's, the dense and shared experts' MLPs, the
  multi-token-prediction module's), unrolled or scanned, reads the kernel amax and quantized copies the step made
  ahead (linear.Taken, handed down the model's call) rather than quantizing its kernel again."""
  from ember.parallel.mesh import make_mesh
  from ember.plan.step import trace_train_step
  from ember.trainer.optimizer import make_optimizer
  handed = {}
  matmul = linear.dot.quantized_matmul

  def recording(*args, **kwargs):
    handed.setdefault(kwargs["name"], set()).add(kwargs["kernel_amax"] is not None and
                                                 kwargs["kernel_copies"] is not None)
    return matmul(*args, **kwargs)

  monkeypatch.setattr(linear.dot, "quantized_matmul", recording)
  s = settings("deepseek_tiny", 1, **{"quant.recipe": "fp8_current", "train.grad_accum_steps": 2,
                                      "model.scan_layers": scan, "train.batch_size": 4})
  tx, schedule = make_optimizer(s)
  trace_train_step(s, make_mesh(s.mesh, jax.devices()[:1]), tx, schedule, s.remat.preset)
  assert {"q_b", "kv_a", "kv_b", "out", "wi", "wo", "shared_wi", "shared_wo", "mtp_proj"} <= handed.keys()
  assert handed == {name: {True} for name in handed}, handed


def test_micro_batches_keep_every_row_on_its_device():
  """Micro-batch i holds rows [i * m, (i + 1) * m) of every device's block: no row changes device."""
  rows = np.arange(16)[:, None]  # 4 devices x 4 rows, 2 micro-batches of 2 rows per device.
  split = np.asarray(micro_batches(rows, 2, 4))[..., 0]
  assert split.tolist() == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]


def _records(workdir):
  return [json.loads(line) for line in open(workdir / "metrics.jsonl") if '"loss"' in line]


@pytest.mark.long
def test_resume_mid_way_and_tokens_per_s_count_the_step(tmp_path):
  """fp8_delayed (histories combine by max), 2 micro-batches: 4 steps straight, and 2 steps then a resume to 4,
  log the same losses bit for bit; tokens/s is the whole batch's tokens over the step time."""
  common = {"quant.recipe": "fp8_delayed", "train.batch_size": 16, "train.grad_accum_steps": 2,
            "checkpoint.every_steps": 2, "log.every_steps": 1}
  train(checked(config("tiny", **common, steps=4, workdir=str(tmp_path / "straight"))))
  train(checked(config("tiny", **common, steps=2, workdir=str(tmp_path / "resumed"))))
  train(checked(config("tiny", **common, steps=4, workdir=str(tmp_path / "resumed"))))
  straight, resumed = _records(tmp_path / "straight"), _records(tmp_path / "resumed")
  assert [r["loss"] for r in resumed if r["step"] > 2] == [r["loss"] for r in straight if r["step"] > 2]
  for r in straight:
    assert abs(r["tokens_per_s"] * r["step_time_s"] / (16 * config("tiny").model.seq_len) - 1) < 1e-6


@pytest.mark.parametrize("tied", [False, pytest.param(True, marks=pytest.mark.extended)])
@pytest.mark.long
def test_a_head_read_once_a_step_trains_as_one_batch(tied, monkeypatch):
  """The LM head read once for a step's micro-batches (loss.py's `read_once`, which a step takes where its tokens
  are split across nodes: forced here on one host): 4 micro-batches on fsdp 8 give one batch's loss, metrics,
  gradients (the optimizer's moments) and updated parameters, float32, with the head its own weight or the
  embedding's (`tied`); each device keeps its share of the head's weight gradient, and the one collective that
  carries a float32 [D, V] (a vocabulary of 384, a size no other weight has) runs once a step, outside the
  micro-batch loop."""
  monkeypatch.setattr(step_lib, "_reads_head_once", lambda cfg, mesh, replicas: True)
  overrides = {"model.dtype": "float32", "quant.recipe": "bf16", "train.batch_size": 32, "model.vocab_size": 384,
               "model.tie_embeddings": tied, "mesh.data": 1, "mesh.fsdp": 8, "train.z_loss_weight": 1e-3}
  batch = random_batch(config("tiny", **overrides))
  one, state_one = one_step(config("tiny", **overrides), batch, 8)
  four, state_four = one_step(config("tiny", **overrides, **{"train.grad_accum_steps": 4}), batch, 8)
  for k in one:
    assert rel_error(four[k], one[k]) < 1e-6, (k, four[k], one[k])
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(state_one)[0], jax.tree.leaves(state_four), strict=True):
    assert rel_error(b, a) < 1e-6, jax.tree_util.keystr(path)
  collectives, _, cfg = _compiled_collectives("tiny", 4, overrides)
  head = f"f32[{cfg.model.d_model},{cfg.model.vocab_size}]"
  carrying = [c for c in collectives if c.kind in ("all-reduce", "reduce-scatter") and head in c.shape]
  assert [c.times for c in carrying] == [1], [(c.shape, c.times) for c in carrying]


def _processes_along(axis: str, processes: int = 2):
  """A stand-in mesh over MESH_AXES whose devices belong to `processes` processes along `axis` (one device on
  every other axis)."""
  shape = [processes if a == axis else 1 for a in MESH_AXES]
  grid = np.empty(shape, dtype=object)
  for index in np.ndindex(*shape):
    grid[index] = types.SimpleNamespace(process_index=index[MESH_AXES.index(axis)])
  return types.SimpleNamespace(devices=grid, axis_names=MESH_AXES)


@pytest.mark.parametrize("across,replicas,once", [
    ("fsdp", (), True),  # FSDP across the hosts: each micro-batch would reduce the head over the network.
    ("tensor", (), False),  # The tokens stay on each host.
    ("data", ("data",), False),  # Replicas reduce once a step anyway.
    ("expert", (), True)])
def test_a_step_reads_the_head_once_where_its_tokens_cross_hosts(across, replicas, once):
  assert step_lib._reads_head_once(settings("tiny"), _processes_along(across), replicas) is once
  one_process = Mesh(np.asarray(jax.devices()[:1]).reshape((1,) * len(MESH_AXES)), MESH_AXES)
  assert not step_lib._reads_head_once(settings("tiny"), one_process, replicas)
  assert not step_lib._reads_head_once(settings("tiny"), None, replicas)


def _compiled_collectives(preset: str, accum: int, overrides: dict):
  """(the collectives of a compiled step of `preset`, 32 sequences in `accum` micro-batches with `overrides` (its
  mesh, ...), with their loops' trip counts; a function naming the mesh axes a device group spans; the settings)."""
  text, s = compiled_text(config(preset, **{"train.batch_size": 32, **overrides, "train.grad_accum_steps": accum}), 8)
  coords = {int(d): i for i, d in np.ndenumerate(s.mesh.device_ids)}
  apart = lambda group: {s.mesh.axis_names[a] for a in range(s.mesh.devices.ndim)
                         if len({coords[d][a] for d in group}) > 1}
  return hlo.collective_ops(text), apart, s.cfg


def _replica_all_reduces(accum: int) -> list[hlo.Collective]:
  """The all-reduces across replicas (devices apart along the data or expert axes, with or without others: the
  loss sums the LM head's gradient over every axis the tokens are split over in one; MOE_MESH, tiny_moe, 32
  sequences, fp8_current) of a compiled step, with their loops' trip counts, but for those of 64 bytes or less
  (the quantizers' amaxes, the MoE layers' statistics; the smallest gradient, a norm's, has 256). Each replica
  holds the whole optimizer state here: split over them, the sums are reduce-scattered (test_sharded_optimizer.py)."""
  collectives, apart, _ = _compiled_collectives("tiny_moe", accum, {**MOE_MESH, "train.shard_optimizer_state": False})
  return [c for c in collectives
          if c.kind == "all-reduce" and c.groups and c.bytes > 64 and apart(c.groups[0]) & {"data", "expert"}]


@pytest.mark.long
def test_gradients_are_reduced_across_replicas_once_a_step():
  """Each replica sums its micro-batches' gradients, and the sums are all-reduced across the replicas once a
  step (before, every micro-batch all-reduced its gradient): the experts' weights' over the data axis, the
  others' over data and expert; no more bytes than a step of one batch, and none inside the micro-batch loop."""
  one, four = _replica_all_reduces(1), _replica_all_reduces(4)
  assert four and all(c.times == 1 for c in four), [(c.shape, c.times) for c in four]
  assert sum(c.bytes for c in four) <= 1.25 * sum(c.bytes_per_step for c in one)


@pytest.mark.parametrize("preset", ["tiny", pytest.param("tiny_moe", marks=pytest.mark.extended)])
def test_evaluation_runs_the_steps_micro_batches(preset):
  """float32, fp8_current, 32 sequences on data 2 x fsdp 4: the eval step over 4 micro-batches gives the token-
  weighted mean of its micro-batches' losses, each evaluated alone as a batch of its own (current scaling quantizes
  each micro-batch at its own amax, as the train step does: against the whole batch at once the loss differs by
  the FP8 roundings that moves, 1e-5 on tiny_moe), holding one micro-batch's activations (its compiled
  temporaries below the whole batch's): the memory the step was sized for."""
  overrides = {"model.dtype": "float32", "train.batch_size": 32, **MESH}
  if preset == "tiny_moe":
    overrides["model.capacity_factor"] = 0.0
  batch = random_batch(config(preset, **overrides))
  accum = 4

  def evaluate(rows_per_batch: int, steps: int):
    """(the compiled eval step of batches of `rows_per_batch` in `steps` micro-batches, its start)."""
    s = start(config(preset, **{**overrides, "train.batch_size": rows_per_batch, "train.grad_accum_steps": steps}), 8)
    sharding = batch_sharding(s.cfg.mesh.rules_dict, s.mesh)
    example = jax.device_put({k: v[:rows_per_batch] for k, v in batch.items()}, sharding)
    with s.rules():
      return step_lib.jit_eval_step(s.cfg, s.mesh, s.graphdef, s.shardings).lower(s.state, example).compile(), s

  def run(compiled, s, rows):
    with s.rules():
      return float(compiled(s.state, jax.device_put(rows, batch_sharding(s.cfg.mesh.rules_dict, s.mesh))))

  whole, s_whole = evaluate(32, 1)
  stepped, s_stepped = evaluate(32, accum)
  alone, s_alone = evaluate(32 // accum, 1)
  parts = jax.tree.map(lambda a: np.asarray(micro_batches(a, accum, 8)), batch)  # As the step cuts the batch.
  tokens = np.sum(parts["segment_ids"] > 0, axis=(1, 2))
  losses = [run(alone, s_alone, {k: v[i] for k, v in parts.items()}) for i in range(accum)]
  want = float(np.sum(np.asarray(losses) * tokens) / np.sum(tokens))
  got = run(stepped, s_stepped, batch)
  assert rel_error(got, want) < 1e-6, (got, losses)
  assert rel_error(got, run(whole, s_whole, batch)) < 1e-4  # FP8 roundings apart.
  assert stepped.memory_analysis().temp_size_in_bytes < whole.memory_analysis().temp_size_in_bytes


def test_the_eval_loss_weights_each_batch_by_its_tokens(monkeypatch):
  """Two held-out batches, one with 10 real tokens and mean loss 1, one with 30 and mean loss 3: the loss per
  token is (10 + 90) / 40 = 2.5, as one batch of both would give; the mean of the means (2.0) weighted a padded
  batch as a full one."""
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from ember import config as config_lib
  from ember.trainer import loop
  cfg = config_lib.validate(config("tiny", **{"train.batch_size": 2, "train.eval_batches": 2}), 1)

  def batch(real):
    segments = np.zeros((2, cfg.model.seq_len), np.int32)
    segments.reshape(-1)[:real] = 1
    return {k: segments.copy() for k in ("inputs", "targets", "positions", "segment_ids")}

  class Batches:
    def __init__(self):
      self.left = [batch(10), batch(30)]

    def __next__(self):
      return self.left.pop(0)

    def close(self):
      pass

  monkeypatch.setattr(loop, "data_iterator", lambda *a, **k: Batches())
  sharding = NamedSharding(Mesh(np.asarray(jax.devices()[:1]), ("data",)), P())
  loss_of = lambda state, b: jnp.where(jnp.sum(b["segment_ids"]) == 10, 1.0, 3.0)
  assert loop.evaluate(cfg, None, loss_of, sharding) == pytest.approx(2.5)
