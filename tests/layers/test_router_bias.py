"""The DeepSeek-V3 router bias (model.router_bias_update_rate): the choice moves, the weights do not; the update
rule by hand; balance it buys; the same biases on one device and under expert parallelism."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ember.data.pipeline import data_iterator, global_batch
from ember.layers.moe import Options, route
from ember.parallel.sharding import batch_sharding
from ember.quant.recipe import Recipe
from ember.trainer import step as step_lib
from tests import helpers


def _options(softmax_first: bool) -> Options:
  return Options(num_experts=4, k=2, softmax_first=softmax_first, dtype=jnp.float32,
                 wi_recipe=Recipe(), wo_recipe=Recipe())


@pytest.mark.parametrize("softmax_first", [False, True])
def test_the_bias_moves_the_choice_and_never_the_weights(softmax_first):
  """One token whose router logits are [2, 1, 0.5, 0] (x = e_0, router rows = logits): top-2 is {0, 1}; a bias of
  +5 on expert 2 makes it {0, 2}, and the weights are the unbiased scores' at {0, 2}."""
  logits = np.array([2.0, 1.0, 0.5, 0.0], np.float32)
  x, router = jnp.eye(4, dtype=jnp.float32)[:1], jnp.asarray(np.tile(logits, (4, 1)) * np.eye(4)[:, :1])
  opts = _options(softmax_first)
  _, _, weights, experts = route(x, router, opts)
  assert sorted(np.asarray(experts)[0].tolist()) == [0, 1]
  _, _, weights, experts = route(x, router, opts, jnp.asarray([0.0, 0.0, 5.0, 0.0]))
  chosen = np.asarray(experts)[0]
  assert sorted(chosen.tolist()) == [0, 2]
  if softmax_first:
    p = np.exp(logits) / np.exp(logits).sum()
    want = p[chosen] / p[chosen].sum()
  else:
    want = np.exp(logits[chosen]) / np.exp(logits[chosen]).sum()
  np.testing.assert_allclose(np.asarray(weights)[0], want, rtol=1e-6)


def test_the_update_rule_by_hand():
  """Interleaved tiny_moe (4 layers, MoE at 1 and 3): each MoE layer's bias moves by rate * sign(mean - load) of
  its own row of loads; the amax histories and the dense layers are untouched."""
  s = helpers.start(helpers.config("tiny_moe", **{"model.num_layers": 4, "model.moe_every": 2,
                                                  "model.router_bias_update_rate": 0.25,
                                                  "quant.recipe": "fp8_delayed"}))
  quant = s.state.quant_state
  loads = jnp.asarray([[0, 0, 0, 0], [10, 2, 2, 2], [0, 0, 0, 0], [1, 3, 4, 4]], jnp.float32)  # Means 4 and 3.
  zeros = jax.tree.map(jnp.zeros_like, quant)
  new = step_lib.update_router_biases(quant, zeros, loads, s.cfg.model, s.cfg.quant)
  bias = new["segments"][0]["blocks"]["layers"][1]["moe"]["router_bias"]  # [blocks, experts]: layers 1 and 3.
  np.testing.assert_array_equal(np.asarray(bias), [[-0.25, 0.25, 0.25, 0.25], [0.25, 0.0, -0.25, -0.25]])
  others = [(p, a) for p, a in jax.tree_util.tree_leaves_with_path(new) if "router_bias" not in jax.tree_util.keystr(p)]
  assert others and all(not np.any(np.asarray(a)) for _, a in others)  # As the step gave them (zeros here).


def _imbalance(rate: float, steps: int = 80) -> float:
  """tiny_moe on text (the default corpus) without the load-balancing loss: the mean of moe_load_max_over_mean
  over the last 20 of `steps` steps."""
  cfg = helpers.config("tiny_moe", **{"model.router_bias_update_rate": rate, "model.load_balance_weight": 0.0,
                                      "quant.recipe": "bf16", "train.batch_size": 8, "train.warmup_steps": 0,
                                      "data.source": "text", "steps": steps})
  s = helpers.start(cfg)
  step = step_lib.jit_train_step(s.cfg, s.mesh, s.graphdef, s.tx, s.schedule, s.shardings)
  state, seen, batches = s.state, [], data_iterator(s.cfg, "train")
  try:
    with s.rules():
      for _ in range(steps):
        state, metrics = step(state, global_batch(next(batches), batch_sharding(s.cfg.mesh.rules_dict, s.mesh),
                                                  s.cfg.train.batch_size))
        seen.append(float(metrics["moe_load_max_over_mean"]))
  finally:
    batches.close()
  return float(np.mean(seen[-20:]))


@pytest.mark.extended
def test_the_bias_balances_the_experts_without_an_auxiliary_loss():
  off, on = _imbalance(0.0), _imbalance(0.01)
  assert on < off, (on, off)


@pytest.mark.extended
def test_the_same_biases_and_losses_under_expert_parallelism():
  """Three steps of tiny_moe (float32) with the bias on, one device against expert=4 x data=2 with each
  dispatcher: the same losses, and the same biases after them (the loads are summed over the data shards)."""
  over = {"model.router_bias_update_rate": 0.01, "quant.recipe": "bf16", "model.dtype": "float32",
          "train.batch_size": 8, "train.warmup_steps": 0}
  batches = [helpers.random_batch(helpers.config("tiny_moe", **over), seed=i) for i in range(3)]

  def run(num_devices, **mesh):
    s = helpers.start(helpers.config("tiny_moe", **over, **mesh), num_devices)
    step = step_lib.jit_train_step(s.cfg, s.mesh, s.graphdef, s.tx, s.schedule, s.shardings, donate=False)
    state, losses = s.state, []
    with s.rules():
      for b in batches:
        sharding = batch_sharding(s.cfg.mesh.rules_dict, s.mesh)
        state, metrics = step(state, {k: jax.device_put(v, sharding) for k, v in b.items()})
        losses.append(float(metrics["loss"]))
    return losses, np.asarray(state.quant_state["segments"][0]["blocks"]["layers"][0]["moe"]["router_bias"])

  one_losses, one_bias = run(1)
  assert np.any(one_bias)
  for dispatch in ("allgather", "alltoall", "ragged"):
    losses, bias = run(8, **{"mesh.data": 2, "mesh.fsdp": 1, "mesh.expert": 4, "model.moe_dispatch": dispatch})
    np.testing.assert_allclose(losses, one_losses, rtol=1e-5)
    np.testing.assert_array_equal(bias, one_bias)
