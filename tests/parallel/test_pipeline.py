"""Pipeline parallelism (ember/parallel/pipeline.py, ember/trainer/pipelined.py): a pipelined step trains as one
device running the same micro-batches, composes with fsdp, tensor and expert parallelism inside a stage, keeps
every quantize op out of the backward pass under `save_quantized`, and bad layouts are one-line config errors."""

from __future__ import annotations

import collections
import functools
import math
import re

import jax
import numpy as np
import pytest

import helpers
from ember import config as config_lib
from ember import remat
from ember.errors import ConfigError
from ember.names import MOE_LOAD_BALANCE_LOSS, MOE_ROUTED_TOKENS, MOE_ROUTER_Z_LOSS
from ember.parallel import pipeline
from ember.parallel.sharding import batch_sharding
from ember.plan.jaxpr import is_quantize_cast, iter_eqns, name_stack
from ember.quant.core import SCOPE_ACTIVATION, SCOPE_GRADIENT, SCOPE_WEIGHT
from ember.trainer.step import train_step

ACCUM = 8


def _cfg(preset="tiny", **overrides):
  # 32 positions, half the presets': the CPU steps' run time is linear in them, and a sequence still splits over the
  # 4 stages that share the LM head and over 2 context devices each.
  return helpers.config(preset, **{"model.dtype": "float32", "model.num_layers": 4, "model.seq_len": 32,
                                   "train.batch_size": 16, "train.grad_accum_steps": ACCUM, "train.warmup_steps": 1,
                                   "train.learning_rate": 1e-3, **overrides})


def _train(cfg, batches, num_devices: int, order=None, logged=("loss",)):
  """(the `logged` metrics of each step, final parameters) of len(batches) steps on the first `num_devices`
  devices; `order`: the rows of each batch as this run reads them."""
  batches = [{k: v if order is None else v[order] for k, v in batch.items()} for batch in batches]
  metrics, state = helpers.run_steps(cfg, batches, num_devices)
  return np.asarray([[float(m[k]) for k in logged] for m in metrics]), state


def _same_micro_batches(batch_size: int, batch_shards: int) -> np.ndarray:
  """The row order in which one device's micro-batch i holds the rows that micro-batch i holds on a mesh whose
  batch is split `batch_shards` ways (step.micro_batches: each device's rows cut into ACCUM runs)."""
  rows = np.arange(batch_size).reshape(batch_shards, ACCUM, batch_size // batch_shards // ACCUM)
  return rows.swapaxes(0, 1).reshape(-1)


def _compare(preset, recipe, mesh: dict, batch_size: int = 16, schedule: str = "gpipe", virtual: int = 1,
             logged=("loss",), **overrides):
  cfg = _cfg(preset, **{"quant.recipe": recipe, "train.batch_size": batch_size, **overrides})
  batches = [helpers.random_batch(cfg, seed=s % 2) for s in range(5)]  # Batches 0, 1, 0, 1, 0.
  shards = mesh.get("data", 1) * mesh.get("fsdp", 1) * mesh.get("expert", 1)
  one, state_one = _train(cfg.copy_and_resolve_references(), batches, 1,
                           order=_same_micro_batches(batch_size, shards), logged=logged)
  piped, state_piped = _train(_cfg(preset, **{"quant.recipe": recipe, "train.batch_size": batch_size, **overrides,
                                               "pipeline.schedule": schedule, "pipeline.virtual_stages": virtual,
                                               **{f"mesh.{a}": n for a, n in {"data": 1, **mesh}.items()}}),
                               batches, math.prod(mesh.values()), logged=logged)
  # A pipeline's padding rows (uneven stages) stay zeros, parameters and amax histories; the model's rows are
  # compared.
  padding = jax.tree.map(lambda a, b: float(np.abs(b[a.shape[0]:]).max(initial=0)),
                         (state_one.params, state_one.quant_state), (state_piped.params, state_piped.quant_state))
  assert max(jax.tree.leaves(padding), default=0) == 0
  rel = jax.tree.map(lambda a, b: float(np.linalg.norm(a - b[:a.shape[0]]) / np.linalg.norm(a)), state_one.params,
                     state_piped.params)
  assert one[-1, 0] < one[0, 0]  # It trained.
  if len(logged) == 1:
    one, piped = one[:, 0], piped[:, 0]
  return one, piped, max(jax.tree.leaves(rel))


SCHEDULES = ["gpipe", "1f1b"]
# Where a behaviour is checked under both schedules, one of them is an extended case (pytest --extended).
ONE_EXTENDED = [pytest.param("gpipe", marks=pytest.mark.extended), "1f1b"]


@pytest.mark.parametrize("schedule", ONE_EXTENDED)
@pytest.mark.parametrize("recipe", ["bf16", pytest.param("fp8_current", marks=pytest.mark.extended)])
@pytest.mark.long
def test_four_stages_train_like_one_device(recipe, schedule):
  """pipeline 4 x fsdp 2, 8 micro-batches, float32, 5 steps: one device's losses and parameters."""
  one, piped, rel = _compare("tiny", recipe, {"pipeline": 4, "fsdp": 2}, schedule=schedule)
  _assert_same_training(recipe, one, piped, rel)


def _assert_same_training(recipe, one, piped, rel):
  if recipe == "bf16":
    np.testing.assert_allclose(piped, one, rtol=1e-5)
    assert rel < 1e-5, rel
  else:
    # FP8's rounding is a step function: the 1e-7 differences of gradients summed in another order (over fsdp,
    # over tensor's partial products, over the stages' shares of the LM head) flip a few roundings once the
    # parameters have moved.
    np.testing.assert_allclose(piped[:2], one[:2], rtol=1e-5)
    np.testing.assert_allclose(piped, one, rtol=1e-4)


@pytest.mark.parametrize("recipe", [pytest.param("bf16", marks=pytest.mark.extended), "fp8_current"])
@pytest.mark.long
def test_interleaved_stages_with_fsdp_and_tensor_inside_train_like_one_device(recipe):
  """pipeline 2 x fsdp 2 x tensor 2, interleaved 1F1B with 2 chunks a stage (layers 0 and 2 on stage 0, 1 and 3
  on stage 1), 8 micro-batches, float32, 5 steps: one device's losses and parameters."""
  one, piped, rel = _compare("tiny", recipe, {"pipeline": 2, "fsdp": 2, "tensor": 2},
                             schedule="interleaved_1f1b", virtual=2)
  _assert_same_training(recipe, one, piped, rel)


@pytest.mark.parametrize("preset,recipe,schedule,virtual,inside", [
    pytest.param("tiny", "bf16", "gpipe", 1, {"fsdp": 2}, marks=pytest.mark.extended),
    ("tiny", "bf16", "1f1b", 1, {"fsdp": 2}),
    ("tiny", "bf16", "interleaved_1f1b", 2, {"tensor": 2}),
    pytest.param("tiny", "fp8_current", "1f1b", 1, {"fsdp": 2}, marks=pytest.mark.extended),
    pytest.param("tiny_moe", "bf16", "1f1b", 1, {"expert": 2}, marks=pytest.mark.extended)])
@pytest.mark.long
def test_stages_with_context_parallelism_inside_train_like_one_device(preset, recipe, schedule, virtual, inside):
  """pipeline 2 x context 2 x (fsdp, tensor or expert) 2: each sequence split over two devices of a stage in the
  balanced layout, the micro-batches put in it once and the losses taken in it (ember/trainer/pipelined.py),
  float32, 5 steps: one device's losses and parameters."""
  one, piped, rel = _compare(preset, recipe, {"pipeline": 2, "context": 2, **inside}, schedule=schedule,
                             virtual=virtual)
  _assert_same_training(recipe, one, piped, rel)


@pytest.mark.long
def test_tied_embeddings_train_like_one_device():
  """A tied head: the table's gradient from the lookups (added on stage 0 as each micro-batch's first chunk ends its
  backward pass) and from the head (every stage's share of the tokens) add up as on one device."""
  one, piped, rel = _compare("tiny", "bf16", {"pipeline": 2, "fsdp": 2, "tensor": 2}, batch_size=32,
                             schedule="interleaved_1f1b", virtual=2, **{"model.tie_embeddings": True})
  np.testing.assert_allclose(piped, one, rtol=1e-5)
  assert rel < 1e-5, rel


@pytest.mark.parametrize("schedule", ONE_EXTENDED)
@pytest.mark.long
def test_stages_over_data_parallel_replicas_train_like_one_device(schedule):
  """pipeline 2 x data 2 x fsdp 2: each data replica runs the pipeline on its own rows, their gradients reduced
  once a step (the map is manual over `data` too)."""
  one, piped, rel = _compare("tiny", "bf16", {"pipeline": 2, "data": 2, "fsdp": 2}, batch_size=32,
                             schedule=schedule)
  np.testing.assert_allclose(piped, one, rtol=1e-5)
  assert rel < 1e-5, rel


@pytest.mark.extended  # The interleaved schedule's test runs this mesh.
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_stages_with_fsdp_and_tensor_inside_train_like_one_device(schedule):
  one, piped, rel = _compare("tiny", "bf16", {"pipeline": 2, "fsdp": 2, "tensor": 2}, batch_size=32,
                             schedule=schedule)
  np.testing.assert_allclose(piped, one, rtol=1e-5)
  assert rel < 1e-5, rel


@pytest.mark.parametrize("schedule", ONE_EXTENDED)
@pytest.mark.long
def test_moe_stages_over_data_parallel_replicas_train_like_one_device(schedule):
  """tiny_moe, bf16, 2 stages x data 2, the balancing losses weighted up: each MoE statistic is a total over both
  replicas' tokens already, so the step logs it, and its gradient reaches the routers, once and not once a replica
  (the routing losses and the routed tokens were logged twice over, and 1F1B's routers took twice their gradient)."""
  logged = ("loss", "total_loss", "moe_load_balance_loss", "moe_router_z_loss", "moe_routed_tokens")
  one, piped, rel = _compare("tiny_moe", "bf16", {"pipeline": 2, "data": 2}, schedule=schedule, logged=logged,
                             **{"model.load_balance_weight": 1.0, "model.router_z_weight": 0.1})
  np.testing.assert_allclose(piped, one, rtol=1e-5)
  assert rel < 1e-5, rel


@pytest.mark.parametrize("schedule,virtual,mesh", [
    pytest.param("gpipe", 1, {"pipeline": 2, "fsdp": 2, "expert": 2}, marks=pytest.mark.extended),
    pytest.param("1f1b", 1, {"pipeline": 4, "expert": 2}, marks=pytest.mark.extended),
    ("interleaved_1f1b", 2, {"pipeline": 2, "fsdp": 2, "expert": 2})])
@pytest.mark.long
def test_moe_stages_with_expert_parallelism_inside_train_like_one_device(schedule, virtual, mesh):
  """tiny_moe, fp8_delayed (amax histories per stage, combined over the micro-batches by max), expert 2 inside
  each stage."""
  one, piped, rel = _compare("tiny_moe", "fp8_delayed", mesh, batch_size=32, schedule=schedule, virtual=virtual)
  _assert_same_training("fp8_delayed", one, piped, rel)


@pytest.mark.parametrize("recipe,mesh,schedule,virtual,layers", [
    ("fp8_current", {"pipeline": 2, "fsdp": 2, "tensor": 2}, "1f1b", 1, 3),
    ("fp8_delayed", {"pipeline": 2, "fsdp": 4}, "gpipe", 1, 3),  # Amax histories: a padding row's stay zero.
    pytest.param("bf16", {"pipeline": 2, "fsdp": 2, "tensor": 2}, "interleaved_1f1b", 2, 5,
                 marks=pytest.mark.extended)])
@pytest.mark.long
def test_uneven_stages_train_like_one_device(recipe, mesh, schedule, virtual, layers):
  """3 layers in 2 stages: the stacked rows padded to 4 with a zero row, the identity, which stays zero (`_compare`
  checks it); 5 layers in 2 stages x 2 chunks: 8 rows, stage 1's second chunk all padding."""
  # A row a device in each micro-batch.
  one, piped, rel = _compare("tiny", recipe, mesh, batch_size=ACCUM * mesh["fsdp"], schedule=schedule,
                             virtual=virtual, **{"model.num_layers": layers})
  _assert_same_training(recipe, one, piped, rel)


@pytest.mark.parametrize("preset,recipe,mesh,schedule,virtual,overrides", [
    # The LM head and layers 0 and 6 in bf16 (as NVFP4's published recipe keeps the last): three scan segments, the
    # middle one's five layers in the stages (a padding row after them), layer 0 on stage 0 ahead of its first,
    # layer 6 on stage 1 after its last.
    ("tiny", "fp8_current", {"pipeline": 2, "fsdp": 2}, "1f1b", 1,
     {"model.num_layers": 7, "quant.exclude": ("lm_head", "layers[0]", "layers[-1:]")}),
    # The quantized layers off the stages (their amax histories a "gradient" of one stage), the bf16 run staged.
    pytest.param("tiny", "fp8_delayed", {"pipeline": 2, "fsdp": 2}, "gpipe", 1,
                 {"model.num_layers": 6, "quant.exclude": ("layers[1:5]",)}, marks=pytest.mark.extended),
    pytest.param("tiny", "fp8_current", {"pipeline": 2, "fsdp": 2, "tensor": 2}, "interleaved_1f1b", 2,
                 {"model.num_layers": 5, "quant.exclude": ("lm_head", "layers[0]")}, marks=pytest.mark.extended),
    # DeepSeek's dense first layer on stage 0, its MoE layers (3 in 2 stages: a padding row) with experts over 2,
    # and its multi-token-prediction module where the LM head runs.
    ("deepseek_tiny", "bf16", {"pipeline": 2, "expert": 2}, "1f1b", 1, {}),
    pytest.param("deepseek_tiny", "fp8_current", {"pipeline": 2, "expert": 2}, "interleaved_1f1b", 2,
                 {"model.num_layers": 5, "quant.exclude": ("lm_head",)}, marks=pytest.mark.extended),
])
@pytest.mark.long
def test_segments_off_the_stages_train_like_one_device(preset, recipe, mesh, schedule, virtual, overrides):
  """A decoder of several scan segments: its longest split into the stages, the others run whole on the first or
  the last stage (ModelConfig.staged_segment); one device's losses and parameters, per-layer MoE statistics and
  the multi-token-prediction loss included."""
  logged = ("loss", "mtp_loss", MOE_ROUTED_TOKENS) if preset == "deepseek_tiny" else ("loss",)
  one, piped, rel = _compare(preset, recipe, mesh, schedule=schedule, virtual=virtual, logged=logged,
                             **overrides)
  _assert_same_training(recipe, one, piped, rel)


@pytest.mark.long
def test_uneven_moe_stages_log_the_models_routing_losses():
  """tiny_moe, 3 layers in 2 stages: the padding row routes too (zero scores, to zero experts), but its
  load-balancing and z losses and its routed tokens are not the model's: the step logs one device's."""
  logged = ("loss", MOE_LOAD_BALANCE_LOSS, MOE_ROUTER_Z_LOSS, MOE_ROUTED_TOKENS)
  one, piped, rel = _compare("tiny_moe", "bf16", {"pipeline": 2}, schedule="1f1b", logged=logged,
                             **{"model.num_layers": 3})
  assert one[:, 1].min() > 0 and one[:, 2].min() > 0
  np.testing.assert_allclose(piped, one, rtol=1e-5)
  assert rel < 1e-5, rel


def _step_quantize_casts(policy_name: str, schedule: str) -> collections.Counter:
  """Casts to a low-precision format outside gradients' quantizers in a whole pipelined train step's program
  (pipeline 4, fp8_current), by what they cast (activations, kernels): the forward's, plus any the backward pass
  recomputes."""
  s = helpers.start(_cfg(**{"quant.recipe": "fp8_current", "mesh.pipeline": 4, "mesh.fsdp": 2, "mesh.data": 1,
                            "pipeline.schedule": schedule}), 8)
  batch = {k: jax.numpy.asarray(v) for k, v in helpers.random_batch(s.cfg).items()}
  with s.rules():
    step = functools.partial(train_step, graphdef=s.graphdef, cfg=s.cfg, tx=s.tx, schedule=s.schedule,
                             policy=remat.PRESETS[policy_name], batch_shards=2)
    jaxpr = jax.make_jaxpr(step)(s.state, batch).jaxpr
  scope = lambda e: SCOPE_ACTIVATION if SCOPE_ACTIVATION in name_stack(e) else SCOPE_WEIGHT
  return collections.Counter(scope(e) for e in iter_eqns(jaxpr)
                             if is_quantize_cast(e) and SCOPE_GRADIENT not in name_stack(e))


@pytest.mark.parametrize("schedule", ONE_EXTENDED)
@pytest.mark.long
def test_save_quantized_recomputes_no_quantize_op_in_a_pipelined_step(schedule):
  """Under save_quantized the pipelined step casts the activations exactly as it does with no remat at all (its
  forward's casts); under full the backward recomputes some. Under either the kernels are cast once a step, before
  the ticks (layers/linear.py's `once_a_step`), and nothing casts one again."""
  casts = {p: _step_quantize_casts(p, schedule) for p in ("none", "save_quantized", "full")}
  activations = {p: c[SCOPE_ACTIVATION] for p, c in casts.items()}
  assert activations["save_quantized"] == activations["none"] < activations["full"], casts
  assert casts["save_quantized"][SCOPE_WEIGHT] == casts["full"][SCOPE_WEIGHT] > 0, casts


def _carried(policy_name: str, **overrides) -> list:
  """The avals the scans of a pipelined step carry (pipeline 4 x fsdp 2, 1F1B, 8 micro-batches, unless `overrides`
  say otherwise)."""
  overrides = {"mesh.pipeline": 4, "mesh.fsdp": 2, "mesh.data": 1, "pipeline.schedule": "1f1b", **overrides}
  s = helpers.start(_cfg(**overrides), 8)
  batch = {k: jax.numpy.asarray(v) for k, v in helpers.random_batch(s.cfg).items()}
  with s.rules():
    step = functools.partial(train_step, graphdef=s.graphdef, cfg=s.cfg, tx=s.tx, schedule=s.schedule,
                             policy=remat.PRESETS[policy_name], batch_shards=2)
    jaxpr = jax.make_jaxpr(step)(s.state, batch).jaxpr
  return [v.aval for e in iter_eqns(jaxpr) if e.primitive.name == "scan" for v in e.invars
          if hasattr(v.aval, "shape")]


def _ring(policy_name: str, **overrides) -> list:
  """The avals of a 1F1B stage's ring of residuals (pipeline 4 x fsdp 2, 8 micro-batches) in the step's program:
  the scans' carried arrays of `pipeline.ring_slots` rows."""
  carried = _carried(policy_name, **overrides)
  ring = [a for a in carried if len(a.shape) > 2 and a.shape[0] == pipeline.ring_slots(ACCUM, 4)]
  assert ring, [a.shape for a in carried]  # The ring is there to look in.
  return ring


def test_a_stage_keeps_no_attention_bias_in_flight():
  """A 1F1B stage keeps each forward pass's residuals in a ring until its backward tick, but not the attention's
  [B, 1, L, L] segment bias: the backward tick makes it again from the micro-batch's segment ids (kept, it would
  hold S + VS - 1 biases: 6 GiB a device on llama3_70b's planner layout)."""
  length = 48  # Unlike every other dimension of tiny, so a [.., 1, L, L] value is the bias.
  ring = _ring("full", **{"model.seq_len": length})
  assert not [a.shape for a in ring if a.shape[-3:] == (1, length, length)], ring


def test_an_interleaved_stage_keeps_a_slot_per_chunk_in_flight():
  """Interleaved 1F1B, 2 stages x 2 chunks, 4 micro-batches: stage 0 holds at most S + VS - 1 = 5 chunks' residuals,
  and its ring has those 5 slots and the spare, not the 2VS - 1 = 7 (and spare) that the longest wait would need were
  slots taken in forward order."""
  carried = _carried("full", **{"mesh.pipeline": 2, "mesh.fsdp": 4, "train.grad_accum_steps": 4,
                                "pipeline.schedule": "interleaved_1f1b", "pipeline.virtual_stages": 2})
  rows = lambda n: [a.shape for a in carried if len(a.shape) > 2 and a.shape[0] == n]
  assert pipeline.ring_slots(4, 2, 2) == 6
  assert rows(6) and not rows(8), (rows(6), rows(8))


def test_stage_0_keeps_no_micro_batchs_embedding_gradient_for_the_step():
  """Each micro-batch's embedding gradient goes into the table's as its first chunk's backward pass ends: no scan of
  the step carries the micro-batches' [M, B, L, D] input gradients (interleaved, 2 stages x 2 chunks, 4 micro-batches,
  so the ring's 6 rows are no M)."""
  carried = _carried("full", **{"mesh.pipeline": 2, "mesh.fsdp": 4, "train.grad_accum_steps": 4,
                                "pipeline.schedule": "interleaved_1f1b", "pipeline.virtual_stages": 2})
  m = _cfg().model
  inputs_grads = (4, 16 // 4, m.seq_len, m.d_model)
  assert inputs_grads not in {a.shape for a in carried}


@pytest.mark.long
def test_offloaded_residuals_wait_for_their_backward_tick_in_host_memory():
  """A policy that offloads residuals (here `minimal`'s names) runs in a 1F1B stage and trains as one device does;
  the stage's ring holds those residuals in host memory, the layer inputs on the device. (The ring kept a slot of
  a tick without a forward pass by a select, which no host-memory array takes: such a step failed to trace.)"""
  one, piped, rel = _compare("tiny", "bf16", {"pipeline": 4, "fsdp": 2}, schedule="1f1b",
                             **{"remat.policy": "minimal_offloaded"})
  np.testing.assert_allclose(piped, one, rtol=1e-5)
  assert rel < 1e-5, rel
  spaces = {str(a.memory_space) for a in _ring("minimal_offloaded")}
  assert spaces == {"MemorySpace.Host", "MemorySpace.Device"}, spaces


def test_bubble_fraction():
  assert pipeline.bubble_fraction(8, 4) == pytest.approx(3 / 11)
  assert pipeline.bubble_fraction(16, 1) == 0
  assert pipeline.bubble_fraction(8, 4, "1f1b") == pytest.approx(3 / 11)
  assert pipeline.bubble_fraction(128, 8, "interleaved_1f1b", 5) == pytest.approx(7 / 647)  # (S - 1) / (MV + S - 1)


@pytest.mark.parametrize("stages,virtual", [(2, 2), (4, 3), (8, 5), (4, 4)])
def test_chunks_reach_their_stages_and_back(stages, virtual):
  """`pipeline.to_chunks`: stage s ends with virtual stages s, S + s, 2S + s, ... of the model's layer rows, and
  the inverse restores the rows."""
  rows = 2 * stages * virtual
  layers = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:stages]), ("pipeline",))
  spec = jax.sharding.PartitionSpec("pipeline")
  moved = jax.jit(jax.shard_map(lambda a: pipeline.to_chunks(a, stages, virtual), mesh=mesh, in_specs=spec,
                                out_specs=spec))(layers)
  chunk_of = np.arange(rows) // 2  # Two rows a chunk; stage-major: stage s's chunks v S + s.
  order = np.concatenate([np.flatnonzero(chunk_of % stages == s) for s in range(stages)])
  np.testing.assert_array_equal(np.asarray(moved), layers[order])
  back = jax.jit(jax.shard_map(lambda a: pipeline.to_chunks(a, stages, virtual, inverse=True), mesh=mesh,
                               in_specs=spec, out_specs=spec))(moved)
  np.testing.assert_array_equal(np.asarray(back), layers)


@pytest.mark.parametrize("micro,stages,virtual", [(8, 4, 1), (3, 4, 1), (8, 2, 2), (16, 4, 3), (32, 8, 5)])
def test_schedule_runs_each_pass_once_in_order(micro, stages, virtual):
  """The 1F1B ticks (`pipeline.forward_unit` / `backward_unit`): every (micro-batch, chunk) forward and backward
  exactly once on each stage, its forward a tick after the virtual stage before it, its backward a tick after the
  virtual stage after it and not before its own forward; no backward pass in the warm-up ticks, no forward pass
  in the cool-down ones; at most `in_flight` residuals kept, each in a ring slot no other holds meanwhile."""
  ticks = pipeline.loop_length(micro, stages, "1f1b", virtual)
  warm, steady, _ = pipeline.phases(micro, stages, virtual)
  fwd, bwd = {}, {}
  for tau in range(ticks):
    for s in range(stages):
      for table, fn in ((fwd, pipeline.forward_unit), (bwd, pipeline.backward_unit)):
        f, v, has = (int(a) for a in fn(tau, s, micro, stages, virtual))
        if has:
          assert (f, v * stages + s) not in table
          table[(f, v * stages + s)] = tau
          assert tau < warm + steady if fn is pipeline.forward_unit else tau >= warm
  depth = stages * virtual
  assert set(fwd) == set(bwd) == {(f, c) for f in range(micro) for c in range(depth)}
  for (f, c), tau in fwd.items():
    assert c == 0 or fwd[(f, c - 1)] == tau - 1
    assert bwd[(f, c)] >= tau
    assert c == depth - 1 or bwd[(f, c + 1)] == bwd[(f, c)] - 1
  assert bwd[(0, depth - 1)] == warm  # The first backward pass opens the steady ticks.
  # The LM head runs in the steady ticks where the last stage's forward pass ends a micro-batch, and only there.
  ends = {tau for (f, c), tau in fwd.items() if c == depth - 1}
  runs = pipeline.steady_runs(micro, stages, virtual)
  marked = np.repeat([head for _, head in runs], [length for length, _ in runs])
  assert sum(length for length, _ in runs) == steady
  assert {warm + i for i in np.flatnonzero(marked)} == ends
  # Each tick's output and gradient (padding or not) plus, in each tick with the head, a share of it and back.
  transfers = ticks + steady + len(ends) * 2 * (stages - 1) / stages
  assert pipeline.stage_transfers(micro, stages, "1f1b", virtual) == pytest.approx(transfers)
  period, repeats = pipeline.periods(runs)
  assert runs[:len(period) * repeats] == period * repeats
  # The ring: a slot is held from a forward pass's tick through its backward pass's (inclusive: a tick's forward
  # pass writes before its backward pass reads); no two passes held at once on any stage share one, and stage 0
  # holds as many at once as the ring has slots (so the ring is no larger than it must be).
  slot_of = pipeline.ring_table(micro, stages, virtual)
  held = []
  for s in range(stages):
    units = [(f, c) for f in range(micro) for c in range(s, depth, stages)]
    for tau in range(ticks):
      alive = [u for u in units if fwd[u] <= tau <= bwd[u]]
      slots = [slot_of[pipeline.forward_index(f, c // stages, stages, virtual)] for f, c in alive]
      assert len(set(slots)) == len(slots), (s, tau)
      held.append(len(alive))
    kept = max(sum(fwd[u] <= tau < bwd[u] for u in units) for tau in range(ticks))
    assert kept <= pipeline.in_flight(micro, stages, "1f1b", virtual)
  assert max(held) == pipeline.in_flight(micro, stages, "1f1b", virtual) == max(slot_of) + 1
  # Megatron's count for its interleaved schedule, (S - 1) 2 + (V - 1) S + 1 on the first stage, where micro-batches
  # fill it.
  assert pipeline.in_flight(micro, stages, "1f1b", virtual) == min(micro * virtual,
                                                                    (stages - 1) * 2 + (virtual - 1) * stages + 1)


@pytest.mark.parametrize("overrides,key", [
    ({"mesh.pipeline": 8, "mesh.fsdp": 1}, "config.mesh.pipeline: 8 stages are too many for the decoder's 4 blocks "
     "of 1 layer(s): padded to 8 rows (1 a chunk)"),
    ({"mesh.pipeline": 4, "mesh.fsdp": 2, "model.num_layers": 5},  # 8 rows, 2 a stage: stage 3 all padding.
     "config.mesh.pipeline: 4 stages are too many"),
    ({"mesh.pipeline": 4, "mesh.fsdp": 2, "train.grad_accum_steps": 2}, "config.train.grad_accum_steps: 2"),
    ({"mesh.pipeline": 4, "mesh.fsdp": 2, "pipeline.virtual_stages": 2}, "config.pipeline.virtual_stages: 2"),
    ({"mesh.pipeline": 4, "mesh.fsdp": 2, "pipeline.schedule": "interleaved_1f1b", "pipeline.virtual_stages": 2},
     "config.mesh.pipeline: 4 stages x 2 chunks are too many"),
    ({"mesh.pipeline": 2, "mesh.fsdp": 4, "pipeline.schedule": "interleaved_1f1b", "pipeline.virtual_stages": 2,
      "train.grad_accum_steps": 3, "train.batch_size": 24}, "config.train.grad_accum_steps: 3"),
    ({"mesh.pipeline": 4, "mesh.fsdp": 1, "mesh.context": 2, "pipeline.schedule": "1f1b", "model.seq_len": 12},
     "config.model.seq_len: 12 positions do not split over the 4 stages that share the LM head under 1F1B, on each "
     "of 2 context devices"),
    ({"mesh.pipeline": 4, "mesh.fsdp": 2, "quant.recipe": "fp8_current", "quant.exclude": ("layers[-1:]",)},
     "config.mesh.pipeline: 4 stages are too many for the 3 blocks of 1 layer(s) in the longest of the decoder's 2 "
     "scan segments (the others run whole on the first or the last stage): padded to 4 rows"),
    ({"mesh.pipeline": 8, "mesh.fsdp": 1, "model.num_layers": 10, "quant.recipe": "fp8_current",
      "quant.exclude": ("layers[0:3]",)},  # 3 + 7 blocks in 8 stages: 16 rows, 2 a stage.
     "config.mesh.pipeline: stage 0 runs the 3 blocks before the 7 blocks of 1 layer(s) in the longest"),
    ({"mesh.pipeline": 4, "mesh.fsdp": 2, "model.mtp_depth": 1}, "config.pipeline.schedule: multi-token prediction"),
    ({"mesh.pipeline": 4, "mesh.fsdp": 1, "mesh.context": 2, "model.mtp_depth": 1, "pipeline.schedule": "1f1b"},
     "config.mesh.pipeline: multi-token prediction (model.mtp_depth) does not run with context parallelism"),
    ({"mesh.pipeline": 4, "mesh.fsdp": 2, "quant.recipe": "bf16", "quant.exclude": ("lm_head", "layers[-1:]"),
      "quant.schedule": ((5, {"recipe": "fp8_current"}),)},  # One segment under bf16; fp8 splits layer 3 off.
     "config.mesh.pipeline: 4 stages are too many for the 3 blocks of 1 layer(s) in the longest of the decoder's 2 "
     "scan segments from step 5"),
])
def test_bad_pipeline_layouts_name_the_key(overrides, key):
  with pytest.raises(ConfigError) as e:
    config_lib.validate(_cfg(**{"mesh.data": 1, **overrides}), 8)
  assert str(e.value).startswith(key), str(e.value)


@pytest.mark.parametrize("schedule", ONE_EXTENDED)
@pytest.mark.long
def test_health_statistics_are_one_devices(schedule):
  """log.quant_stats_every: a pipelined step's health statistics (each stage's layers', combined over the
  micro-batches, bubbles left out) equal one device's over the same micro-batches."""
  over = {"quant.recipe": "fp8_delayed", "log.quant_stats_every": 1, "pipeline.schedule": schedule}
  cfg = _cfg(**over)
  batch = helpers.random_batch(cfg)
  one, _ = helpers.one_step(cfg, {k: v[_same_micro_batches(16, 2)] for k, v in batch.items()}, 1)
  piped, _ = helpers.one_step(_cfg(**over, **{"mesh.pipeline": 4, "mesh.fsdp": 2, "mesh.data": 1}), batch, 8)
  # Amaxes and scales to float32 rounding; counts (underflow: gradients below FP8's smallest value) to 1e-3, as
  # a gradient summed in another order moves a few values across the threshold.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=1e-3, atol=1e-6), one["quant_stats"],
               piped["quant_stats"])
  jax.tree.map(lambda a, b: np.testing.assert_allclose(b[..., :2], a[..., :2], rtol=1e-5), one["quant_stats"],
               piped["quant_stats"])
  assert max(float(np.max(np.abs(a))) for a in jax.tree.leaves(one["quant_stats"])) > 0


@pytest.mark.parametrize("schedule, virtual", [("1f1b", 1), ("interleaved_1f1b", 2)])
def test_evaluation_runs_through_the_stages(schedule, virtual):
  """The eval step on pipeline 2 x fsdp 2 gives one device's eval loss, and holds no more than a train step:
  run whole, it gathered every stage's layers onto each device (on a 70B model, the whole model's float32
  parameters on each GPU)."""
  from ember.trainer import step as step_lib
  # Unquantized: a current-scaling amax is per micro-batch, and the stages' micro-batches hold other rows.
  overrides = {"model.num_layers": 8, "train.batch_size": 8, "train.grad_accum_steps": 4, "quant.recipe": "bf16"}
  batch = helpers.random_batch(_cfg(**overrides))
  losses, gathers = [], []
  for name, devices, extra in (("one", 1, {}), ("piped", 4, {"mesh.pipeline": 2, "mesh.fsdp": 2, "mesh.data": 1,
                                                            "pipeline.schedule": schedule,
                                                            "pipeline.virtual_stages": virtual})):
    s = helpers.start(_cfg(**overrides, **extra), devices)
    with s.rules():
      rows = jax.device_put(batch, batch_sharding(s.cfg.mesh.rules_dict, s.mesh))
      compiled = step_lib.jit_eval_step(s.cfg, s.mesh, s.graphdef, s.shardings).lower(s.state, rows).compile()
      losses.append(float(compiled(s.state, rows)))
      if name == "piped":
        gathers = [line for line in compiled.as_text().splitlines() if " all-gather" in line]
  np.testing.assert_allclose(losses[1], losses[0], rtol=1e-6)
  # No gather brings a stacked kernel's 8 layers (both stages' rows) onto a device: each stage reads its own 4.
  whole = [g for g in gathers if re.search(r"= \(?\w+\[8,", g)]
  assert gathers and not whole, whole[:2]


def test_a_layout_mostly_of_padding_is_warned_about(capsys):
  """9 layers in 2 stages x 4 chunks: 16 rows, 7 of them idle layers every step (the planner plans none past
  5%); a stage count that divides the layers gets no warning."""
  overrides = {"model.num_layers": 9, "mesh.pipeline": 2, "mesh.fsdp": 4, "mesh.data": 1, "train.batch_size": 8,
               "train.grad_accum_steps": 2}
  config_lib.validate(_cfg(**overrides, **{"pipeline.schedule": "interleaved_1f1b", "pipeline.virtual_stages": 4}), 8)
  assert "2 stages x 4 chunks pad the decoder's 9 blocks to 16 rows: 7 idle layers (78% of the model)" in \
      capsys.readouterr().err
  config_lib.validate(_cfg(**{**overrides, "model.num_layers": 8}), 8)
  assert "idle layers" not in capsys.readouterr().err
