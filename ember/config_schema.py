"""What each key of the config may hold, one table per kind: every scalar key of configs/base.py with its
type and bound (`SCALARS`), the keys with a fixed set of values (`CHOICES`) and the string tuples; and the
check that a config has exactly configs/base.py's keys. Rules across keys are config.validate's.
"""

from __future__ import annotations

import importlib.util
import math
import os

import ml_collections

from ember import remat
from ember.errors import ConfigError
from ember.names import DATA_SOURCES, MOE_DISPATCHERS, MOE_EXPERT_GEMMS
from ember.quant.quantizers import AMAX_ALGOS
from ember.quant.recipe import FORWARDS, RECIPES, WGRAD_DTYPES

DTYPES = ("float32", "bfloat16", "float16")


def check(cfg) -> None:
  """Exactly configs/base.py's keys, each holding what it may: ConfigError naming the first that does not."""
  _check_known_keys(cfg)
  for key in SCALARS:
    check_scalar(cfg, key)
  for key in STRING_TUPLES:
    check_string_tuple(cfg, key)


def _fail(key: str, reason: str):
  raise ConfigError(f"config.{key}: {reason}")


def _get(cfg, dotted):
  node = cfg
  for part in dotted.split("."):
    node = node[part]
  return node


# --- Value checks, one table: every scalar key of configs/base.py and what it may hold. -------------
# (kind, bound): kind is int | float | bool | str; bound is "" (none), ">0", ">=N", "[0,1]" or "[0,1)".
SCALARS = {
    "workdir": ("str", ""), "seed": ("int", ">=0"), "steps": ("int", ">=1"),
    "model.name": ("str", ""), "model.num_layers": ("int", ">=1"), "model.d_model": ("int", ">=1"),
    "model.num_heads": ("int", ">=1"), "model.num_kv_heads": ("int", ">=1"), "model.head_dim": ("int", ">=0"),
    "model.d_ff": ("int", ">=1"), "model.vocab_size": ("int", ">=1"), "model.seq_len": ("int", ">=1"),
    "model.rope_theta": ("float", ">0"), "model.norm_eps": ("float", ">=0"),
    "model.qk_norm": ("bool", ""),
    "model.tie_embeddings": ("bool", ""), "model.param_dtype": ("str", ""),
    "model.dtype": ("str", ""), "model.attention": ("str", ""),
    "model.init_std": ("float", ">=0"), "model.num_experts": ("int", ">=0"),
    "model.experts_per_token": ("int", ">=1"), "model.moe_every": ("int", ">=1"),
    "model.shared_expert_d_ff": ("int", ">=0"), "model.router_softmax_first": ("bool", ""),
    "model.capacity_factor": ("float", ">=0"), "model.moe_dispatch": ("str", ""),
    "model.moe_ragged_buffer": ("float", ">0"), "model.moe_expert_gemm": ("str", ""),
    "model.moe_expert_buffer": ("float", ">0"), "model.load_balance_weight": ("float", ">=0"),
    "model.router_z_weight": ("float", ">=0"),
    "train.batch_size": ("int", ">=1"), "train.learning_rate": ("float", ">=0"),
    "train.warmup_steps": ("int", ">=0"), "train.decay_steps": ("int", ">=0"),
    "train.min_lr_ratio": ("float", "[0,1]"), "train.b1": ("float", "[0,1)"), "train.b2": ("float", "[0,1)"),
    "train.eps": ("float", ">0"), "train.weight_decay": ("float", ">=0"),
    "train.decay_norms_and_embeddings": ("bool", ""), "train.grad_clip_norm": ("float", ">=0"),
    "train.loss_chunk_size": ("int", ">=0"), "train.grad_accum_steps": ("int", ">=1"),
    "train.grad_reduce_dtype": ("str", ""),
    "train.z_loss_weight": ("float", ">=0"),
    "train.eval_every_steps": ("int", ">=0"), "train.eval_batches": ("int", ">=1"),
    "train.profile_start_step": ("int", ">=-1"), "train.profile_steps": ("int", ">=1"),
    "quant.recipe": ("str", ""), "quant.amax_history_len": ("int", ">=1"),
    "quant.amax_compute_algo": ("str", ""), "quant.margin": ("int", ">=0"),
    "quant.nvfp4_rht": ("bool", ""), "quant.nvfp4_stochastic_rounding": ("bool", ""),
    "quant.nvfp4_2d_weights": ("bool", ""), "quant.rht_seed": ("int", ">=0"), "quant.forward": ("str", ""),
    "remat.policy": ("str", ""), "remat.memory_budget_gb": ("float", ">=0"),
    "data.source": ("str", ""), "data.path": ("str", ""), "data.tokenizer": ("str", ""),
    "data.eval_fraction": ("float", "[0,1]"), "data.chunk_shuffle_window": ("int", ">=0"),
    "data.tfds_name": ("str", ""), "data.tfds_data_dir": ("str", ""),
    "data.tfds_text_key": ("str", ""), "data.text_key": ("str", ""), "data.cache_dir": ("str", ""),
    "data.num_threads": ("int", ">=1"), "data.num_shards": ("int", ">=0"),
    "mesh.dcn_data": ("int", ">=1"), "mesh.dcn_fsdp": ("int", ">=1"), "mesh.dcn_expert": ("int", ">=1"),
    "checkpoint.every_steps": ("int", ">=-1"), "checkpoint.keep": ("int", ">=1"),
    "checkpoint.async_save": ("bool", ""), "checkpoint.restore_from": ("str", ""),
    "checkpoint.params_only": ("bool", ""), "checkpoint.init_from_hf": ("str", ""),
    "log.every_steps": ("int", ">=1"), "log.tensorboard": ("bool", ""), "log.quant_stats_every": ("int", ">=0"),
    "distributed.coordinator_address": ("str", ""), "distributed.num_processes": ("int", ">=0"),
    "distributed.process_id": ("int", ">=-1"),
}
# Keys holding a tuple of strings.
STRING_TUPLES = ("quant.exclude", "remat.save_names", "remat.offload_names", "remat.auto_candidates")
# Keys with a fixed set of values.
CHOICES = {
    "model.param_dtype": DTYPES, "model.dtype": DTYPES, "model.attention": ("auto", "xla", "cudnn"),
    "model.moe_dispatch": MOE_DISPATCHERS, "model.moe_expert_gemm": MOE_EXPERT_GEMMS,
    "quant.recipe": RECIPES, "quant.amax_compute_algo": AMAX_ALGOS, "quant.forward": FORWARDS,
    "train.grad_reduce_dtype": WGRAD_DTYPES, "remat.policy": remat.POLICIES,
    "data.source": DATA_SOURCES,
}
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


def check_scalar(cfg, key: str) -> None:
  kind, bound = SCALARS[key]
  value = _get(cfg, key)
  if isinstance(value, bool) and kind in ("int", "float") or not isinstance(value, _TYPES[kind]):
    _fail(key, f"must be {_KIND_NAMES[kind]}, got {value!r}")
  if kind in ("int", "float") and not math.isfinite(value):
    _fail(key, f"must be finite, got {value!r}")
  if not _in_bound(value, bound):
    said = {"[0,1]": "in [0, 1]", "[0,1)": "in [0, 1)", ">0": "> 0"}.get(bound, f">= {bound[2:]}")
    _fail(key, f"must be {said}, got {value!r}")
  if key in CHOICES and value not in CHOICES[key]:
    _fail(key, f"unknown value {value!r}; choose one of {', '.join(CHOICES[key])}")


def check_string_tuple(cfg, key: str) -> tuple[str, ...]:
  value = _get(cfg, key)
  if not isinstance(value, (tuple, list)):
    _fail(key, f"must be a tuple of strings, e.g. ('a', 'b'), got {value!r}")
  bad = next((v for v in value if not isinstance(v, str)), None)
  if bad is not None:
    _fail(key, f"must hold strings only, got {bad!r}")
  return tuple(value)


def _base_config() -> ml_collections.ConfigDict | None:
  """configs/base.py of this checkout (every key, with its default); None where it is not shipped."""
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "base.py")
  if not os.path.isfile(path):
    return None
  spec = importlib.util.spec_from_file_location("_ember_base_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def is_key(dotted: str) -> bool:
  """Whether `dotted` (e.g. "train.batch_size") is a key of configs/base.py (True where it is not shipped)."""
  node = _base_config()
  if node is None:
    return True
  for part in dotted.split("."):
    if not isinstance(node, ml_collections.ConfigDict) or part not in node:
      return False
    node = node[part]
  return True


def _check_known_keys(cfg) -> None:
  """Exactly the keys of configs/base.py: an extra key is a typo, a missing one a config file that did
  not start from `base.get_config()`."""
  known = _base_config()

  def walk(node, ref, prefix):
    for k in node.keys():
      if k not in ref:
        _fail(prefix + k, "unknown config key (configs/base.py lists every key)")
      if isinstance(node[k], ml_collections.ConfigDict) and isinstance(ref[k], ml_collections.ConfigDict):
        walk(node[k], ref[k], f"{prefix}{k}.")
    missing = next((k for k in ref.keys() if k not in node), None)
    if missing is not None:
      _fail(prefix + missing, "missing config key (start the config from configs/base.py's get_config())")

  if known is not None:
    walk(cfg, known, "")
