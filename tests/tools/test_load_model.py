"""A checkpoint loaded for sampling under another recipe whose `quant.exclude` stacks the layers differently."""

import numpy as np
from flax import nnx

from ember.inference.checkpoint import load_model
from ember.layers.decoder import rows_by_layer
from ember.trainer.loop import train
from ember.trainer.state import split_model
from tests.helpers import checked, config


def test_another_recipe_reads_each_layer_where_it_stacks_it(tmp_path):
  """Trained with layers[0] excluded (scan segments [0], [1]), sampled unquantized ([0, 1]): each layer's
  parameters where the new stacking puts them. Read as saved, the shapes differed and the load failed."""
  train(checked(config(steps=1, workdir=str(tmp_path), **{"quant.recipe": "fp8_current",
                                                          "quant.exclude": ("layers[0]",)})))
  views = {}
  for recipe in (None, "bf16"):
    cfg, _, model = load_model(str(tmp_path), what="test", recipe=recipe, one_device=True)
    assert len(cfg.model.segments(cfg.quant)) == (2 if recipe is None else 1)
    views[recipe] = rows_by_layer(nnx.to_pure_dict(split_model(model)[1]), cfg.model, cfg.quant)
  assert views[None].keys() == views["bf16"].keys()
  for key, row in views[None].items():
    np.testing.assert_array_equal(np.asarray(views["bf16"][key]), np.asarray(row))
