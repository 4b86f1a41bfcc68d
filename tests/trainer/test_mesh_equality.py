"""The same three training steps give the same losses on every mesh (float32)."""

import numpy as np
import pytest

from tests.helpers import config, random_batch, train_losses

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
  return config("tiny", **{"model.dtype": "float32", "quant.recipe": "bf16", "train.batch_size": 8,
                           "train.warmup_steps": 1, **mesh})


@pytest.fixture(scope="module")
def batches():
  cfg = _cfg()
  return [random_batch(cfg, seed=s) for s in range(3)]


@pytest.fixture(scope="module")
def single_device_losses(batches):
  return train_losses(_cfg(**{"mesh.fsdp": 1}), batches, num_devices=1)


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.variants
def test_losses_match_single_device(mesh, batches, single_device_losses):
  losses = train_losses(_cfg(**MESHES[mesh]), batches, num_devices=8)
  np.testing.assert_allclose(losses, single_device_losses, rtol=1e-5)
  assert losses[-1] < losses[0]  # The steps really trained.


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
