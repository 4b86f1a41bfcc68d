"""The projection module (ember/layers/linear.py) on a mesh: the output and gradients one device computes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ember.layers.linear import Linear
from ember.names import BATCH, EMBED, GATE, LENGTH, MLP
from ember.parallel.sharding import use_rules
from ember.quant.recipe import Recipe
from tests.xla_cpu import EXACT_FP4_CASTS


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_a_gate_up_kernel_split_over_tensor_keeps_one_devices_blocks(recipe):
  """The gate/up kernel [embed, 2, mlp] with mlp split over `tensor` is flattened to its N with each device's gate
  and up columns apart ([tensor, 2, mlp / tensor]), so every block along N is one device's: NVFP4's 16 x 16 weight
  tiles (the output), and the blocks of the kernel's and the gradient's copies quantized along N (the input's
  gradient). Flattened as [mlp, 2], a block mixed gate and up columns, and tensor 2 computed other numbers."""
  d, f = 64, 128
  x = jax.random.normal(jax.random.key(0), (2, 32, d))
  dy = jax.random.normal(jax.random.key(1), (2, 32, 2, f))
  rules = ((BATCH, None), (LENGTH, None), (EMBED, None), (GATE, None), (MLP, "tensor"))
  one_device = Mesh(np.array(jax.devices()[:1]), ("tensor",))
  with nnx.use_eager_sharding(False):  # Laid out below, as trainer/state.py's build_model leaves it.
    graphdef, state = nnx.split(Linear((d,), (2, f), (EMBED, GATE, MLP), name="wi", init_std=0.5, dtype=jnp.float32,
                                       param_dtype=jnp.float32, rngs=nnx.Rngs(0),
                                       recipe=Recipe(recipe, nvfp4_stochastic_rounding=False, nvfp4_rht=False)))

  @jax.jit
  def run(state, x):
    loss = lambda state, x: jnp.sum(nnx.merge(graphdef, state)(x) * dy)
    return jax.value_and_grad(loss, argnums=(0, 1))(state, x)

  run = jax.jit(run.__wrapped__, compiler_options=EXACT_FP4_CASTS)  # Casts to E2M1 rounded once (tests/xla_cpu.py).
  with use_rules(one_device, rules):
    one = run(state, x)
  mesh = Mesh(np.array(jax.devices()[:2]), ("tensor",))
  with use_rules(mesh, rules):
    kernel = NamedSharding(mesh, P(None, None, "tensor"))
    state = jax.tree.map(lambda a: jax.device_put(a, kernel) if a.ndim == 3 else a, state)
    got = run(state, x)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(one)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
