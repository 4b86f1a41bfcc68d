"""Sequence parallelism (the residual stream's length split over `tensor`) and the embedding looked up per device:
what each splits, and that the lookup gives XLA's values and gradients. That a tensor-parallel step trains as one
device does is tests/parallel's equality tests' (tensor meshes)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from configs import default
from ember.layers import embed as embed_lib
from ember.parallel import sharding
from tests.helpers import compiled_text, config


def _saved_layer_inputs(rules) -> set[tuple[int, ...]]:
  """The shapes of the scanned step's stacked saved activations [layers, rows, length, d_model] (remat `full` keeps
  each layer's input alone), for tiny on fsdp 4 x tensor 2 under `rules`."""
  text, s = compiled_text(config("tiny", **{"mesh.fsdp": 4, "mesh.tensor": 2, "remat.policy": "full",
                                             "mesh.rules": rules}), 8)
  m = s.cfg.model
  shapes = {tuple(int(n) for n in dims.split(",")) for dims in re.findall(r"\w+\[([\d,]+)\]", text)}
  return {d for d in shapes if len(d) == 4 and d[0] == m.num_layers and d[-1] == m.d_model}


def test_the_residual_stream_keeps_a_tensor_groups_share_of_the_tokens():
  """tiny (2 layers, 64 positions, 8 sequences) on fsdp 4 x tensor 2: each device's saved layer inputs are its 2
  sequences' halves, [2, 2, 32, 64]; with `residual_length` split over `context` alone, whole, [2, 2, 64, 64]."""
  rules = tuple(default.get_config("tiny").mesh.rules)
  assert ("residual_length", ("context", "tensor")) in rules
  off = tuple(("residual_length", "context") if name == "residual_length" else (name, axes) for name, axes in rules)
  split, whole = _saved_layer_inputs(rules), _saved_layer_inputs(off)
  assert (2, 2, 32, 64) in split and (2, 2, 64, 64) not in split, split
  assert (2, 2, 64, 64) in whole and (2, 2, 32, 64) not in whole, whole


def _lookup_case(seed: int):
  """(tiny's rules, a data 2 x fsdp 2 x tensor 2 mesh, a [16, 8] table, [8, 4] tokens, a [8, 4, 8] gradient): a map
  manual over `data` has two other axes split there, where XLA's partitioner aborts on the lookup."""
  mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3,
                       devices=jax.devices()[:8])
  keys = jax.random.split(jax.random.key(seed), 3)
  table = jax.random.normal(keys[0], (16, 8))
  tokens = jax.random.randint(keys[1], (8, 4), 0, 16)
  return tuple(default.get_config("tiny").mesh.rules), mesh, table, tokens, jax.random.normal(keys[2], (8, 4, 8))


def test_the_per_device_lookup_gives_xlas_values_and_gradients():
  """Inside a map manual over `data` with fsdp 2 x tensor 2 split (where XLA's partitioner aborts on the lookup),
  each device looks its own tokens up in its vocabulary rows: the same embeddings, and the same table gradient (each
  device's rows summed over the batch devices once, not once per device)."""
  rules, mesh, table, tokens, cotangent = _lookup_case(0)

  def ours(t):
    def replica(t, tok, c):
      assert embed_lib._partitioner_aborts()
      return jax.lax.psum(jnp.sum(embed_lib._lookup_on_each_device(t, tok) * c), "data")
    with sharding.use_rules(mesh, rules):
      return jax.shard_map(replica, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P(),
                           axis_names={"data"}, check_vma=False)(t, tokens, cotangent)

  xla = lambda t: jnp.sum(jnp.take(t, tokens, axis=0) * cotangent)
  with jax.set_mesh(mesh):
    np.testing.assert_allclose(jax.jit(ours)(table), xla(table), rtol=1e-6)
    np.testing.assert_allclose(jax.jit(jax.grad(ours))(table), jax.grad(xla)(table), rtol=1e-6, atol=1e-6)


def test_token_gradients_add_up_to_the_lookups_transpose():
  """Inside a map manual over `data`, fsdp 2 x tensor 2 split, a table gradient (vocab over `tensor`, columns over
  fsdp) plus each token's gradient added in its row gives the start plus autodiff's gradient of `jnp.take`, every
  repeated token summed; `on` false leaves it as it was."""
  rules, mesh, start, tokens, dx = _lookup_case(1)

  def ours(on):
    def replica(g, tok, d):
      with sharding.use_rules(mesh, rules):
        added = embed_lib.add_token_gradients(g, tok, d, on)
      return jax.lax.psum(added - g, "data") + g  # Each replica's tokens, summed over the replicas.
    return jax.shard_map(replica, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P(),
                         axis_names={"data"}, check_vma=False)(start, tokens, dx)

  expected = start + jax.vjp(lambda t: jnp.take(t, tokens, axis=0), start)[1](dx)[0]
  assert len(set(np.asarray(tokens).ravel())) < tokens.size  # Repeated tokens: their gradients add.
  with jax.set_mesh(mesh):
    np.testing.assert_allclose(jax.jit(ours)(True), expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(jax.jit(ours)(False), start)
