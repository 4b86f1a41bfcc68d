"""The no-download run: a small decoder on this interpreter's own stdlib source, byte tokens.

  python train.py --config=configs/default.py            # the `small` model, ~200 steps on CPU
  python train.py --config=configs/default.py:tiny       # any preset in configs/models/
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configs import models  # noqa: E402
from ember.config import defaults  # noqa: E402


def get_config(preset: str = "small"):
  c = defaults.get_config()
  c.workdir = f"runs/default_{preset}"
  c.steps = 200
  c.quant.recipe = "fp8_current"
  c.train.learning_rate = 1e-3
  c.train.warmup_steps = 20
  c.train.eval_every_steps = 100
  c.checkpoint.every_steps = 100
  c.log.every_steps = 10
  return apply_preset(c, preset)


def apply_preset(c, preset: str):
  """Applies `configs/models/PRESET.py` to the config `c` (model shape and size-specific train and remat keys)."""
  p = models.get(preset)
  c.model.update(p.MODEL)
  c.train.update(getattr(p, "TRAIN", {}))
  c.remat.update(getattr(p, "REMAT", {}))
  return c
