"""A config key, declared on the dataclass field that holds it: what the key may hold (its kind, bound and
choices) travels with the typed field, so the table that checks a config file (ember/config/schema.py) and
the typed config it becomes (ember/config/settings.py, ember/config/model.py, ember/quant/recipe.py) cannot
disagree. A leaf module.
"""

from __future__ import annotations

import dataclasses
import math

from ember.errors import bad_key

# What a key holds: "int", "float" (an int is accepted), "bool", "str", "strs" (a tuple of strings), or
# "value" (a structured value its section's own rules check: mesh.rules, data.mixture, quant.schedule).
KINDS = ("int", "float", "bool", "str", "strs", "value")


@dataclasses.dataclass(frozen=True)
class KeySpec:
  kind: str
  bound: str = ""  # "" (none), ">0", ">=N", "[0,1]" or "[0,1)".
  choices: tuple = ()
  name: str = ""  # The key's name in its config section, where it is not the field's.


def key(kind: str, bound: str = "", choices: tuple = (), *, name: str = "", **field_kwargs) -> dataclasses.Field:
  """A dataclass field that holds config key `name` (default: the field's name) of `kind`."""
  assert kind in KINDS, kind
  return dataclasses.field(metadata={"key": KeySpec(kind, bound, tuple(choices), name)}, **field_kwargs)


def declared(cls) -> list[tuple[str, dataclasses.Field, KeySpec]]:
  """(key name, field, spec) of every field of dataclass `cls` that holds a config key, in field order."""
  out = []
  for f in dataclasses.fields(cls):
    spec = f.metadata.get("key")
    if spec is not None:
      out.append((spec.name or f.name, f, spec))
  return out


def check_fields(obj, section: str) -> None:
  """Every declared field of dataclass instance `obj` holds what its key may (see `check_value`)."""
  for name, f, spec in declared(type(obj)):
    check_value(f"{section}.{name}", getattr(obj, f.name), spec)


_TYPES = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}
_KIND_NAMES = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}


def _in_bound(value, bound: str) -> bool:
  if not bound:
    return True
  if bound == ">0":
    return value > 0
  if bound == "[0,1]":
    return 0 <= value <= 1
  if bound == "[0,1)":  # Adam's betas: 1 would divide by zero in the bias correction.
    return 0 <= value < 1
  return value >= float(bound[2:])


def check_value(dotted: str, value, spec: KeySpec) -> None:
  """ConfigError naming `config.<dotted>` when `value` is not of the key's kind, bound and choices."""
  if spec.kind == "value":
    return  # Its section's own rules check it.
  if spec.kind == "strs":
    if not isinstance(value, (tuple, list)):
      bad_key(dotted, f"must be a tuple of strings, e.g. ('a', 'b'), got {value!r}")
    bad = next((v for v in value if not isinstance(v, str)), None)
    if bad is not None:
      bad_key(dotted, f"must hold strings only, got {bad!r}")
    return
  kind, bound = spec.kind, spec.bound
  if isinstance(value, bool) and kind in ("int", "float") or not isinstance(value, _TYPES[kind]):
    bad_key(dotted, f"must be {_KIND_NAMES[kind]}, got {value!r}")
  if kind in ("int", "float") and not math.isfinite(value):
    bad_key(dotted, f"must be finite, got {value!r}")
  if not _in_bound(value, bound):
    said = {"[0,1]": "in [0, 1]", "[0,1)": "in [0, 1)", ">0": "> 0"}.get(bound, f">= {bound[2:]}")
    bad_key(dotted, f"must be {said}, got {value!r}")
  if spec.choices and value not in spec.choices:
    bad_key(dotted, f"unknown value {value!r}; choose one of {', '.join(spec.choices)}")


