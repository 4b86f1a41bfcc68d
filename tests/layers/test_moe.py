"""The MoE layer on one device: routing, losses, dispatch, capacity, remat residuals, FLOPs."""

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ember import config as config_lib
from ember import remat
from ember.quant import health
from ember.quant.dot import takes_kernel_copies
from ember.layers.moe import MoE, keep_mask
from ember.names import AUX_KEYS
from ember.parallel.mesh import make_mesh
from ember.parallel.sharding import use_rules
from ember.plan import layer as analysis
from ember.plan.jaxpr import iter_eqns
from ember.trainer import perf
from ember.errors import ConfigError
from tests import helpers
from tests.helpers import config

F32 = jnp.float32


def _cfg(**overrides):
  cfg = config("tiny_moe", **{"model.dtype": "float32", "quant.recipe": "bf16", "mesh.fsdp": 1, **overrides})
  return config_lib.derive(cfg, 1)


def _layer(cfg, seed=0):
  with nnx.use_eager_sharding(False):
    return MoE(cfg.model, recipe=cfg.quant, layer=0, rngs=nnx.Rngs(params=seed))


@pytest.mark.parametrize("k", [2, 1])  # k=2 first (the case run by default): top-1 cannot tell all choices counted.
@pytest.mark.variants
def test_load_balance_and_z_loss_match_the_formulas_on_a_hand_built_example(k):
  cfg = _cfg(**{"model.d_model": 8, "model.experts_per_token": k})
  layer = _layer(cfg)
  layer.router[...] = jnp.eye(8, 4, dtype=F32)  # Logits = the first four features.
  logits = np.array([[2, 0, 0.5, 0], [1, 0, 0, 0.5], [0, 3, 0, 1], [0, 0, 1, 0], [0, 0, 0, 9]], np.float32)
  x = jnp.zeros((1, 5, 8), F32).at[0, :, :4].set(logits)
  segment_ids = jnp.array([[1, 1, 2, 2, 0]])  # The last token is padding: it must count nowhere.
  _, aux = layer(x, segment_ids)
  real = logits[:4]
  probs = np.exp(real) / np.exp(real).sum(1, keepdims=True)
  chosen = np.argsort(-real, axis=1, kind="stable")[:, :k]  # k=1: experts 0, 0, 1, 2.
  f = np.bincount(chosen.reshape(-1), minlength=4) / (4 * k)
  expected_lb = 4 * np.sum(f * probs.mean(0))
  expected_z = np.mean(np.log(np.exp(real).sum(1)) ** 2)
  np.testing.assert_allclose(aux["moe_load_balance_loss"], expected_lb, rtol=1e-6)
  np.testing.assert_allclose(aux["moe_router_z_loss"], expected_z, rtol=1e-6)
  assert float(aux["moe_routed_tokens"]) == 4 * k and float(aux["moe_dropped_tokens"]) == 0
  loads = aux.pop("moe_expert_loads")  # The copies routed to each expert, [experts].
  np.testing.assert_array_equal(loads, np.bincount(chosen.reshape(-1), minlength=4))
  assert set(aux) == set(AUX_KEYS) and all(v.dtype == F32 and v.shape == () for v in aux.values())
  if k == 1:
    np.testing.assert_allclose(f, [0.5, 0.25, 0.25, 0.0])


def _inputs(cfg, seed=1):
  kx, kc = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(kx, (2, 16, cfg.model.d_model), F32)
  segment_ids = jnp.array([[1] * 7 + [2] * 9, [1] * 12 + [0] * 4])
  return x, segment_ids, jax.random.normal(kc, x.shape, F32)


def test_dropless_routes_every_real_copy_deterministically():
  cfg = _cfg()
  x, segment_ids, _ = _inputs(cfg)
  run = jax.jit(lambda state: nnx.merge(*state)(x, segment_ids))
  y1, aux1 = run(nnx.split(_layer(cfg)))
  y2, aux2 = run(nnx.split(_layer(cfg)))  # A fresh layer from the same seed.
  np.testing.assert_array_equal(y1, y2)
  real = int(jnp.sum(segment_ids > 0))
  assert float(aux1["moe_dropped_tokens"]) == 0
  assert float(aux1["moe_routed_tokens"]) == real * cfg.model.experts_per_token
  assert not np.any(y1[1, 12:])  # Padding is not dispatched (and there is no shared expert).
  y3, _ = run(nnx.split(_layer(cfg, seed=1)))
  assert not np.allclose(y1, y3)


def _dense_reference(layer: MoE, cfg, x, segment_ids):
  """Every expert on every token, weighted by a dense [tokens, experts] routing matrix."""
  m = cfg.model
  t = x.shape[0] * x.shape[1]
  x_TxD = x.reshape(t, -1)
  logits = x_TxD @ layer.router[...]
  if m.router_softmax_first:
    top, idx = jax.lax.top_k(jax.nn.softmax(logits), m.experts_per_token)
    weights = top / top.sum(-1, keepdims=True)
  else:
    top, idx = jax.lax.top_k(logits, m.experts_per_token)
    weights = jax.nn.softmax(top)
  combine_TxE = jnp.sum(jax.nn.one_hot(idx, m.num_experts) * weights[..., None], axis=1)
  combine_TxE = combine_TxE * (segment_ids.reshape(t, 1) > 0)
  h_ExTx2xF = jnp.einsum("td,edgf->etgf", x_TxD, layer.wi.kernel[...])
  y_ExTxD = jnp.einsum("etf,efd->etd", jax.nn.silu(h_ExTx2xF[:, :, 0]) * h_ExTx2xF[:, :, 1], layer.wo.kernel[...])
  y = jnp.einsum("te,etd->td", combine_TxE, y_ExTxD).reshape(x.shape)
  return y + layer.shared(x) if layer.shared is not None else y


@pytest.mark.parametrize("softmax_first", [False, True])
@pytest.mark.variants
def test_layer_and_its_gradients_equal_a_dense_reference(softmax_first):
  cfg = _cfg(**{"model.router_softmax_first": softmax_first, "model.shared_expert_d_ff": 32})
  layer = _layer(cfg)
  x, segment_ids, ct = _inputs(cfg)
  graphdef, state = nnx.split(layer)

  @jax.jit
  def grads(state, x):
    f = lambda s, x: jnp.sum(nnx.merge(graphdef, s)(x, segment_ids)[0] * ct)
    r = lambda s, x: jnp.sum(_dense_reference(nnx.merge(graphdef, s), cfg, x, segment_ids) * ct)
    return jax.value_and_grad(f, argnums=(0, 1))(state, x), jax.value_and_grad(r, argnums=(0, 1))(state, x)

  (out, (g_state, g_x)), (out_ref, (g_state_ref, g_x_ref)) = grads(state, x)
  np.testing.assert_allclose(out, out_ref, rtol=1e-5)
  np.testing.assert_allclose(g_x, g_x_ref, rtol=1e-4, atol=1e-5)
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g_state)[0], jax.tree.leaves(g_state_ref)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=jax.tree_util.keystr(path))
  assert np.any(g_state["router"][...] != 0)


def test_capacity_keeps_first_choices_first_then_token_order():
  experts = jnp.array([[0, 1], [0, 2], [0, 1], [1, 0]])
  keep = keep_mask(experts, jnp.array([True, True, True, True]), num_experts=3, capacity=2)
  # First choices: expert 0 takes tokens 0 and 1 (token 2 dropped), expert 1 takes token 3. Second
  # choices: expert 1 has room for token 0 (then full: token 2 dropped), expert 2 takes token 1,
  # expert 0 is full (token 3 dropped).
  np.testing.assert_array_equal(keep, [[True, True], [True, True], [False, False], [True, False]])
  keep = keep_mask(experts, jnp.array([False, True, True, True]), num_experts=3, capacity=2)
  np.testing.assert_array_equal(keep, [[False, False], [True, True], [True, True], [True, False]])


def test_capacity_factor_drops_and_counts():
  """Capacity ceil(0.5 * 32 tokens * 2 / 4 experts) = 8 copies per expert, filled in priority order (every
  token's first choice in token order, then the second choices): the routed and dropped counts equal those of
  that rule played out here in NumPy on the layer's own router."""
  cfg = _cfg(**{"model.capacity_factor": 0.5})
  x, segment_ids, _ = _inputs(cfg)
  layer = _layer(cfg)
  y, aux = jax.jit(lambda s: nnx.merge(*s)(x, segment_ids))(nnx.split(layer))
  logits = np.asarray(x, np.float64).reshape(32, -1) @ np.asarray(layer.router[...], np.float64)
  choices = np.argsort(-logits, axis=1, kind="stable")[:, :2]
  valid = np.asarray(segment_ids).reshape(-1) > 0
  taken, kept = np.zeros(4, int), 0
  for j in range(2):
    for t in np.flatnonzero(valid):
      e = choices[t, j]
      if taken[e] < 8:
        taken[e], kept = taken[e] + 1, kept + 1
  real = int(valid.sum()) * 2
  assert 0 < kept < real  # The example does drop.
  assert float(aux["moe_routed_tokens"]) == kept and float(aux["moe_dropped_tokens"]) == real - kept
  assert np.all(np.isfinite(y))


@pytest.mark.parametrize("recipe", ["fp8_current", "fp8_delayed", "mxfp8", "nvfp4"])
@pytest.mark.variants
def test_save_quantized_recomputes_no_quantize_op_in_an_moe_block(recipe):
  """One MoE block (with a shared expert) under `save_quantized`: its residuals are the block input
  and low-precision tensors with their scales only (the experts' kernels among them, and the shared expert's
  where it is not quantized once a step), and its backward pass casts nothing to a low-precision format except
  gradients (the vjp function's jaxpr, recompute included)."""
  cfg = config_lib.derive(config("tiny_moe", **{"quant.recipe": recipe, "model.shared_expert_d_ff": 32,
                                                "mesh.fsdp": 1}), 1)
  problem = analysis.layer_problem(cfg, batch=2)
  traced = {p: analysis.trace_layer(problem, remat.PRESETS[p]) for p in ("none", "full", "save_quantized")}
  saved = traced["save_quantized"]
  assert saved.backward.quantize_ops == 0
  assert saved.backward.gradient_quantize_ops == traced["none"].backward.gradient_quantize_ops > 0
  assert traced["full"].backward.quantize_ops > 0  # Without the names, the recompute would quantize.
  names = {r.name for r in saved.residuals}
  assert names - {remat.LAYER_INPUT, remat.MOE_ROUTING} <= set(remat.QUANTIZED_NAMES), names
  assert remat.MOE_ROUTING in names  # The routing the saved rows are ordered by (see the next test).
  for projection in ("moe_wi", "moe_wo", "shared_wi"):
    # A dense kernel under a per-tensor recipe is quantized once a step, outside the block (linear.once_a_step).
    ahead = projection == "shared_wi" and takes_kernel_copies(cfg.quant, False)
    assert (remat.quantized_name(projection, "kernel") in names) != ahead, projection
  assert remat.quantized_name("moe_wi", "x") in names
  for r in saved.residuals:
    if r.name != remat.LAYER_INPUT:  # Bit patterns of low-precision data, or float32 scales (per expert).
      assert r.dtype in ("uint8", "uint4") or (r.dtype == "float32" and len(r.shape) <= 1), r


def _backward_primitives(fn, args) -> collections.Counter:
  """Primitives of the backward pass alone, counted: the jaxpr of the vjp function (recompute included)."""
  leaves, tree = jax.tree.flatten(args)
  fwd = lambda *leaves: jax.vjp(fn, *jax.tree.unflatten(tree, leaves))
  _, (out_shape, vjp_shape) = jax.make_jaxpr(fwd, return_shape=True)(*leaves)
  residuals, vjp_tree = jax.tree.flatten(vjp_shape)
  bwd = jax.make_jaxpr(lambda r, ct: jax.tree.unflatten(vjp_tree, r)(ct))(residuals, out_shape)
  return collections.Counter(e.primitive.name for e in iter_eqns(bwd.jaxpr))


@pytest.mark.parametrize("dispatch", ["alltoall", "ragged"])
def test_minimal_quantized_sends_nothing_again_under_expert_parallelism(dispatch):
  """Under expert parallelism the backward pass of `minimal_quantized` exchanges what `none`'s does (the
  gradients, there and back) and nothing more: the experts' outputs back in token order (`moe_combine`, what the
  combine's weight gradient reads) and the exchange's counts (`moe_routing`) are kept, not sent again. They were
  not: it ran two all-to-alls more than `none` (alltoall: the expert outputs' way back and the routing integers),
  three and an all-gather more (ragged)."""
  cfg = config_lib.derive(config("tiny_moe", **{"quant.recipe": "fp8_current", "mesh.data": 2, "mesh.fsdp": 1,
                                                "mesh.expert": 4, "model.moe_dispatch": dispatch}), 8)
  with use_rules(make_mesh(cfg.mesh), cfg.mesh.rules):
    problem = analysis.layer_problem(cfg, batch=8)
    counts = {name: _backward_primitives(analysis.layer_fn(problem.graphdef, remat.PRESETS[name]),
                                         analysis.layer_args(problem, remat.PRESETS[name]))
              for name in ("none", "minimal_quantized")}
  moved = lambda c: (c["all_to_all"], c["ragged_all_to_all"], c["all_gather"])
  assert moved(counts["minimal_quantized"]) == moved(counts["none"]) and counts["none"]["all_to_all"] > 0


def test_saved_rows_come_with_their_routing():
  """A policy that saves the grouped GEMMs' quantized rows must not recompute the routing: a
  recomputed top-k need not be bitwise the forward's (XLA may keep excess precision in a fusion),
  and a flipped near tie would reorder rows under the saved operands (seen at batch 64: expert
  gradients 100% off). So the backward pass of `save_quantized` has no top_k; `full`'s has."""
  cfg = config_lib.derive(config("tiny_moe", **{"quant.recipe": "fp8_current", "mesh.fsdp": 1}), 1)
  problem = analysis.layer_problem(cfg, batch=2)
  for name, recomputes_routing in (("save_quantized", False), ("full", True)):
    fn = analysis.layer_fn(problem.graphdef, remat.PRESETS[name])
    assert ("top_k" in _backward_primitives(fn, analysis.layer_args(problem, remat.PRESETS[name]))) == \
        recomputes_routing, name


@pytest.mark.parametrize("dispatch,expert_gemm,recipe,stats", [
    ("allgather", "ragged_dot", "nvfp4", 0), ("alltoall", "ragged_dot", "nvfp4", 0),
    ("ragged", "ragged_dot", "nvfp4", 0), ("ragged", "capacity", "nvfp4", 0),
    # FP8 rows cross the expert axis quantized: the combine's gradient is cast to E5M2 for the exchange back, a
    # gradient's cast (it was counted as a forward quantize recomputed under every policy, `none` too).
    ("alltoall", "ragged_dot", "fp8_current", 0),
    # With health statistics the wire measures the rows it quantizes: kept with their quantized copy (unnamed, the
    # copies were quantized again to measure them).
    ("ragged", "ragged_dot", "fp8_current", 1)])
@pytest.mark.variants
def test_save_quantized_recomputes_no_quantize_op_under_expert_parallelism(dispatch, expert_gemm, recipe, stats):
  cfg = config_lib.derive(config("tiny_moe", **{"quant.recipe": recipe, "mesh.data": 2, "mesh.fsdp": 1,
                                                "mesh.expert": 4, "model.moe_dispatch": dispatch,
                                                "model.moe_expert_gemm": expert_gemm,
                                                "log.quant_stats_every": stats}), 8)
  with use_rules(make_mesh(cfg.mesh), cfg.mesh.rules):
    problem = analysis.layer_problem(cfg, batch=8)
    saved = analysis.trace_layer(problem, remat.PRESETS["save_quantized"])
  assert saved.backward.quantize_ops == 0 and saved.backward.gradient_quantize_ops > 0
  for r in saved.residuals:
    # The layer input, the low-precision copies, scalars and vectors, and the exchange's routing integers (the
    # counts it sent, kept with the rows they place: moe_dispatch.saved_routing).
    # With statistics, the per-expert kernels' health rows [E, STATS] too.
    assert r.name == remat.LAYER_INPUT or r.dtype in ("uint8", "uint4", "int32") or len(r.shape) <= 1 or \
        (stats and r.shape[-1] == health.NUM_STATS), r
    # Named where the shard_map's body made them (the trace reported "shard_map (moe.py:...)" for every one).
    assert len(r.shape) <= 1 or r.name in remat.ALL_NAMES + (remat.MOE_ROUTING,), r
  assert {"quantized.moe_wi.x", "quantized.moe_wo.kernel"} <= {r.name for r in saved.residuals}


def test_flops_count_active_experts_only():
  m = _cfg().model
  base = perf.forward_flops_per_token(m)
  # More experts at the same top-k add only the router's columns.
  more_experts = dataclasses.replace(m, num_experts=2 * m.num_experts)
  assert perf.forward_flops_per_token(more_experts) - base == 2 * m.num_layers * m.d_model * m.num_experts
  top1 = dataclasses.replace(m, experts_per_token=1)
  assert base - perf.forward_flops_per_token(top1) == 2 * m.num_layers * 3 * m.d_model * m.d_ff


@pytest.mark.parametrize("score, softmax_first", [("softmax", True), ("sigmoid", False)])
def test_unrenormalised_weights_are_the_top_k_probabilities(score, softmax_first):
  """model.norm_topk_prob=False (DeepSeekMoE, Qwen2-MoE): the chosen experts' softmax probabilities (or sigmoids)
  as they are, times the scaling factor; with it, the same renormalised to sum to the factor."""
  from ember.layers.moe import Options, route
  from ember.quant.recipe import Recipe
  rng = np.random.default_rng(0)
  x, router = rng.normal(size=(32, 8)).astype(np.float32), rng.normal(size=(8, 16)).astype(np.float32)
  logits = x.astype(np.float64) @ router
  probs = np.exp(logits - logits.max(-1, keepdims=True)) if score == "softmax" else 1 / (1 + np.exp(-logits))
  probs = probs / probs.sum(-1, keepdims=True) if score == "softmax" else probs
  top = np.sort(np.argsort(-probs, axis=-1)[:, :4], axis=-1)
  chosen = np.take_along_axis(probs, top, axis=-1)
  for norm, want in ((False, 2.5 * chosen), (True, 2.5 * chosen / chosen.sum(-1, keepdims=True))):
    opts = Options(num_experts=16, k=4, softmax_first=softmax_first, dtype=jnp.float32, wi_recipe=Recipe(name="bf16"),
                   wo_recipe=Recipe(name="bf16"), score=score, scale=2.5, norm_topk=norm)
    _, _, weights, experts = jax.device_get(route(jnp.asarray(x), jnp.asarray(router), opts))
    order = np.argsort(experts, axis=-1)
    np.testing.assert_array_equal(np.take_along_axis(experts, order, -1), top)
    np.testing.assert_allclose(np.take_along_axis(weights, order, -1), want, rtol=1e-5)


def test_mixtrals_router_cannot_leave_its_weights_unrenormalised():
  with pytest.raises(ConfigError, match=r"config.model.norm_topk_prob: false needs model.router_softmax_first"):
    helpers.settings("tiny_moe", 1, **{"model.norm_topk_prob": False})
