"""DeepSeek-V3-class models (the deepseek_tiny preset): latent attention, grouped sigmoid routing, shared experts,
multi-token prediction. Hugging Face equality is in tests/hf/test_hf.py (its "deepseek" kind)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ember import config as config_lib
from ember import remat
from ember.layers import moe as moe_lib
from ember.layers import moe_dispatch
from ember.layers.moe import Options, route
from ember.parallel.sharding import batch_sharding
from ember.plan import layer as analysis
from ember.quant.recipe import Recipe
from ember.trainer.loop import train
from ember.trainer.metrics import read_records
from ember.trainer.perf import forward_flops_per_token
from ember.trainer.step import forward_loss, moe_plan
from tests import helpers

PRESET = "deepseek_tiny"


def _cfg(**overrides):
  # 32 positions, half the preset's: five CPU steps of each layout in half the time.
  return helpers.config(PRESET, **{"model.dtype": "float32", "model.seq_len": 32, "train.batch_size": 8,
                                   "train.warmup_steps": 1, **overrides})


def _train_metrics(cfg, batches, num_devices):
  """(loss, mtp_loss) of each of len(batches) train steps on the first `num_devices` devices."""
  metrics, _ = helpers.run_steps(cfg, batches, num_devices)
  return np.asarray([(float(m["loss"]), float(m["mtp_loss"])) for m in metrics])


@pytest.mark.parametrize("recipe", ["bf16", pytest.param("fp8_current", marks=pytest.mark.extended)])
@pytest.mark.long
def test_expert4_fsdp2_trains_like_one_device(recipe):
  """Five steps on 8 devices (expert 4 x fsdp 2: the experts split four ways, every weight sharded over fsdp) give
  one device's losses and MTP losses, float32, the router biases moving each step."""
  cfg = _cfg(**{"quant.recipe": recipe, "train.learning_rate": 3e-4})
  batches = [helpers.random_batch(cfg, seed=s % 2) for s in range(5)]  # Batches 0, 1, 0, 1, 0.
  one = _train_metrics(cfg.copy_and_resolve_references(), batches, 1)
  sharded = _train_metrics(_cfg(**{"quant.recipe": recipe, "train.learning_rate": 3e-4, "mesh.data": 1,
                                   "mesh.fsdp": 2, "mesh.expert": 4}), batches, 8)
  # fp8_current too: at the preset's init (DeepSeek-V3's std 0.006) FP8's roundings do not amplify the 1e-7
  # differences of a sharded gradient sum (3.6e-7 at most); at 0.02 they flip and the routing carries the flips on
  # (5e-5 by step 5, docs/deepseek.md).
  np.testing.assert_allclose(sharded, one, rtol=1e-5)
  assert one[-1, 0] < one[0, 0] and one[-1, 1] < one[0, 1]  # The steps trained (batch 0's losses fell).


def _exhaustive_routing(logits, bias, n_group, topk_group, k, scale):
  """DeepSeek-V3's rule by enumeration: of every set of `topk_group` groups, the one whose groups' scores (each
  the sum of its two best biased sigmoids) sum highest; within it the k best biased sigmoids; the weights their
  unbiased sigmoids, renormalised and scaled."""
  scores = 1 / (1 + np.exp(-logits.astype(np.float64)))
  choice = scores + bias
  e = logits.shape[-1]
  size = e // n_group
  experts, weights = [], []
  for t in range(logits.shape[0]):
    group_score = [np.sort(choice[t, g * size:(g + 1) * size])[-2:].sum() for g in range(n_group)]
    best = max(itertools.combinations(range(n_group), topk_group), key=lambda gs: sum(group_score[g] for g in gs))
    allowed = [g * size + i for g in best for i in range(size)]
    top = sorted(allowed, key=lambda x: -choice[t, x])[:k]
    experts.append(sorted(top))
    w = scores[t, top] / scores[t, top].sum() * scale
    weights.append(dict(zip(top, w)))
  return experts, weights


def test_group_limited_routing_matches_an_exhaustive_search():
  """16 experts in 8 groups, top-4 within the best 3 groups, with a router bias: the choices and weights of
  `route` are those of an enumeration of the group sets, and no token's experts span more than 3 groups."""
  rng = np.random.default_rng(0)
  t, d, e = 64, 16, 16
  x, router = rng.normal(size=(t, d)).astype(np.float32), rng.normal(size=(d, e)).astype(np.float32)
  bias = (rng.normal(size=(e,)) * 0.5).astype(np.float32)
  opts = Options(num_experts=e, k=4, softmax_first=False, dtype=jnp.float32, wi_recipe=Recipe(name="bf16"),
                 wo_recipe=Recipe(name="bf16"), score="sigmoid", n_group=8, topk_group=3, scale=2.5)
  logits, probs, weights, experts = jax.device_get(route(jnp.asarray(x), jnp.asarray(router), opts,
                                                         jnp.asarray(bias)))
  want_experts, want_weights = _exhaustive_routing(x.astype(np.float64) @ router.astype(np.float64), bias, 8, 3, 4,
                                                   2.5)
  assert [sorted(row) for row in experts.tolist()] == want_experts
  for row_e, row_w, want in zip(experts, weights, want_weights):
    np.testing.assert_allclose(row_w, [want[i] for i in row_e], rtol=1e-5)
  assert max(len(set(row)) for row in (np.asarray(experts) // 2).tolist()) <= 3
  np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)  # What the balance loss reads: normalised scores.


@pytest.mark.long
def test_the_preset_routes_within_its_groups_on_eight_devices(monkeypatch):
  """deepseek_tiny's forward pass on the expert 4 x fsdp 2 mesh, its routing indices read where each device takes
  them (inside the MoE layers' shard_map): every token's two experts lie in at most topk_group = 2 of the 4
  groups, in every MoE layer and the prediction module's."""
  seen = []
  saved_routing = moe_dispatch.saved_routing

  def recorded(a, values=None):  # The expert choices ([T, k], of num_experts values), not an exchange's counts.
    if values == 8:
      jax.debug.callback(lambda e: seen.append(np.asarray(e)), a)
    return saved_routing(a, values)

  monkeypatch.setattr(moe_dispatch, "saved_routing", recorded)
  s = helpers.start(_cfg(**{"quant.recipe": "bf16", "model.init_std": 0.2, "mesh.data": 1, "mesh.fsdp": 2,
                            "mesh.expert": 4}), 8)
  cfg, m = s.cfg, s.cfg.model
  batch = helpers.random_batch(cfg, seed=3)
  sharding = batch_sharding(cfg.mesh.rules_dict, s.mesh)
  with s.rules():
    batch = {k: jax.device_put(v, sharding) for k, v in batch.items()}
    plan = moe_plan(cfg, s.mesh, 8)

    def loss(params, quant, batch):
      return forward_loss(params, quant, batch, graphdef=s.graphdef, cfg=cfg, key=None, moe_plan=plan)[0]

    jax.block_until_ready(jax.jit(loss)(s.state.params, s.state.quant_state, batch))
  moe_layers = m.num_routed_layers
  assert len(seen) == 8 * moe_layers  # Each device's tokens, in each MoE layer (the MTP module's included).
  groups = np.concatenate(seen) // (m.num_experts // m.n_group)
  assert max(len(set(row)) for row in groups.tolist()) <= m.topk_group
  assert len(np.unique(groups)) == m.n_group  # Tokens go to every group, each within its chosen two.


@pytest.mark.long
def test_mtp_leaves_the_main_loss_alone_and_predicts_two_ahead():
  """With mtp_depth=1 the main loss equals the model without MTP on the same parameters; the MTP loss is the
  prediction module's NLL of token i + 2 over positions whose token i + 2 is in their document, over the main
  loss's token count (recomputed here from the module's hidden states and the head by hand)."""
  over = {"quant.recipe": "bf16", "model.router_bias_update_rate": 0.0}
  s, s0 = helpers.start(_cfg(**over)), helpers.start(_cfg(**over, **{"model.mtp_depth": 0}))
  cfg, plain = s.cfg, s0.cfg
  batch = {k: jnp.asarray(v) for k, v in helpers.random_batch(cfg, seed=4, segments=3).items()}
  params = s.state.params
  without = {k: v for k, v in params.items() if k != "mtp"}
  _, metrics = forward_loss(params, s.state.quant_state, batch, graphdef=s.graphdef, cfg=cfg, key=None)
  _, metrics0 = forward_loss(without, s0.state.quant_state, batch, graphdef=s0.graphdef, cfg=plain, key=None)
  assert float(metrics["loss"]) == pytest.approx(float(metrics0["loss"]), rel=1e-6)

  model = nnx.merge(s.graphdef, params, s.state.quant_state)
  _, _, (h1,) = model.with_predictions(batch["inputs"], batch["segment_ids"], batch["positions"], batch["targets"])
  logits = np.asarray(h1 @ params["lm_head"]["kernel"], np.float64)
  seg, targets = np.asarray(batch["segment_ids"]), np.asarray(batch["targets"])
  nll = 0.0
  for b, i in zip(*np.nonzero(seg[:, :-1] == seg[:, 1:])):
    if seg[b, i] > 0:
      row = logits[b, i]
      nll += np.log(np.exp(row - row.max()).sum()) + row.max() - row[targets[b, i + 1]]
  want = nll / (seg > 0).sum()
  assert float(metrics["mtp_loss"]) == pytest.approx(want, rel=1e-5)
  balance = cfg.model.seq_load_balance_weight * float(metrics["moe_seq_balance_loss"])
  assert float(metrics["total_loss"]) == pytest.approx(
      float(metrics["loss"]) + cfg.model.mtp_loss_weight * want + balance, rel=1e-6)


def test_sequence_balance_loss_by_hand():
  """Per row: E / K * sum_i f_i P_i over its real tokens (f_i: its copies' share at expert i; P_i: its mean
  normalised score); the mean over rows that have tokens. A row routed evenly with even scores scores 1."""
  rng = np.random.default_rng(2)
  b, l, e, k = 3, 10, 8, 2
  probs = rng.dirichlet(np.ones(e), size=(b, l)).astype(np.float32)
  experts = np.stack([rng.choice(e, size=k, replace=False) for _ in range(b * l)]).reshape(b, l, k)
  valid = rng.random((b, l)) < 0.7
  valid[2] = False  # A row of padding alone counts in no mean.
  got = float(moe_lib.sequence_balance_loss(jnp.asarray(probs), jnp.asarray(experts), jnp.asarray(valid), (), ()))
  rows = []
  for r in range(2):
    t = valid[r].sum()
    f = np.asarray([(experts[r][valid[r]] == i).sum() for i in range(e)]) / (t * k)
    p = probs[r][valid[r]].sum(0) / t
    rows.append(e * np.sum(f * p))
  assert got == pytest.approx(np.mean(rows), rel=1e-6)
  even = np.full((1, 8, e), 1 / e, np.float32)
  experts_even = np.arange(8 * k).reshape(1, 8, k) % e
  assert float(moe_lib.sequence_balance_loss(jnp.asarray(even), jnp.asarray(experts_even), jnp.ones((1, 8), bool),
                                             (), ())) == pytest.approx(1.0)


@pytest.mark.extended
def test_mtp_loss_is_logged(tmp_path):
  cfg = _cfg(**{"workdir": str(tmp_path / "run"), "steps": 2, "log.every_steps": 1, "checkpoint.every_steps": -1,
                "train.eval_every_steps": 0, "data.source": "synthetic"})
  train(helpers.checked(cfg))
  records = [r for r in read_records(str(tmp_path / "run" / "metrics.jsonl")) if "loss" in r]
  assert len(records) == 2 and all(r["mtp_loss"] > 0 for r in records)


def test_save_quantized_recomputes_no_quantize_op_in_latent_attention():
  """An MoE block with latent attention under `save_quantized`: every projection's quantized operands are named
  (q_a, q_b, kv_a, kv_b, out and the experts'; a dense kernel is quantized once a step, outside the block:
  linear.once_a_step), and its backward pass casts nothing to FP8 but gradients."""
  cfg = config_lib.derive(helpers.config(PRESET, **{"quant.recipe": "fp8_current", "mesh.fsdp": 1}), 1)
  problem = analysis.layer_problem(cfg, batch=2)
  traced = {p: analysis.trace_layer(problem, remat.PRESETS[p]) for p in ("none", "full", "save_quantized")}
  saved = traced["save_quantized"]
  assert saved.backward.quantize_ops == 0
  assert saved.backward.gradient_quantize_ops == traced["none"].backward.gradient_quantize_ops > 0
  assert traced["full"].backward.quantize_ops > 0
  names = {r.name for r in saved.residuals}
  for projection in ("q_a", "q_b", "kv_a", "kv_b", "out", "moe_wi", "moe_wo", "shared_wi", "shared_wo"):
    assert remat.quantized_name(projection, "x") in names, projection
    assert (remat.quantized_name(projection, "kernel") in names) == projection.startswith("moe_"), projection


def _megatron_flops_per_token(m):
  """Megatron-LM's model FLOPs of a training token (num_floating_point_operations, MLA and MTP branch), written
  out from its formula: 3 (fwd + 2 bwd) x 2 (FMA) x the multiply-adds, attention's causal half included."""
  layers = m.num_layers + m.mtp_depth
  moe, dense = m.num_layers - m.first_k_dense + m.mtp_depth, m.first_k_dense
  n, nope, rope, v, h = m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.d_model
  q = m.q_lora_rank * (h + n * (nope + rope) + 1)
  attn = 6 * layers * (q + m.kv_lora_rank * (h + n * (nope + v) + 1) + h * rope + n * v * h
                       + m.seq_len * n * (nope + rope) * 0.5 + m.seq_len * n * v * 0.5)
  mlp = 12 * layers * h * 1.5 * (m.dense_width * dense / layers + m.d_ff * m.experts_per_token * moe / layers
                                 + m.d_ff * m.num_shared_experts * moe / layers)
  mtp = 6 * m.mtp_depth * (3 * h + 2 * h * h)
  return mlp + attn + mtp + 6 * h * m.vocab_size * (m.mtp_depth + 1)


def test_deepseek_v3_model_flops_match_megatrons_count():
  m = helpers.settings("deepseek_v3", **{"data.source": "synthetic"}).model
  ours = 3 * forward_flops_per_token(m)
  theirs = _megatron_flops_per_token(m)
  assert ours == pytest.approx(theirs, rel=0.02)



@pytest.mark.parametrize("latent_amax", [0.5, 3.0])
def test_the_cached_kernel_of_latent_attention_is_the_kernel_under_delayed_scaling(latent_amax):
  """fp8_delayed: the kv_b kernel the cached decoder reads is the kernel in E4M3 at its own history's scale (each
  element within E4M3's rounding of the float32 kernel, none scaled as a whole), whatever amax the latent's history
  holds: read as the product with an identity, it came scaled by the identity's own rounding (0.5x under a latent
  history of 0.5, ~0.96x under 3.0)."""
  from ember.layers.mla import LatentAttention
  m = config_lib.derive(helpers.config(PRESET, **{"quant.recipe": "fp8_delayed", "model.dtype": "float32",
                                                  "mesh.fsdp": 1}), 1)
  with nnx.use_eager_sharding(False):
    attn = LatentAttention(m.model, recipe=m.quant, layer=0, rngs=nnx.Rngs(0))
  kernel = np.asarray(attn.kv_b.kernel[...], np.float64)
  history = np.zeros(attn.kv_b.amax_history[...].shape, np.float32)
  history[0], history[1] = latent_amax, np.abs(kernel).max()  # The latent's row, the kernel's.
  attn.kv_b.amax_history[...] = jnp.asarray(history)
  got = np.asarray(attn.kv_b_kernel(), np.float64)
  big = np.abs(kernel) > np.abs(kernel).max() / 64  # Normal E4M3 numbers at this scale: relative rounding 2^-4.
  np.testing.assert_array_less(np.abs(got[big] / kernel[big] - 1), 2**-4 + 1e-3)
  assert abs(np.median(got[big] / kernel[big]) - 1) < 1e-2
