"""`model.scan_layers=False` (one block after another) runs the step of the scanned layers: same losses, gradients
and updated state, on one device and on a mesh (float32: in bf16 XLA fuses the two programs' elementwise math
differently, and their roundings differ in the last bit)."""

import jax
import numpy as np
import pytest

from tests.helpers import config, one_step, random_batch


@pytest.mark.parametrize("preset,recipe,devices", [("tiny", "nvfp4", 1), ("tiny", "fp8_current", 8),
                                                   ("tiny_moe", "fp8_current", 8)])
def test_unrolled_layers_equal_the_scan(preset, recipe, devices):
  """4 layers in two segments (layer 0 excluded from quantization), under the preset's remat policy: every
  metric and every leaf of the new state (parameters, moments, amax statistics) within 1e-6. NVFP4 draws the
  same stochastic-rounding noise (each block's key is folded from its id either way)."""
  overrides = {"model.dtype": "float32", "quant.recipe": recipe, "model.num_layers": 4, "quant.exclude": ("layers[0]",),
               "train.batch_size": 8, "mesh.fsdp": devices}
  batch = random_batch(config(preset, **overrides), segments=3)
  scanned = one_step(config(preset, **overrides), batch, devices)
  unrolled = one_step(config(preset, **overrides, **{"model.scan_layers": False}), batch, devices)
  flat = jax.tree_util.tree_flatten_with_path(scanned)[0]
  assert len(flat) == len(jax.tree.leaves(unrolled))
  for (path, a), b in zip(flat, jax.tree.leaves(unrolled)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-6 * float(np.max(np.abs(a))),
                               err_msg=jax.tree_util.keystr(path))
