"""Parameters from a Hugging Face Llama / Mixtral directory, sharded straight onto the mesh.

Each ember parameter is assembled from the shards its process's devices hold
(`jax.make_array_from_single_device_arrays`), read from memory-mapped safetensors
(ember/hf/safetensors.py) one layer's tensor at a time, each layer once: no process ever holds a full
copy of the model, only its own shards and one layer's tensor. Every tensor's
presence and shape are checked first, against the shapes `layout.to_hf` gives ember's parameters; a
difference is one CheckpointError naming the tensor.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np

from ember.config.model import ModelConfig
from ember.errors import CheckpointError
from ember.hf import layout
from ember.hf.safetensors import Reader
from ember.layers.decoder import keys_of, tree_leaves
from ember.quant.recipe import Recipe

WHAT = "config.checkpoint.init_from_hf"


def expected_tensors(m: ModelConfig, recipe: Recipe, abstract_params: dict) -> dict[str, tuple[int, ...]]:
  """HF name -> shape for ember's parameter shapes (traced with `jax.eval_shape`: no arrays are made)."""
  out = {}
  for path, leaf in tree_leaves(abstract_params):
    rule, layers = layout.leaf_source(m, recipe, path)
    one = jax.ShapeDtypeStruct(leaf.shape if layers is None else leaf.shape[1:], leaf.dtype)
    hf = jax.eval_shape(lambda w, rule=rule: rule.to_hf(m, w), one)
    for layer in [None] if layers is None else layers:
      prefix = "" if layer is None else layout.layer_prefix(layer)
      out.update({prefix + k: tuple(v.shape) for k, v in hf.items()})
  return out


def check(directory: str, m: ModelConfig, recipe: Recipe, abstract_params: dict) -> Reader:
  """The directory's reader once config.json and every tensor agree with the model; else CheckpointError."""
  problem = layout.unsupported(m)
  if problem:
    raise CheckpointError(f"{WHAT}: {problem}")
  try:
    with open(os.path.join(directory, "config.json")) as f:
      hf_config = json.load(f)
  except (OSError, ValueError) as e:
    raise CheckpointError(f"{WHAT}: cannot read {directory}/config.json ({type(e).__name__}: {e})") from None
  problem = layout.config_mismatch(m, hf_config)
  if problem:
    raise CheckpointError(f"{WHAT}: {directory}/config.json: {problem}")
  reader = Reader(directory)
  want = expected_tensors(m, recipe, abstract_params)
  for name, shape in want.items():
    if name not in reader and m.mtp_depth and name.startswith(layout.mtp_prefix(m, 0)):
      raise CheckpointError(f"{WHAT}: {directory} holds no multi-token-prediction module ({name} is missing); set "
                            f"config.model.mtp_depth=0, or to the modules it holds")
    if name not in reader:
      raise CheckpointError(f"{WHAT}: {directory} has no tensor {name} (shape {shape} in this config)")
    if reader.shape(name) != tuple(shape):
      raise CheckpointError(f"{WHAT}: tensor {name} has shape {reader.shape(name)} in {directory} but "
                            f"{tuple(shape)} in this config")
  ignored = {"lm_head.weight"} if m.tie_embeddings else set()  # Tied models may store the head anyway.
  # DeepSeek's multi-token-prediction modules hold copies of the shared embedding and head; its routers' biases
  # are the model's router state (`router_biases`), not parameters.
  ignored |= {layout.mtp_prefix(m, k) + name for k in range(m.mtp_depth) for name in layout.MTP_SHARED}
  ignored |= set(_router_bias_names(m, reader))
  extra = next((n for n in reader.names() if n not in want and n not in ignored
                and not n.endswith("rotary_emb.inv_freq")), None)
  if extra is not None:
    raise CheckpointError(f"{WHAT}: tensor {extra} (shape {reader.shape(extra)}) of {directory} has no place "
                          "in this config")
  return reader


def _router_bias_names(m: ModelConfig, reader: Reader) -> list[str]:
  """The routers' bias tensors of the directory ({layer prefix}mlp.gate.e_score_correction_bias); where the model
  keeps no router bias (model.router_bias_update_rate = 0) each must be zero, else it would route otherwise."""
  names = [n for n in reader.names() if n.endswith("mlp.gate.e_score_correction_bias")]
  if not m.router_bias_update_rate:
    live = next((n for n in names if np.any(np.asarray(reader[n]) != 0)), None)
    if live is not None:
      raise CheckpointError(f"{WHAT}: tensor {live} is not zero; set config.model.router_bias_update_rate > 0 so "
                            "that the model keeps its routers' biases")
  return names


def keeps_router_biases(m: ModelConfig) -> bool:
  """Whether the model's Hugging Face form holds its routers' biases (DeepSeek-V3's, where the model has them)."""
  return m.is_moe and bool(m.router_bias_update_rate) and layout.family(m) == "deepseek_v3"


def router_biases(directory: str, m: ModelConfig, recipe: Recipe, quant_state: dict) -> dict:
  """`quant_state` (a new run's, placed) with every MoE layer's router bias read from the directory's
  `mlp.gate.e_score_correction_bias` (DeepSeek-V3): the bias is routing state, kept beside the amax histories."""
  from ember.layers.moe import ROUTER_BIAS
  reader = Reader(os.path.abspath(os.path.expanduser(directory)))

  def take(path, leaf):
    keys = keys_of(path)
    return _load_leaf(reader, m, recipe, keys, leaf, leaf.sharding) if keys[-1] == ROUTER_BIAS else leaf

  return jax.tree_util.tree_map_with_path(take, quant_state)


def load_params(directory: str, m: ModelConfig, recipe: Recipe, abstract_params: dict,
                shardings: dict) -> dict:
  """ember's parameter tree (arrays placed by `shardings`) from the HF directory."""
  directory = os.path.abspath(os.path.expanduser(directory))
  reader = check(directory, m, recipe, abstract_params)
  return jax.tree_util.tree_map_with_path(lambda p, leaf, sh: _load_leaf(reader, m, recipe, keys_of(p), leaf, sh),
                                          abstract_params, shardings)


def _load_leaf(reader: Reader, m: ModelConfig, recipe: Recipe, path: tuple, leaf,
               sharding) -> jax.Array:
  """One parameter, from this process's shards only: each layer's tensor is built once and its slices go
  straight into the host buffer of every local device that holds part of it."""
  rule, layers = layout.leaf_source(m, recipe, path)
  dtype, shape = np.dtype(leaf.dtype), tuple(leaf.shape)
  indices = sharding.addressable_devices_indices_map(shape)  # device -> tuple of slices
  # Zeros: a pipeline's padding rows past the model's layers (pipeline.padded_blocks) are read from nowhere.
  buffers = {d: np.zeros([len(range(*s.indices(n))) for s, n in zip(index, shape)], dtype)
             for d, index in indices.items()}

  def build(prefix: str) -> np.ndarray:
    return np.asarray(rule.from_hf(m, lambda name, _: reader[prefix + name]), dtype)

  if layers is None:
    whole = build("")
    for d, index in indices.items():
      buffers[d][...] = whole[index]
  else:
    rows = {d: range(*index[0].indices(shape[0])) for d, index in indices.items()}  # Each device's rows.
    for row, layer in enumerate(layers):
      wanted = [d for d in indices if row in rows[d]]
      if wanted:
        tensor = build(layout.layer_prefix(layer))
        for d in wanted:
          buffers[d][rows[d].index(row)] = tensor[indices[d][1:]]
  arrays = [jax.device_put(buffers[d], d) for d in indices]
  return jax.make_array_from_single_device_arrays(shape, sharding, arrays)
