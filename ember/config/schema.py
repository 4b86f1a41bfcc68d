"""The table of every key a config holds and what it may hold, read off the typed sections' field declarations
(ember/keys.py: kind, bound, choices; ember/config/settings.py), and the check that a config has exactly the
keys of the defaults (ember/config/defaults.py), each holding what it may. Rules within a section are its
class's; rules across sections are ember/config/checks.py's.
"""

from __future__ import annotations

import difflib
import functools

import ml_collections

from ember.config import defaults
from ember.config.settings import SECTIONS, Settings
from ember.errors import bad_key
from ember.keys import KeySpec, check_value, declared


def _table() -> dict[str, KeySpec]:
  out = {name: spec for name, _, spec in declared(Settings)}
  for section, cls in SECTIONS.items():
    out.update({f"{section}.{name}": spec for name, _, spec in declared(cls)})
  return out


KEYS = _table()  # {"train.batch_size": KeySpec("int", ">=1"), ...}: every key but quant.schedule.


def check(cfg) -> None:
  """Exactly the defaults' keys, each holding what it may: ConfigError naming the first that does not."""
  _check_known_keys(cfg)
  for key, spec in KEYS.items():
    check_value(key, _get(cfg, key), spec)



def _get(cfg, dotted):
  node = cfg
  for part in dotted.split("."):
    node = node[part]
  return node


def did_you_mean(dotted: str) -> str:
  """"; did you mean config.KEY?" for an unknown key with a known one near it (`nearest_key`), else ""."""
  near = nearest_key(dotted)
  return f"; did you mean config.{near}?" if near else ""


def nearest_key(dotted: str) -> str | None:
  """The known key nearest to an unknown `dotted` one: the one with its last part under another section (a key
  given the wrong section, `train.steps` for `steps`), else the closest spelling; None if none is close."""
  keys = list(KEYS)
  last = dotted.rsplit(".", 1)[-1]
  same_name = [k for k in keys if k.rsplit(".", 1)[-1] == last]
  if same_name:
    return min(same_name, key=len)
  close = difflib.get_close_matches(dotted, keys, n=1, cutoff=0.75)
  return close[0] if close else None


@functools.cache
def _defaults() -> ml_collections.ConfigDict:
  return defaults.get_config()


def is_key(dotted: str) -> bool:
  """Whether `dotted` (e.g. "train.batch_size") is a key of the defaults (ember/config/defaults.py)."""
  node = _defaults()
  for part in dotted.split("."):
    if not isinstance(node, ml_collections.ConfigDict) or part not in node:
      return False
    node = node[part]
  return True


def _check_known_keys(cfg) -> None:
  """Exactly the keys of the defaults: an extra key is a typo, a missing one a config file that did not start
  from `ember.config.defaults.get_config()`."""

  def walk(node, ref, prefix):
    for k in node.keys():
      if k not in ref:
        bad_key(prefix + k, "unknown config key (ember/config/defaults.py lists every key)" + did_you_mean(prefix + k))
      if isinstance(node[k], ml_collections.ConfigDict) and isinstance(ref[k], ml_collections.ConfigDict):
        walk(node[k], ref[k], f"{prefix}{k}.")
    missing = next((k for k in ref.keys() if k not in node), None)
    if missing is not None:
      bad_key(prefix + missing, "missing config key (start the config from ember.config.defaults.get_config())")

  walk(cfg, _defaults(), "")
