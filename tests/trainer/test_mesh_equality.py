"""The same three training steps give the same losses, gradient norms, parameters and optimizer state on every mesh
(float32)."""

import jax
import numpy as np
import pytest

from tests.helpers import config, random_batch, run_steps, train_losses

# One worker runs this module (`--dist loadgroup`): its tests share module-scoped state.
pytestmark = pytest.mark.xdist_group("test_mesh_equality")

MESHES = {
    "data8": {"mesh.data": 8, "mesh.fsdp": 1},
    "fsdp8": {"mesh.data": 1, "mesh.fsdp": 8},
    "data2_fsdp2_tensor2": {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2},
    # tiny's 2 kv heads over 4 tensor ranks: each rank computes a copy of its group's keys and values.
    "fsdp2_tensor4": {"mesh.data": 1, "mesh.fsdp": 2, "mesh.tensor": 4},
}


def _cfg(**mesh):
  # No warm-up: a first step at learning rate 0 would leave two of the three losses at the initial parameters.
  return config("tiny", **{"model.dtype": "float32", "quant.recipe": "bf16", "train.batch_size": 8,
                           "train.warmup_steps": 0, "train.learning_rate": 3e-3, **mesh})


def _figures(cfg, batches, num_devices):
  """(each step's (loss, gradient norm), the final parameters and optimizer state as one list of arrays)."""
  metrics, state = run_steps(cfg, batches, num_devices)
  return (np.asarray([(float(m["loss"]), float(m["grad_norm"])) for m in metrics]),
          jax.tree.leaves((state.params, state.opt_state)))


@pytest.fixture(scope="module")
def batches():
  cfg = _cfg()
  return [random_batch(cfg, seed=s) for s in (0, 1, 0)]  # Batch 0 again last: its loss has fallen.


@pytest.fixture(scope="module")
def single_device(batches):
  return _figures(_cfg(**{"mesh.fsdp": 1}), batches, num_devices=1)


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.variants
def test_training_matches_single_device(mesh, batches, single_device):
  """Losses alone would miss a gradient scaled on one mesh (Adam's update does not see a constant factor): the
  gradient norms and the moments are compared too, leaf by leaf (as a relative distance: an element whose gradient
  is near zero takes an Adam step that 1e-7 moves by far more, relatively)."""
  figures, state = _figures(_cfg(**MESHES[mesh]), batches, num_devices=8)
  want_figures, want_state = single_device
  np.testing.assert_allclose(figures, want_figures, rtol=1e-5)
  assert len(state) == len(want_state)
  for got, want in zip(state, want_state):
    assert got.shape == want.shape
    assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want) + 1e-12
  assert figures[-1, 0] < figures[0, 0] * (1 - 1e-3)  # The steps trained, by far more than the tolerance.


@pytest.mark.long
def test_fp8_sequence_parallel_losses_match_single_device(batches):
  """fp8_current on data 2 x fsdp 2 x tensor 2: each projection quantizes its input on its device's share of the
  tokens (the residual stream's length split over `tensor`) with the amax of the whole tensor, and `tensor`
  gathers the FP8 copy (layers/linear.py's `_sequence_parallel_axes`): one device's quantized values, so its
  losses."""
  fp8 = {"quant.recipe": "fp8_current"}
  one = train_losses(_cfg(**{"mesh.fsdp": 1}, **fp8), batches, num_devices=1)
  losses = train_losses(_cfg(**MESHES["data2_fsdp2_tensor2"], **fp8), batches, num_devices=8)
  np.testing.assert_allclose(losses, one, rtol=1e-5)
  assert losses[-1] < losses[0]
