"""`model.scan_layers=False` (one block after another) runs the step of the scanned layers: same losses, gradients
and updated state, on one device and on a mesh (float32: in bf16 XLA fuses the two programs' elementwise math
differently, and their roundings differ in the last bit)."""

import jax
import numpy as np
import pytest

from tests.helpers import config, one_step, random_batch


@pytest.mark.long
@pytest.mark.parametrize("preset,recipe,devices", [pytest.param("tiny", "nvfp4", 1, marks=pytest.mark.extended),
                                                   ("tiny", "fp8_current", 8),
                                                   pytest.param("tiny_moe", "fp8_current", 8,
                                                                marks=pytest.mark.extended)])
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


@pytest.mark.extended
def test_unrolled_layers_cast_each_kernel_from_its_own_row(monkeypatch):
  """Unrolled NVFP4 layers hand each projection's tile cast the stacked kernels and the layer's row
  (`linear.Taken`; on a GPU the cast reads the row in place). With the cast run here (interpret mode:
  the tile path made to apply to the float32 kernels on the CPU), the step equals, bit for bit, one whose casts
  read each layer's kernel copied out, and every layer's row is read."""
  from ember.layers import linear
  from ember.quant import fused_nvfp4

  rows = []
  quantize = fused_nvfp4.quantize

  def cast(a, row_of=None, **kw):
    rows.append(None if row_of is None else row_of[1])
    return quantize(a, row_of=row_of, **{**kw, "interpret": True})

  kernels_only = lambda layout, recipe, stats, *ops: layout.transposed and all(o.dtype == np.float32 for o in ops)
  monkeypatch.setattr(fused_nvfp4, "one_pass", kernels_only)
  monkeypatch.setattr(fused_nvfp4, "casts_kernel_tiles", lambda recipe: True)
  monkeypatch.setattr(fused_nvfp4, "quantize", cast)
  overrides = {"quant.recipe": "nvfp4", "model.num_layers": 3, "model.scan_layers": False, "train.batch_size": 4}
  batch = random_batch(config("tiny", **overrides))
  in_place = one_step(config("tiny", **overrides), batch, 1)
  assert sorted(set(rows)) == [0, 1, 2], rows
  monkeypatch.setattr(linear, "stacked_kernels", lambda blocks: {})
  rows.clear()
  copied = one_step(config("tiny", **overrides), batch, 1)
  assert rows and set(rows) == {None}
  for a, b in zip(jax.tree.leaves(in_place), jax.tree.leaves(copied)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
