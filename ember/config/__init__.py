"""The config: one package, read in this order.

  defaults.py   every key and its default, with a comment on each (user presets start from `get_config()`);
  loading.py    the command line to a config tree (`load`), and `usage`;
  schema.py     what each key may hold, read off the typed sections' declarations, and the check that a tree
                has exactly the defaults' keys;
  phases.py     `quant.schedule`: which quant.* settings apply from which step;
  model.py      the model's shape (`ModelConfig`), what the layers read;
  settings.py   the typed, frozen sections (`Settings`) and the values derived from others;
  checks.py     `validate` (the rules across sections) and `derive` (the tree to `Settings`).

The key declarations themselves (`key`, `KeySpec`: ember/keys.py) sit below this package: the recipe table
(ember/quant/recipe.py) declares its keys with them too.
"""

from ember.config.checks import derive, directory_problem, validate
from ember.config.loading import load, usage
from ember.errors import ConfigError

__all__ = ["ConfigError", "derive", "directory_problem", "load", "usage", "validate"]
