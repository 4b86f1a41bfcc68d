"""moe_dispatch.choose: the token exchange and the expert GEMM layout an MoE layer runs, for every setting,
platform and expert-parallel size (the table of the module doc, written out)."""

import itertools

import pytest

from ember.layers import moe_dispatch
from ember.names import MOE_DISPATCHERS, MOE_EXPERT_GEMMS


def _expected(dispatch, gemm, ep, num_local, platform):
  exchange = "local" if ep == 1 else {"auto": "ragged" if platform == "gpu" else "allgather"}.get(dispatch, dispatch)
  if gemm == "auto":
    gemm = "capacity" if platform == "gpu" and num_local > 1 else "ragged_dot"
  return exchange, gemm


@pytest.mark.parametrize("platform", ["gpu", "cpu", "tpu"])
def test_choose_follows_the_table(platform):
  for dispatch, gemm, ep, num_local in itertools.product(MOE_DISPATCHERS, MOE_EXPERT_GEMMS, (1, 2, 8), (1, 4)):
    got = moe_dispatch.choose(dispatch, gemm, expert_parallel=ep, num_local=num_local, platform=platform)
    assert got == _expected(dispatch, gemm, ep, num_local, platform), (dispatch, gemm, ep, num_local)


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
  from ember.settings import Mesh
  from tests.helpers import settings
  s = settings("tiny_moe", **{"model.num_experts": 8, "model.seq_len": 128})
  model = s.model
  mesh = make_mesh(Mesh(data=1, fsdp=4, context=1, tensor=1, expert=2, dcn_data=1, dcn_fsdp=1, dcn_expert=1, rules=()),
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


def test_a_layer_runs_the_plan_its_step_decided_or_says_why_not():
  """Inside `planned(p)` a layer of the planned shapes runs p; one of other shapes is an error, not a second
  layout the log line would not name."""
  import pytest
  from tests.helpers import settings
  model = settings("tiny_moe").model
  decided = moe_dispatch.plan(model, None, {}, batch=(4, 32))
  with moe_dispatch.planned(decided):
    assert moe_dispatch.plan_in_use(model, None, {}, batch=(4, 32)) is decided
    with pytest.raises(ValueError, match="the step planned MoE layers for"):
      moe_dispatch.plan_in_use(model, None, {}, batch=(2, 32))
  assert moe_dispatch.plan_in_use(model, None, {}, batch=(2, 32)).tokens == 64  # Outside a step: its own.
