"""Muon (train.optimizer=muon) against an independent NumPy Newton-Schulz, its parameter split, its equality across
meshes, and optimizer state stored in bfloat16."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ember.trainer import optimizer
from ember.trainer.optimizer import make_optimizer
from ember.trainer.state import logical_axes
from tests import helpers


def _numpy_newton_schulz(g: np.ndarray, steps: int = 5) -> np.ndarray:
  """Keller Jordan's zeropower_via_newtonschulz5 in float64 NumPy, on a [out, in] matrix as PyTorch holds it,
  times his scale sqrt(max(1, out / in))."""
  a, b, c = 3.4445, -4.7750, 2.0315
  x = g.astype(np.float64)
  tall = x.shape[0] > x.shape[1]
  if tall:
    x = x.T
  x = x / (np.sqrt(np.sum(x * x)) + 1e-7)
  for _ in range(steps):
    gram = x @ x.T
    x = a * x + (b * gram + c * gram @ gram) @ x
  if tall:
    x = x.T
  return x * max(1.0, g.shape[0] / g.shape[1]) ** 0.5


@pytest.mark.parametrize("shape", [(48, 16), (16, 48), (32, 32)])
def test_one_matrix_equals_numpy_newton_schulz(shape):
  """ember's [in, out] kernel layout is PyTorch's [out, in] transposed: the update must be NumPy's on the
  transpose, transposed back."""
  u = np.random.default_rng(0).normal(size=shape).astype(np.float32)
  layout = optimizer.MatrixLayout(batch=(), rows=(0,), cols=(1,))
  got = np.asarray(optimizer.orthogonalize(jnp.asarray(u), layout, 5, jnp.float32))
  np.testing.assert_allclose(got, _numpy_newton_schulz(u.T).T, rtol=2e-4, atol=2e-5)


def test_stacked_kernels_are_separate_matrices():
  """A [layers, experts, in, gate, out] kernel: each (layer, expert) is one [in, gate * out] matrix."""
  u = np.random.default_rng(1).normal(size=(2, 3, 16, 2, 8)).astype(np.float32)
  layout = optimizer.matrix_layout(("moe", "wi", "kernel"), ("layers", "expert", "embed", "gate", "mlp"))
  assert layout == optimizer.MatrixLayout(batch=(0, 1), rows=(2,), cols=(3, 4))
  got = np.asarray(optimizer.orthogonalize(jnp.asarray(u), layout, 5, jnp.float32))
  for i in range(2):
    for j in range(3):
      want = _numpy_newton_schulz(u[i, j].reshape(16, 16).T).T.reshape(16, 2, 8)
      np.testing.assert_allclose(got[i, j], want, rtol=2e-4, atol=2e-5)


def test_muon_takes_the_projection_kernels_and_adamw_the_rest():
  s = helpers.settings("tiny_moe", **{"model.shared_expert_d_ff": 32, "model.moe_every": 2, "model.num_layers": 4})
  _, axes, _ = logical_axes(s)
  flat = jax.tree_util.tree_flatten_with_path(axes, is_leaf=lambda a: isinstance(a, tuple))[0]
  kinds = {}
  for path, spec in flat:
    keys = optimizer.keys_of(path)
    name = "/".join(str(k) for k in keys if not isinstance(k, int))
    kinds[name] = optimizer.matrix_layout(keys, tuple(spec))
  on = {name for name, layout in kinds.items() if layout is not None}
  layers = "segments/blocks/layers/"
  assert on == {layers + p for p in ("attn/qkv/kernel", "attn/out/kernel", "mlp/wi/kernel", "mlp/wo/kernel",
                                     "moe/wi/kernel", "moe/wo/kernel", "moe/shared/wi/kernel",
                                     "moe/shared/wo/kernel")}
  # The attention output reads the heads and writes the residual stream.
  assert kinds[layers + "attn/out/kernel"] == optimizer.MatrixLayout(batch=(0,), rows=(1, 2), cols=(3,))
  assert kinds[layers + "attn/qkv/kernel"] == optimizer.MatrixLayout(batch=(0,), rows=(1,), cols=(2, 3, 4))


@pytest.mark.long
def test_a_step_updates_kernels_by_muon_and_the_rest_by_adamw():
  """One step from zero momentum with gradient G: a kernel moves by -lr_muon * NS((1 - beta)^2 G + beta (1 -
  beta) G) (Nesterov), the embedding by AdamW's first step, -lr * sign(G) (weight decay 0, eps aside)."""
  s = helpers.settings("tiny", **{"train.optimizer": "muon", "train.warmup_steps": 0, "train.weight_decay": 0.0,
                                  "train.grad_clip_norm": 0.0, "train.muon_learning_rate": 0.05})
  tx, schedule = make_optimizer(s)
  params = helpers.start(helpers.config("tiny"), 1).state.params
  grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(2), p.shape, jnp.float32), params)
  updates, _ = tx.update(grads, tx.init(params), params)
  beta = s.train.muon_momentum
  lr_muon = 0.05 * float(schedule(0)) / s.train.learning_rate  # The same schedule shape at Muon's peak.
  wo = np.asarray(grads["segments"][0]["blocks"]["layers"][0]["mlp"]["wo"]["kernel"])  # [layers, mlp, embed].
  got = np.asarray(updates["segments"][0]["blocks"]["layers"][0]["mlp"]["wo"]["kernel"])
  for layer in range(wo.shape[0]):
    u = (1 - beta) * wo[layer] + beta * (1 - beta) * wo[layer]
    np.testing.assert_allclose(got[layer], -lr_muon * _numpy_newton_schulz(u.T).T, rtol=3e-4, atol=1e-7)
  emb = np.asarray(grads["embed"]["embedding"])
  np.testing.assert_allclose(np.asarray(updates["embed"]["embedding"]), -float(schedule(0)) * np.sign(emb),
                             rtol=1e-3, atol=1e-7)
  # The step logs both rates: `lr`, AdamW's, and `lr_muon`, the kernels'.
  cfg = helpers.config("tiny", **{"train.optimizer": "muon", "train.warmup_steps": 0, "train.muon_learning_rate": 0.05})
  metrics, _ = helpers.one_step(cfg, helpers.random_batch(cfg), 1)
  assert float(metrics["lr_muon"]) == pytest.approx(lr_muon) and float(metrics["lr"]) == pytest.approx(schedule(0))


@pytest.mark.extended
def test_muon_trains_alike_on_one_device_and_under_fsdp_and_expert_parallelism():
  """Three steps of tiny_moe (float32) on one device, on fsdp=8 and on expert=4 x data=2: the same losses."""
  base = {"train.optimizer": "muon", "quant.recipe": "bf16", "model.dtype": "float32", "train.batch_size": 8,
          "train.warmup_steps": 0}
  cfg = helpers.config("tiny_moe", **base)
  batches = [helpers.random_batch(cfg, seed=i) for i in range(3)]
  one = helpers.train_losses(cfg, batches, 1)
  fsdp = helpers.train_losses(helpers.config("tiny_moe", **base, **{"mesh.fsdp": 8}), batches, 8)
  expert = helpers.train_losses(helpers.config("tiny_moe", **base, **{"mesh.fsdp": 1, "mesh.data": 2,
                                                                      "mesh.expert": 4}), batches, 8)
  assert one[-1] < one[0]
  np.testing.assert_allclose(fsdp, one, rtol=1e-5)
  np.testing.assert_allclose(expert, one, rtol=1e-5)


@pytest.mark.parametrize("name", ["adamw", pytest.param("muon", marks=pytest.mark.extended)])
@pytest.mark.long
def test_bfloat16_state_is_stored_in_bfloat16_and_updates_from_it(name):
  """Every floating leaf of the optimizer state is bfloat16; a step from a state equals the float32 optimizer's
  step from that state read up to float32."""
  over = {"train.optimizer": name, "train.warmup_steps": 0}
  half = helpers.settings("tiny", **over, **{"train.optimizer_state_dtype": "bfloat16"})
  full = helpers.settings("tiny", **over)
  (tx_half, _), (tx_full, _) = make_optimizer(half), make_optimizer(full)
  params = helpers.start(helpers.config("tiny"), 1).state.params
  grads = [jax.tree.map(lambda p, i=i: jax.random.normal(jax.random.key(i), p.shape, jnp.float32), params)
           for i in range(2)]
  state = tx_half.init(params)
  floats = [a for a in jax.tree.leaves(state) if jnp.issubdtype(a.dtype, jnp.floating)]
  assert floats and all(a.dtype == jnp.bfloat16 for a in floats)
  _, state = tx_half.update(grads[0], state, params)
  up_half, _ = tx_half.update(grads[1], state, params)
  widened = jax.tree.map(lambda a: a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a, state)
  up_full, _ = tx_full.update(grads[1], widened, params)
  for a, b in zip(jax.tree.leaves(up_half), jax.tree.leaves(up_full)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("count", [3, 8])
def test_every_stack_of_matrices_is_split_over_the_devices_each_matrix_whole(count):
  """fsdp 8: a stack of 3 matrices (a count the axis does not divide) is split over the 8 devices too, padded with
  zero matrices; it was left whole on every device, the stack gathered to each and every Newton-Schulz iteration
  run there. Its update is the one of each matrix alone."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  s = helpers.start(helpers.config("tiny", **{"model.num_layers": 3, "mesh.fsdp": 8, "train.optimizer": "muon"}), 8)
  layout = optimizer.MatrixLayout(batch=(0,), rows=(1,), cols=(2,), axes=("layers", "embed", "mlp"))
  u = jax.random.normal(jax.random.key(0), (count, 64, 128), jnp.float32)
  with s.rules():
    x = jax.device_put(u, NamedSharding(s.mesh, P(None, "fsdp", None)))
    assert jax.jit(optimizer._whole_matrices)(x).sharding.spec[0] in ("fsdp", ("fsdp",))
    got = jax.jit(lambda a: optimizer.orthogonalize(a, layout, 5, jnp.float32))(x)
  want = np.stack([np.asarray(optimizer.orthogonalize(u[i:i + 1], layout, 5, jnp.float32))[0] for i in range(count)])
  assert got.shape == u.shape
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)
