"""A recipe: which format every projection matmul runs in, and its options (static, hashable).

Built once from the config's `quant` section and passed to every projection. It holds no arrays
and no mesh: per-step state (delayed-scaling amax histories) lives in the train state, and where
an amax is reduced is decided where a tensor is quantized.
"""

from __future__ import annotations

import dataclasses
import fnmatch

RECIPES = ("bf16", "fp8_delayed", "fp8_current", "mxfp8", "nvfp4")


@dataclasses.dataclass(frozen=True)
class Recipe:
  name: str = "bf16"
  amax_history_len: int = 1024
  amax_compute_algo: str = "max"
  margin: int = 0
  nvfp4_rht: bool = True
  nvfp4_stochastic_rounding: bool = True
  nvfp4_2d_weights: bool = True
  rht_seed: int = 0
  exclude: tuple[str, ...] = ()

  def __post_init__(self):
    if self.name not in RECIPES:
      raise ValueError(f"unknown recipe {self.name!r}; choose one of {', '.join(RECIPES)}")

  @classmethod
  def from_config(cls, quant_cfg) -> "Recipe":
    fields = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in quant_cfg.items() if k in fields}
    values["name"] = quant_cfg.recipe
    values["exclude"] = tuple(quant_cfg.get("exclude", ()))
    return cls(**values)

  @property
  def quantized(self) -> bool:
    return self.name != "bf16"

  @property
  def delayed(self) -> bool:
    return self.name == "fp8_delayed"

  @property
  def block_size(self) -> int:
    """Elements per scaling block along a contraction axis (1 = per-tensor scaling)."""
    return {"mxfp8": 32, "nvfp4": 16}.get(self.name, 1)

  def for_path(self, path: str) -> "Recipe":
    """The recipe a projection at `path` (e.g. `layers.3.mlp.wo`, `lm_head`) runs in: bf16 if excluded."""
    if self.quantized and any(fnmatch.fnmatchcase(path, pat) for pat in self.exclude):
      return dataclasses.replace(self, name="bf16")
    return self
