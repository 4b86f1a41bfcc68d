"""Residual accounting and recompute counts of one decoder block, per preset and recipe.

All on abstract inputs (tracing only, nothing compiled): the residuals the block's forward pass
saves under each policy and what its backward pass recomputes.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from ember import config as config_lib
from ember import remat
from ember.plan import jaxpr as jaxpr_plan
from ember.plan import layer as analysis
from tests.helpers import config

QUANTIZED = ("fp8_current", "fp8_delayed", "mxfp8", "nvfp4")
# Per-tensor recipes quantize each kernel once a step, outside the layers' checkpoints (layers/linear.py's
# `once_a_step`): no kernel copy of theirs is a residual, saved or recomputed.
KERNELS_AHEAD = ("fp8_current", "fp8_delayed")
PROJECTIONS = ("qkv", "out", "wi", "wo")
LOW_PRECISION_BITS = ("uint8", "uint4")  # Quantized data and block scales travel as bit patterns.


def derived(preset="tiny", **overrides):
  return config_lib.derive(config(preset, **overrides), 1)


class _Reports(dict):
  """Per-recipe layer reports, traced on first use (test workers trace only the recipes they test)."""

  def __missing__(self, recipe):
    self[recipe] = analysis.layer_report(derived(**{"quant.recipe": recipe}), remat.PRESETS, batch=2)
    return self[recipe]


_REPORTS = _Reports()


@pytest.fixture
def reports():
  return _REPORTS


@pytest.mark.parametrize("recipe", QUANTIZED)
@pytest.mark.variants
def test_save_quantized_keeps_the_layer_input_and_low_precision_tensors_only(reports, recipe):
  cfg = derived(**{"quant.recipe": recipe})
  tokens_x_dmodel = 2 * cfg.model.seq_len * cfg.model.d_model
  report = reports[recipe]["save_quantized"]
  names = [r["name"] for r in report["residuals"]]
  assert names.count(remat.LAYER_INPUT) == 1
  for r in report["residuals"]:
    if r["name"] == remat.LAYER_INPUT:
      assert r["dtype"] == cfg.model.dtype
      continue
    assert r["name"] in remat.QUANTIZED_NAMES, r
    size = 1
    for n in r["shape"]:
      size *= n
    # Data and block scales are bit patterns; per-tensor scales are float32 scalars.
    assert r["dtype"] in LOW_PRECISION_BITS or size == 1, r
    assert r["dtype"] in LOW_PRECISION_BITS or size < tokens_x_dmodel, r
  # The forward operands of the GEMMs the backward pass recomputes (all but the MLP's output
  # projection, see below) are there, so that recompute needs no quantize op; every projection
  # keeps what its backward GEMMs read. A kernel quantized once a step is none of them.
  operands = ("x",) if recipe in KERNELS_AHEAD else ("x", "kernel")
  assert {remat.quantized_name(p, o) for p in PROJECTIONS[:-1] for o in operands} <= set(names)
  assert (recipe in KERNELS_AHEAD) == (not [n for n in names if n in remat.QUANTIZED_KERNEL_NAMES]), names
  assert all(any(n.startswith(remat.quantized_name(p, "")) for n in names) for p in PROJECTIONS)
  assert report["recomputed_quantize_ops_per_layer"] == 0
  assert reports[recipe]["minimal_quantized"]["recomputed_quantize_ops_per_layer"] == 0
  assert reports[recipe]["full"]["recomputed_quantize_ops_per_layer"] > 0
  assert reports[recipe]["minimal"]["recomputed_quantize_ops_per_layer"] > 0
  assert reports[recipe]["none"]["recomputed_quantize_ops_per_layer"] == 0


def test_uint4_residuals_count_half_a_byte(reports):
  nvfp4 = reports["nvfp4"]["save_quantized"]["residuals"]
  data = [r for r in nvfp4 if r["dtype"] == "uint4"]
  assert data and all(r["format"] == "float4_e2m1fn" for r in data)
  for r in data:
    assert r["bytes"] == r["shape"][0] * r["shape"][1] / 2
  assert all(r["format"] == "float8_e4m3fn" for r in reports["fp8_current"]["save_quantized"]["residuals"]
             if r["dtype"] == "uint8")


@pytest.mark.parametrize("recipe", QUANTIZED)
@pytest.mark.variants
def test_residual_bytes_order(reports, recipe):
  b = {name: r["residual_bytes_per_layer"] for name, r in reports[recipe].items()}
  assert b["full"] < b["save_quantized"] < b["minimal_quantized"] <= b["none"], b
  assert b["full"] < b["minimal"] < b["minimal_quantized"], b
  assert b["save_quantized_offloaded"] == b["save_quantized"]  # The same tensors, held on the host.
  assert b["save_quantized_x_offloaded"] == b["save_quantized"]
  offloaded = reports[recipe]["save_quantized_offloaded"]["offloaded_bytes_per_layer"]
  assert offloaded == b["save_quantized"] - 2 * 64 * 64 * 2  # All but the layer input (bf16 [2, 64, 64]).
  report = reports[recipe]["save_quantized_x_offloaded"]
  activation_copies = sum(r["bytes"] for r in report["residuals"]
                          if r["name"].startswith(remat.QUANTIZED) and r["name"].rsplit(".", 1)[1] in ("x", "x_t"))
  # The weight copies stay on device (made once a step, under per-tensor recipes: no residual at all).
  assert 0 < activation_copies == offloaded if recipe in KERNELS_AHEAD else 0 < activation_copies < offloaded
  assert report["offloaded_bytes_per_layer"] == activation_copies


def test_bf16_quantized_presets_reduce_to_their_plain_counterparts(reports):
  b = {name: r["residual_bytes_per_layer"] for name, r in reports["bf16"].items()}
  assert b["save_quantized"] == b["full"] and b["minimal_quantized"] == b["minimal"]
  assert b["full"] < b["save_qkv_proj"] < b["save_dot_except_mlp"] < b["minimal"] < b["none"]


@pytest.mark.parametrize("recipe", ("fp8_current", "fp8_delayed"))
def test_fp8_save_quantized_keeps_at_most_055_of_minimal_on_125m(recipe):
  """The 125m shapes (d_model 768, d_ff 2048, seq 2048) at 2 sequences per device."""
  cfg = derived("125m", **{"quant.recipe": recipe, "train.batch_size": 2})
  problem = analysis.layer_problem(cfg)
  sq = analysis.trace_layer(problem, remat.PRESETS["save_quantized"]).residual_bytes
  minimal = analysis.trace_layer(problem, remat.PRESETS["minimal"]).residual_bytes
  assert sq <= 0.55 * minimal, sq / minimal


@pytest.mark.parametrize("recipe", ("bf16",) + QUANTIZED)
@pytest.mark.variants
def test_projection_gemm_recompute(reports, recipe):
  r = {name: rep["recomputed_gemms_per_layer"] for name, rep in reports[recipe].items()}
  assert r["none"] == 0
  assert r["minimal"] == 0 and r["minimal_quantized"] == 0 and r["minimal_offloaded"] == 0
  # `full` recomputes every projection GEMM whose output the backward pass reads: qkv, out and wi.
  # The MLP's output projection never: its output only enters the residual sum, whose gradient
  # does not depend on it, so no policy recomputes it.
  assert r["full"] == len(PROJECTIONS) - 1 == max(r.values())
  assert r["save_quantized"] == r["full"]  # Recomputes the GEMMs, from saved low-precision operands.
  assert r["save_qkv_proj"] == r["full"] - 1  # q, k, v are kept.
  assert r["save_dot_except_mlp"] == 1  # Only the MLP's input projection.


def test_a_block_of_two_layers_keeps_each_layers_input():
  """tiny_moe with `moe_every=2`: a checkpointed block holds a dense and an MoE layer. Every policy keeps both
  layers' inputs, as it keeps the one input of a one-layer block: `full` holds the same bytes a layer either way
  and recomputes no GEMM a one-layer block does not (the dense layer's MLP output projection, reached only through
  the second layer's input, ran again when the block kept its first input alone)."""
  def report(every):
    return analysis.layer_report(derived("tiny_moe", **{"quant.recipe": "fp8_current", "model.moe_every": every}),
                                 {n: remat.PRESETS[n] for n in ("full", "save_quantized")}, batch=2)

  one, two = report(1), report(2)
  assert two["full"]["residual_bytes_per_layer"] == pytest.approx(one["full"]["residual_bytes_per_layer"], rel=1e-3)
  for name in ("full", "save_quantized"):
    assert two[name]["recomputed_gemms_per_layer"] <= one[name]["recomputed_gemms_per_layer"]


def test_gradient_quantization_is_not_counted_as_recompute(reports):
  problem = analysis.layer_problem(derived(**{"quant.recipe": "nvfp4"}), batch=2)
  counts = {n: analysis.trace_layer(problem, remat.PRESETS[n]).backward for n in ("none", "full", "save_quantized")}
  # NVFP4: a dgrad and a wgrad copy of each projection's gradient, each two casts (scales, data).
  assert {c.gradient_quantize_ops for c in counts.values()} == {len(PROJECTIONS) * 2 * 2}
  assert counts["none"].quantize_ops == counts["save_quantized"].quantize_ops == 0
  # full: x (1x16), its Hadamard-transformed x_t and the 16x16-tiled kernel, two casts each.
  assert counts["full"].quantize_ops == len(PROJECTIONS) * 3 * 2


def test_residual_bytes_use_the_saved_dtype():
  assert jaxpr_plan.nbytes(jnp.zeros((4, 6), jnp.uint4)) == 12
  assert jaxpr_plan.nbytes(jnp.zeros((4, 6), jnp.bfloat16)) == 48
  assert jaxpr_plan.nbytes(jnp.zeros((3,), bool)) == 3


def test_a_shard_maps_flops_count_its_most_split_operands_shards():
  """A shard_map's body has one device's shapes: its FLOPs count once per shard of its most split operand, wherever
  that operand sits (remat puts the residuals it saves, a replicated amax among them, first)."""
  mesh = jax.sharding.Mesh(jax.devices()[:4], ("x",))

  def f(amax, a, b):
    return jax.shard_map(lambda s, a, b: a @ b, mesh=mesh, in_specs=(P(), P("x"), P()), out_specs=P("x"))(amax, a, b)

  traced = jax.make_jaxpr(f)(jnp.float32(1.0), jnp.zeros((8, 16)), jnp.zeros((16, 32)))
  per_shard = 2 * 2 * 16 * 32  # a's rows on one device [2, 16] @ b [16, 32].
  assert jaxpr_plan.jaxpr_flops(traced.jaxpr) == 4 * per_shard
