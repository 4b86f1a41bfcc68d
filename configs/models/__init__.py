"""Model shape presets: `--config=configs/default.py:NAME` picks `configs/models/NAME.py`.

Each preset module defines `MODEL`, a dict of `model.*` keys (and optionally `TRAIN`, a dict of
`train.*` keys that only make sense for that size, such as the sequence length it was trained at).
"""

import importlib
import pkgutil

PRESETS = tuple(sorted(m.name for m in pkgutil.iter_modules(__path__)))


def get(name: str):
  """Returns the preset module `configs.models.NAME`; raises ValueError naming the choices."""
  if name not in PRESETS:
    raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
  return importlib.import_module(f"{__name__}.{name}")
