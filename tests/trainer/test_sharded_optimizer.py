"""The optimizer state split over the data- and expert-parallel replicas (ZeRO-1, train.shard_optimizer_state; 8
CPU devices): where its pieces lie, that a step with the state split is the step with it whole, and what the step
moves across the replicas instead of all-reducing the gradients."""

import collections
import math

import jax
import pytest

from tests.helpers import config, one_step, random_batch, rel_error, start
from tests.trainer.test_grad_accum import MESH, MOE_MESH, _compiled_collectives

WHOLE = {"train.shard_optimizer_state": False}


def _opt_leaves_by_param(s):
  """[(parameter path, the parameter's abstract value, its sharding, [the sharding of each optimizer-state leaf of
  its shape whose path ends with the parameter's])]."""
  params = jax.tree_util.tree_flatten_with_path(s.shardings.params)[0]
  abstract = jax.tree.leaves(s.state.params)
  opt = jax.tree_util.tree_flatten_with_path(s.shardings.opt_state)[0]
  out = []
  for (path, sharding), a in zip(params, abstract, strict=True):
    mine = [o for p, o in opt if tuple(p[-len(path):]) == tuple(path) and len(p) > len(path)]
    out.append((path, a, sharding, mine))
  return out


def _devices(mesh, entry) -> int:
  """The devices a PartitionSpec entry splits a dimension over."""
  return math.prod(mesh.shape[x] for x in ((entry,) if isinstance(entry, str) else entry or ()))


def test_each_data_replica_holds_half_of_the_optimizer_state():
  """tiny, data 2 x fsdp 4: a moment of a parameter with a dimension fsdp leaves whole and of even length is half
  as large on a device as the parameter's piece (the whole state: as large); the rest stay as their parameter.
  Summed, the moments take about half the bytes they take whole."""
  split, whole = start(config("tiny", **MESH), 8), start(config("tiny", **MESH, **WHOLE), 8)
  totals = collections.Counter()
  for name, s in (("split", split), ("whole", whole)):
    for path, a, sharding, moments in _opt_leaves_by_param(s):
      assert len(moments) == 2, jax.tree_util.keystr(path)  # AdamW's mu and nu.
      piece = math.prod(sharding.shard_shape(a.shape))
      entries = tuple(sharding.spec) + (None,) * (a.ndim - len(sharding.spec))
      kept_whole = [n for n, e in zip(a.shape, entries) if _devices(s.mesh, e) == 1]
      halves = name == "split" and any(n % 2 == 0 for n in kept_whole)
      for m in moments:
        assert math.prod(m.shard_shape(a.shape)) == piece // (2 if halves else 1), (name, jax.tree_util.keystr(path))
        totals[name] += math.prod(m.shard_shape(a.shape))
  assert totals["split"] < 0.55 * totals["whole"], totals


@pytest.mark.parametrize("preset,recipe,mesh", [
    pytest.param("tiny", "fp8_current", MESH, marks=pytest.mark.extended),
    ("tiny", "fp8_current", MOE_MESH),
    pytest.param("tiny_moe", "fp8_delayed", MOE_MESH, marks=pytest.mark.extended)])
@pytest.mark.long
def test_a_step_with_the_state_split_is_the_step_with_it_whole(preset, recipe, mesh):
  """float32, 2 micro-batches: the metrics, the updated parameters and every moment equal those of the same step
  with each replica holding the whole state. data 2 x fsdp 2 x expert 2: a dense model's replicas are the data
  and expert axes, each piece along both (in the order the reduce-scatter numbers them); tiny_moe's experts'
  weights, split over `expert`, have their state split over `data` alone."""
  overrides = {"model.dtype": "float32", "quant.recipe": recipe, "train.batch_size": 32,
               "train.grad_accum_steps": 2, **mesh}
  batch = random_batch(config(preset, **overrides))
  split = one_step(config(preset, **overrides), batch, 8)
  whole = one_step(config(preset, **overrides, **WHOLE), batch, 8)
  flat = jax.tree_util.tree_flatten_with_path(whole)[0]
  for (path, a), b in zip(flat, jax.tree.leaves(split), strict=True):
    assert rel_error(b, a) < 1e-6, jax.tree_util.keystr(path)


def _across_replicas(overrides: dict, micro: int = 4) -> collections.Counter:
  """Bytes a step moves across the replicas by kind of collective (each of 256 bytes or more, a norm's gradient:
  not an amax, a statistic or the metrics): tiny_moe, data 2 x fsdp 2 x expert 2, `micro` micro-batches."""
  collectives, apart, _ = _compiled_collectives("tiny_moe", micro, {**MOE_MESH, **overrides})
  moved = collections.Counter()
  for c in collectives:
    if c.groups and c.bytes >= 256 and apart(c.groups[0]) & {"data", "expert"} and c.kind != "all-to-all":
      moved[c.kind] += c.bytes_per_step
  return moved


@pytest.mark.long
@pytest.mark.parametrize("micro", [4, 1])
def test_replicas_reduce_scatter_the_gradients_and_gather_the_new_parameters(micro):
  """Split: no gradient is all-reduced across the replicas; each is reduce-scattered once a step and the
  updated float32 parameters gathered back, the same bytes as the all-reduces of the state held whole (the
  experts' weights move over `data` alone). Both steps reduce-scatter and gather the MoE layers' tokens over
  `expert` in each micro-batch alike. One micro-batch moves what four do (the reference: the state whole at four,
  whose replicas reduce once a step too); its gradients were all-reduced whole, and the new parameters gathered
  on top."""
  split, whole = _across_replicas({}, micro), _across_replicas(WHOLE)
  assert split["all-reduce"] == 0, split
  reduced = whole["all-reduce"]  # The compiler may combine the step's metrics (76 bytes) into one of them.
  assert reduced > 0 and split["reduce-scatter"] - whole["reduce-scatter"] == pytest.approx(reduced, rel=1e-3)
  assert split["all-gather"] - whole["all-gather"] == pytest.approx(reduced, rel=1e-3), (split, whole)
