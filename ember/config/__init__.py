"""The config: one package, read in this order.

  defaults.py   every key and its default, with a comment on each (user presets start from `get_config()`);
  loading.py    the command line to a config tree (`load`), and `usage`;
  schema.py     what each key may hold, read off the typed sections' declarations, and the check that a tree
                has exactly the defaults' keys;
  phases.py     `quant.schedule`: which quant.* settings apply from which step;
  model.py      the model's shape (`ModelConfig`), what the layers read;
  settings.py   the typed, frozen sections (`Settings`) and the values derived from others;
  checks.py     `validate` (the rules across sections; the tree to `Settings`), `on_devices` (the settings
                once the devices are known) and `derive` (the tree to `Settings`, unchecked).

Past `validate` only the typed, frozen `Settings` travels: the trainer, the planner, inference and the tools
take it and change it with `dataclasses.replace` (or `Settings.replace("section.key", value)`).

The key declarations themselves (`key`, `KeySpec`: ember/keys.py) sit below this package: the recipe table
(ember/quant/recipe.py) declares its keys with them too.
"""

from ember.config.checks import derive, directory_problem, from_saved, on_devices, validate
from ember.config.loading import load, usage
from ember.config.settings import Settings
from ember.errors import ConfigError

__all__ = ["ConfigError", "Settings", "derive", "directory_problem", "from_saved", "load", "on_devices", "usage",
           "validate"]
