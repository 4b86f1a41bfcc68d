"""moe_dispatch.choose: the token exchange and the expert GEMM layout an MoE layer runs, for every setting,
platform and expert-parallel size: hand-worked rows of the module doc's table, and what holds for every setting; and the
FP8 wire the exchanges send the copies over."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ember.layers import moe_dispatch
from ember.quant.recipe import Recipe
from ember.names import MOE_DISPATCHERS, MOE_EXPERT_GEMMS

# (moe_dispatch, moe_expert_gemm, expert-parallel devices, local experts, platform) -> (exchange, expert GEMMs),
# written out from the module doc: one device is `local`; `auto` exchanges with ragged all-to-all on a GPU and
# all-gathers elsewhere; `auto` GEMMs take the capacity layout on a GPU with several local experts.
TABLE = [
    ("auto", "auto", 1, 8, "gpu", "local", "capacity"),
    ("auto", "auto", 1, 1, "gpu", "local", "ragged_dot"),
    ("auto", "auto", 1, 8, "cpu", "local", "ragged_dot"),
    ("auto", "auto", 8, 8, "gpu", "ragged", "capacity"),
    ("auto", "auto", 8, 1, "gpu", "ragged", "ragged_dot"),
    ("auto", "auto", 8, 2, "gpu", "ragged", "capacity"),
    ("auto", "auto", 8, 8, "cpu", "allgather", "ragged_dot"),
    ("auto", "auto", 2, 4, "tpu", "allgather", "ragged_dot"),
    ("alltoall", "auto", 2, 4, "cpu", "alltoall", "ragged_dot"),
    ("alltoall", "auto", 2, 4, "gpu", "alltoall", "capacity"),
    ("allgather", "capacity", 2, 4, "gpu", "allgather", "capacity"),
    ("allgather", "ragged_dot", 8, 8, "gpu", "allgather", "ragged_dot"),
    ("ragged", "ragged_dot", 8, 8, "gpu", "ragged", "ragged_dot"),
    ("ragged", "capacity", 1, 64, "cpu", "local", "capacity"),
    ("ragged", "auto", 4, 2, "cpu", "ragged", "ragged_dot"),
    ("alltoall", "capacity", 4, 1, "cpu", "alltoall", "capacity"),
]


@pytest.mark.parametrize("dispatch,gemm,ep,num_local,platform,exchange,layout", TABLE)
def test_choose_gives_the_documented_row(dispatch, gemm, ep, num_local, platform, exchange, layout):
  assert moe_dispatch.choose(dispatch, gemm, expert_parallel=ep, num_local=num_local, platform=platform) == (
      exchange, layout)


@pytest.mark.parametrize("platform", ["gpu", "cpu", "tpu"])
def test_every_setting_runs_a_named_exchange_and_layout(platform):
  """Never `auto` at run time; one device never exchanges; a setting other than `auto` is what runs."""
  for dispatch, gemm, ep, num_local in itertools.product(MOE_DISPATCHERS, MOE_EXPERT_GEMMS, (1, 2, 8), (1, 4)):
    exchange, layout = moe_dispatch.choose(dispatch, gemm, expert_parallel=ep, num_local=num_local, platform=platform)
    assert exchange in ("local", *MOE_DISPATCHERS[1:]) and layout in MOE_EXPERT_GEMMS[1:]
    assert (exchange == "local") == (ep == 1)
    assert dispatch == "auto" or ep == 1 or exchange == dispatch
    assert gemm == "auto" or layout == gemm


def test_choose_spot_checks():
  """The cases the docs quote: one device is always local; Mixtral on 8 GPUs (1 expert each) exchanges rows
  with ragged all-to-all into ragged_dot; moe_64x6 (8 local experts) into the capacity layout; the CPU's
  auto is allgather."""
  assert moe_dispatch.choose("ragged", "capacity", expert_parallel=1, num_local=64, platform="gpu") == (
      "local", "capacity")
  assert moe_dispatch.choose("auto", "auto", expert_parallel=8, num_local=1, platform="gpu") == ("ragged", "ragged_dot")
  assert moe_dispatch.choose("auto", "auto", expert_parallel=8, num_local=8, platform="gpu") == ("ragged", "capacity")
  assert moe_dispatch.choose("auto", "auto", expert_parallel=4, num_local=1, platform="cpu") == (
      "allgather", "ragged_dot")


def test_plan_reads_the_expert_axes_from_the_rules_and_sizes_every_buffer():
  """The layer, the log line and the compile report all read `plan`: the experts' devices are those the rules
  map `expert` to, not the mesh's `expert` axis (here also `expert` -> fsdp); its rows and slots against
  the arithmetic of the module doc, by hand. 16 x 128 tokens over 8 token shards: T = 256, k = 2, E = 8."""
  import dataclasses
  import jax
  from ember.parallel.mesh import make_mesh
  from ember.config.settings import Mesh
  from tests.helpers import settings
  s = settings("tiny_moe", **{"model.num_experts": 8, "model.seq_len": 128})
  model = s.model
  mesh = make_mesh(Mesh(pipeline=1, data=1, fsdp=4, context=1, tensor=1, expert=2, dcn_pipeline=1, dcn_data=1, dcn_fsdp=1,
                        dcn_expert=1, rules=()),
                   jax.devices()[:8])
  default = s.mesh.rules_dict
  moved = dict(default, expert=("fsdp",))
  plan = lambda m, rules, platform: moe_dispatch.plan(m, mesh, rules, batch=(16, 128), platform=platform)
  P = moe_dispatch.Plan
  # ragged: buffer min(n T min(k, E_local), ceil(2.0 T k)); capacity slots ceil(1.25 n T k / E), to 32s.
  assert plan(model, default, "gpu") == P("ragged", "capacity", ("expert",), 2, 4, 256, None, 1024, 1024, 160)
  assert plan(model, moved, "gpu") == P("ragged", "capacity", ("fsdp",), 4, 2, 256, None, 1024, 1024, 320)
  # alltoall: T min(k, E_local) rows to each of n devices.
  a2a = dataclasses.replace(model, moe_dispatch="alltoall")
  assert plan(a2a, default, "gpu") == P("alltoall", "capacity", ("expert",), 2, 4, 256, None, 512, 1024, 160)
  # No expert axis: no exchange, the rows of one shard; ragged_dot has no slots.
  assert plan(a2a, dict(default, expert=()), "cpu") == P("local", "ragged_dot", (), 1, 8, 256, None, 0, 512, 0)
  # A capacity factor of 1: ceil(T k / E) = 64 copies an expert keeps; rows n E_local 64; slots n 64.
  capped = dataclasses.replace(model, capacity_factor=1.0, moe_expert_gemm="capacity")
  assert plan(capped, default, "cpu") == P("allgather", "capacity", ("expert",), 2, 4, 256, 64, 0, 512, 128)


def test_the_step_plans_once_and_its_layers_read_the_plan(monkeypatch):
  """The train step's MoE plan is decided where it is jitted and handed down: tracing the step (a decoder layer,
  scanned, and the multi-token-prediction module's unscanned one) plans nothing more. A layer called without a plan
  (sampling) plans for its own batch."""
  import jax
  import jax.numpy as jnp
  from ember.layers.moe import MoE
  from ember.plan.step import abstract_batch
  from ember.trainer.step import jit_train_step, moe_plan
  from ember.trainer.state import state_shardings
  from ember.trainer.optimizer import make_optimizer
  from ember.parallel.sharding import use_rules
  from flax import nnx
  from tests.helpers import devices, settings
  from ember.parallel.mesh import make_mesh

  cfg = settings("tiny_moe", 2, **{"model.mtp_depth": 1, "mesh.expert": 2, "mesh.data": 1})
  mesh = make_mesh(cfg.mesh, devices(2))
  tx, schedule = make_optimizer(cfg)
  with use_rules(mesh, cfg.mesh.rules):
    graphdef, shardings, abstract = state_shardings(cfg, mesh, tx)
    decided = moe_plan(cfg, mesh, cfg.train.micro_batch_size)
    step = jit_train_step(cfg, mesh, graphdef, tx, schedule, shardings, plan=decided)
    calls = []
    planner = moe_dispatch.plan
    monkeypatch.setattr(moe_dispatch, "plan", lambda *a, **k: calls.append(k) or planner(*a, **k))
    step.trace(abstract, abstract_batch(cfg, mesh)[0])
    assert calls == []  # Every MoE layer ran `decided`.
    with nnx.use_eager_sharding(False):
      layer = MoE(cfg.model, recipe=cfg.quant, layer=1, rngs=nnx.Rngs(params=0))
    x = jnp.zeros((2, cfg.model.seq_len, cfg.model.d_model), cfg.model.dtype)
    jax.eval_shape(lambda x: layer(x, jnp.ones(x.shape[:2], jnp.int32)), x)
  assert [c["batch"] for c in calls] == [(2, cfg.model.seq_len)]  # Unplanned: its own batch's plan.


def test_a_layer_without_a_step_plan_drops_no_copy_on_a_gpu():
  """Sampling calls the MoE layer with no step's plan. Traced for a GPU it took the capacity layout, whose slots
  hold 1.25x the balanced load, and a repetitive prompt's copies past them got zero outputs, silently; planned for
  itself it is dropless, and gives what the ragged GEMM gives."""
  import dataclasses
  from flax import nnx
  from ember import platform
  from ember.layers.moe import MoE
  from tests.helpers import settings
  cfg = settings("tiny_moe", 1, **{"model.dtype": "float32", "quant.recipe": "bf16"})
  with nnx.use_eager_sharding(False):
    layer = MoE(cfg.model, recipe=cfg.quant, layer=0, rngs=nnx.Rngs(params=0))
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=cfg.model.d_model) + 0.05 * rng.normal(size=(1, 256, cfg.model.d_model)),
                  jnp.float32)  # The same token, over and over: every copy to the same experts.
  segments = jnp.ones((1, 256), jnp.int32)
  with platform.on_platform("gpu", (9, 0)):
    sized = moe_dispatch.plan(cfg.model, None, {}, batch=(1, 256))
    assert sized.expert_gemm == "capacity" and layer(x, segments, plan=sized)[1]["moe_overflow_tokens"] > 0
    y, aux = layer(x, segments)  # No plan.
  ragged = moe_dispatch.plan(dataclasses.replace(cfg.model, moe_expert_gemm="ragged_dot"), None, {}, batch=(1, 256))
  np.testing.assert_allclose(y, layer(x, segments, plan=ragged)[0], rtol=1e-6, atol=1e-6)
  assert aux["moe_overflow_tokens"] == 0


@pytest.mark.parametrize("role", ["activation", "gradient"])
def test_rows_sent_quantized_quantize_again_to_the_same_operand(role):
  """What the FP8 wire rests on (moe_dispatch.Wire): bf16 rows quantized with their amax, taken back to bf16 on
  arrival and quantized again there give the same data and the same scale, so the expert GEMM reads what it would
  have read without the wire. Checked with and without values at the format's saturation and below its smallest
  normal, in bf16 and float32."""
  quantizer = Recipe(name="fp8_current").exchange_quantizer(role)
  assert quantizer is not None
  x = jax.random.normal(jax.random.key(0), (512, 96), jnp.float32) * jnp.exp(
      jax.random.uniform(jax.random.key(1), (512, 96), minval=-12.0, maxval=4.0))
  scaled = [x * jnp.exp(jax.random.uniform(jax.random.key(k), ())) * 40 for k in range(64)]  # Many amaxes.
  for rows in [x.at[3, 5].set(-3e4)] + scaled:
    for dtype in (jnp.bfloat16, jnp.float32):
      sent = quantizer.quantize(rows.astype(dtype))
      arrived, _ = moe_dispatch._send(lambda d: d, quantizer, (), rows.astype(dtype), ())
      again = quantizer.quantize(arrived)
      as_f32 = lambda q: np.asarray(q.data.astype(jnp.float32))
      np.testing.assert_array_equal(as_f32(again), as_f32(sent))
      assert float(again.scale_inv) == float(sent.scale_inv)


def test_the_wire_is_the_recipes():
  """The recipe table decides the wire: FP8 with current scaling sends the copies in E4M3 and their outputs'
  gradients in E5M2; delayed scaling, the block-scaled recipes, bf16 and a bf16 forward send them as they are."""
  fmt = lambda w: tuple(None if q is None else q.fmt.name for q in (w.rows, w.grads))
  wire = lambda **kw: moe_dispatch.Wire.of(Recipe(**kw), Recipe(**kw), ())
  assert fmt(wire(name="fp8_current")) == ("e4m3", "e5m2")
  assert wire(name="fp8_current").bytes_per_element("bfloat16") == (1.0, 1.0)
  for name in ("fp8_delayed", "mxfp8", "nvfp4", "bf16"):
    assert fmt(wire(name=name)) == (None, None), name
  assert fmt(wire(name="fp8_current", forward="bf16")) == (None, "e5m2")
  assert wire(name="bf16").bytes_per_element("bfloat16") == (2, 2)
