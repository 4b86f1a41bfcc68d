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


def test_plan_reads_the_expert_axes_from_the_rules():
  """The layer, the log line and the compile report all take `plan`: the experts' devices are those the rules
  map `expert` to, not the mesh's `expert` axis (here `expert` -> fsdp, and the mesh's expert axis is 1)."""
  import jax
  from ember.parallel.mesh import make_mesh
  from ember.parallel.sharding import rules_dict
  from tests.helpers import config
  cfg = config("tiny_moe")
  mesh = make_mesh(dict(data=1, fsdp=4, tensor=1, expert=2), jax.devices()[:8])
  default = rules_dict(cfg.mesh.rules)
  moved = dict(default, expert=("fsdp",))
  assert moe_dispatch.plan("auto", "auto", 8, mesh, default, platform="gpu") == moe_dispatch.Plan(
      "ragged", "capacity", 2, 4)
  assert moe_dispatch.plan("auto", "auto", 8, mesh, moved, platform="gpu") == moe_dispatch.Plan(
      "ragged", "capacity", 4, 2)
  assert moe_dispatch.plan("alltoall", "ragged_dot", 8, mesh, dict(default, expert=()), platform="cpu") == (
      moe_dispatch.Plan("local", "ragged_dot", 1, 8))
