"""The config, typed: one frozen dataclass per section, built once by `config.derive` (`Settings.from_config`).

Each field that holds a config key declares it (`keys.key`: kind, bound, choices), so the check of a config
file (ember/config/schema.py) reads its table off these classes; each section's `__post_init__` holds the
section's own rules, and rules across sections stay in ember/config.py. The `model` section is
`ModelConfig` and the `quant` section the `Recipe`; their fields declare their keys the same way.
Everything below the entry points (train.py and the tools) reads these objects, never the ConfigDict.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import numpy as np

from ember import remat, storage
from ember.config import phases as config_phases
from ember.config.model import ModelConfig
from ember.errors import DataError, bad_key, one_line
from ember.keys import declared, key
from ember.names import (DATA_SOURCES, LOGICAL_AXES, MESH_AXES, MIXABLE_SOURCES, OPTIMIZERS, PIPELINE,
                         PIPELINE_SCHEDULES, SOURCE_NEEDS, STATE_DTYPES)

from ember.parallel import mesh as mesh_lib
from ember.parallel import pipeline as pipeline_lib
from ember.parallel import sharding as sharding_lib
from ember.quant.recipe import WGRAD_DTYPES, Recipe



@dataclasses.dataclass(frozen=True)
class Train:
  batch_size: int = key("int", ">=1")  # Global, in sequences, of one optimizer step.
  learning_rate: float = key("float", ">=0")
  warmup_steps: int = key("int", ">=0")
  decay_steps: int = key("int", ">=0")  # The key's 0 (= until `steps`) is resolved by the builder.
  min_lr_ratio: float = key("float", "[0,1]")
  b1: float = key("float", "[0,1)")
  b2: float = key("float", "[0,1)")
  eps: float = key("float", ">0")
  weight_decay: float = key("float", ">=0")
  decay_norms_and_embeddings: bool = key("bool")
  grad_clip_norm: float = key("float", ">=0")
  optimizer: str = key("str", choices=OPTIMIZERS)
  muon_learning_rate: float = key("float", ">=0")
  muon_weight_decay: float = key("float", ">=0")
  muon_momentum: float = key("float", "[0,1)")
  muon_ns_steps: int = key("int", ">=1")
  muon_ns_dtype: str = key("str", choices=STATE_DTYPES)
  optimizer_state_dtype: str = key("str", choices=STATE_DTYPES)
  shard_optimizer_state: bool = key("bool")
  grad_accum_steps: int = key("int", ">=1")
  device_batch_size: int = key("int", ">=0")  # > 0: grad_accum_steps follows from it and the mesh (`_accumulation`).
  grad_reduce_dtype: str = key("str", choices=WGRAD_DTYPES)
  schedule_by_prediction: bool = key("bool")  # ember/program/schedule.py.
  loss_chunk_size: int = key("int", ">=0")
  z_loss_weight: float = key("float", ">=0")
  eval_every_steps: int = key("int", ">=0")
  eval_batches: int = key("int", ">=1")
  profile_start_step: int = key("int", ">=-1")
  profile_steps: int = key("int", ">=1")
  max_skipped_steps: int = key("int", ">=0")
  step_timeout_s: float = key("float", ">=-1")  # 0 = auto, -1 = off (ember/trainer/watchdog.py).
  compile_timeout_s: float = key("float", ">0")
  preempted_exit_status: int = key("int", ">=0")
  compilation_cache_dir: str = key("str")  # "" = off (ember/trainer/loop.py's `prepare` turns it on).

  def __post_init__(self):
    if -1 < self.step_timeout_s < 0:
      bad_key("train.step_timeout_s", f"{self.step_timeout_s} is neither seconds (> 0), 0 (auto) nor -1 (off)")
    if self.preempted_exit_status > 255:
      bad_key("train.preempted_exit_status", f"{self.preempted_exit_status} is not an exit status (0-255)")
    if self.optimizer_state_dtype == "bfloat16":
      # A moment m <- beta m + ... rounded to bf16 (to nearest) decays by at most (1 - beta) m a step: below half
      # of bf16's rounding step (2^-8 of m, at worst) it would never decay, only grow.
      betas = {"b1": self.b1, "b2": self.b2, **({"muon_momentum": self.muon_momentum} if self.optimizer == "muon"
                                                 else {})}
      for name, beta in betas.items():
        if 1 - beta <= 2**-8:
          bad_key(f"train.{name}", f"{beta} with train.optimizer_state_dtype=bfloat16: a moment stored in bf16 "
                  f"moves by at most 1 - {name} = {1 - beta:.3g} of itself a step, under half of bf16's rounding "
                  f"step (2^-8), so it would never decay; use {name} < {1 - 2**-8:.4f} or float32 state")

  @property
  def micro_batch_size(self) -> int:
    """Sequences of one micro-batch (the global batch over `grad_accum_steps`)."""
    return self.batch_size // self.grad_accum_steps


@dataclasses.dataclass(frozen=True)
class Remat:
  policy: str = key("str", choices=remat.POLICIES)
  save_names: tuple[str, ...] = key("strs")
  offload_names: tuple[str, ...] = key("strs")
  memory_budget_gb: float = key("float", ">=0")
  auto_candidates: tuple[str, ...] = key("strs")

  def __post_init__(self):
    remat.validate(self)

  @property
  def preset(self) -> remat.Preset:
    """The preset this section names (`custom`: its lists); `auto` must have been resolved."""
    return remat.preset(self)


@dataclasses.dataclass(frozen=True)
class Mesh:
  """Per-host axis sizes (-1 resolved once the devices are known) and host counts; `rules` maps logical axes
  to mesh axes."""
  data: int = key("value")  # The mesh's own rules check the axes (ember/parallel/mesh.py: ici_dcn).
  fsdp: int = key("value")
  context: int = key("value")
  tensor: int = key("value")
  expert: int = key("value")
  dcn_data: int = key("int", ">=1")
  dcn_fsdp: int = key("int", ">=1")
  dcn_expert: int = key("int", ">=1")
  pipeline: int = key("value")
  dcn_pipeline: int = key("int", ">=1")
  rules: tuple = key("value")

  def __post_init__(self):
    object.__setattr__(self, "rules", _checked_rules(self.rules))

  @property
  def rules_dict(self) -> dict[str, tuple[str, ...]]:
    return sharding_lib.rules_dict(self.rules)

  def sizes(self) -> dict[str, int]:
    """{axis: size of the whole mesh along it} (per-host size times hosts); no -1 left."""
    return {a: getattr(self, a) * getattr(self, f"dcn_{a}", 1) for a in MESH_AXES}


def _checked_rules(rules) -> tuple[tuple[str, tuple[str, ...]], ...]:
  """`mesh.rules` as ((logical axis, (mesh axes...)), ...); ConfigError naming the bad entry."""
  out = []
  if not isinstance(rules, (tuple, list)):
    bad_key("mesh.rules", f"must be a tuple of (logical axis, mesh axes) pairs, got {rules!r}")
  for rule in rules:
    if not isinstance(rule, (tuple, list)) or len(rule) != 2 or not isinstance(rule[0], str):
      bad_key("mesh.rules", f"entry {rule!r} is not a (logical axis, mesh axes) pair")
    logical, axes = rule
    if logical not in LOGICAL_AXES:
      bad_key("mesh.rules", f"unknown logical axis {logical!r}; ember's layers name {', '.join(LOGICAL_AXES)}")
    axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
    if not isinstance(axes, (tuple, list)) or any(a not in MESH_AXES for a in axes):
      bad_key("mesh.rules", f"{logical!r} maps to {rule[1]!r}; mesh axes are {', '.join(MESH_AXES)} (or None)")
    out.append((logical, tuple(axes)))
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class Data:
  source: str = key("str", choices=DATA_SOURCES)
  path: str = key("str")
  tokenizer: str = key("str")
  eval_fraction: float = key("float", "[0,1)")
  chunk_shuffle_window: int = key("int", ">=0")
  tfds_name: str = key("str")
  tfds_data_dir: str = key("str")
  tfds_text_key: str = key("str")
  hf_dataset: str = key("str")
  hf_config: str = key("str")
  hf_split: str = key("str")
  text_key: str = key("str")
  cache_dir: str = key("str")
  mixture: tuple = key("value")  # ((name, source, path, text_key, weight), ...).
  eval_mixture: tuple = key("value")
  num_threads: int = key("int", ">=1")
  num_shards: int = key("int", ">=0")

  def __post_init__(self):
    missing = missing_need(self.source, {"path": self.path, "text_key": self.text_key,
                                         "tfds_name": self.tfds_name, "hf_dataset": self.hf_dataset})
    if missing:
      bad_key(f"data.{missing}", f"source {self.source} needs {NEED_MEANING[missing]}")
    for name in ("mixture", "eval_mixture"):
      object.__setattr__(self, name, _checked_mixture(name, getattr(self, name)))


NEED_MEANING = {"path": "a glob of files", "text_key": "the field holding the text (text_key)",
                "tfds_name": "a dataset name", "hf_dataset": "a dataset (a hub name or a local folder)"}


def missing_need(source: str, fields: dict) -> str | None:
  """The first thing `source` needs (names.SOURCE_NEEDS) that `fields` leaves empty."""
  return next((need for need in SOURCE_NEEDS.get(source, ()) if not fields.get(need)), None)


def _checked_mixture(name: str, entries) -> tuple:
  """`data.mixture` / `data.eval_mixture`: (name, source, path, text_key, weight) entries, as tuples."""
  if not isinstance(entries, (tuple, list)):
    bad_key(f"data.{name}", f"must be a tuple of (name, source, path, text_key, weight) entries, got {entries!r}")
  names = set()
  for entry in entries:
    if not isinstance(entry, (tuple, list)) or len(entry) != 5:
      bad_key(f"data.{name}", f"entry {entry!r} is not (name, source, path, text_key, weight)")
    label, source, path, text_key, weight = entry
    if not isinstance(label, str) or not label or label in names:
      bad_key(f"data.{name}", f"entry {entry!r}: the name must be a new, non-empty string")
    names.add(label)
    if source not in MIXABLE_SOURCES:
      bad_key(f"data.{name}", f"source {label!r}: unknown kind {source!r}; choose one of {', '.join(MIXABLE_SOURCES)}")
    if not isinstance(path, str) or not isinstance(text_key, str):
      bad_key(f"data.{name}", f"source {label!r}: path and text_key must be strings")
    missing = missing_need(source, {"path": path, "text_key": text_key})
    if missing:
      bad_key(f"data.{name}", f"source {label!r}: {source} needs {NEED_MEANING[missing]}")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < math.inf:
      bad_key(f"data.{name}", f"source {label!r}: the weight must be a number > 0, got {weight!r}")
  return tuple(tuple(entry) for entry in entries)


@dataclasses.dataclass(frozen=True)
class Checkpoint:
  every_steps: int = key("int", ">=-1")
  keep: int = key("int", ">=1")
  async_save: bool = key("bool")
  local_dir: str = key("str")
  local_every_steps: int = key("int", ">=0")
  restore_from: str = key("str")
  params_only: bool = key("bool")
  init_from_hf: str = key("str")

  def __post_init__(self):
    if self.local_every_steps and not self.local_dir:
      bad_key("checkpoint.local_every_steps", f"{self.local_every_steps} needs checkpoint.local_dir (node-local storage)")
    if self.init_from_hf and self.restore_from:
      bad_key("checkpoint.init_from_hf", "set together with checkpoint.restore_from; a run starts from one of them")


@dataclasses.dataclass(frozen=True)
class Log:
  every_steps: int = key("int", ">=1")
  tensorboard: bool = key("bool")
  straggler_ratio: float = key("float", ">=1")
  quant_stats_every: int = key("int", ">=0")
  verbose: bool = key("bool")
  wandb_project: str = key("str")
  wandb_entity: str = key("str")
  wandb_run_name: str = key("str")


@dataclasses.dataclass(frozen=True)
class Distributed:
  coordinator_address: str = key("str")
  num_processes: int = key("int", ">=0")
  process_id: int = key("int", ">=-1")


def hf_tokenizer_json(path: str) -> str | None:
  """The Hugging Face `tokenizer.json` that a `data.tokenizer` value names (the file, or one in the named
  directory), or None."""
  path = os.path.expanduser(path)
  if os.path.isdir(path):
    path = os.path.join(path, "tokenizer.json")
  return path if path.endswith(".json") and os.path.isfile(path) else None


def tokenizer_file(name: str) -> tuple[str, str]:
  """(kind, file) of a `data.tokenizer` value: ("byte", ""), ("hf", its tokenizer.json) or ("sentencepiece", its
  .model file); a DataError naming the key for anything else. The data package loads what this names."""
  if name in ("", "byte"):
    return "byte", ""
  json_path = hf_tokenizer_json(name)
  if json_path:
    return "hf", json_path
  if not os.path.isfile(os.path.expanduser(name)):
    raise DataError(f"data.tokenizer: {name!r} is neither 'byte', a SentencePiece .model file nor a "
                    "tokenizer.json (or a directory holding one)")
  return "sentencepiece", os.path.expanduser(name)


@functools.lru_cache(maxsize=8)
def tokenizer_vocab(name: str) -> int:
  """The vocabulary of the `data.tokenizer` named. A tokenizer that does not load is the config's error, naming
  data.tokenizer."""
  try:
    kind, path = tokenizer_file(name)
    if kind == "byte":
      vocab = 256
    elif kind == "hf":
      import tokenizers  # pylint: disable=g-import-not-at-top
      vocab = tokenizers.Tokenizer.from_file(path).get_vocab_size(with_added_tokens=True)
    else:
      import sentencepiece  # pylint: disable=g-import-not-at-top
      vocab = sentencepiece.SentencePieceProcessor(model_file=path).get_piece_size()
  except DataError as e:
    bad_key("data.tokenizer", str(e).removeprefix("data.tokenizer: "))
  except Exception as e:  # tokenizers and sentencepiece raise their own types for a bad file.
    bad_key("data.tokenizer", f"cannot load {name!r} ({one_line(e)})")
  return int(vocab)


def _accumulation(train: Train, mesh: Mesh) -> int:
  """The micro-batches a step runs for each device to hold `train.device_batch_size` sequences in each: the global
  batch stays `train.batch_size` on any mesh, so a job restarted on fewer devices runs more micro-batches."""
  shards = sharding_lib.shards(sharding_lib.batch_axes(mesh.rules_dict), mesh.sizes())
  per_device, rest = divmod(train.batch_size, shards)
  if rest:
    bad_key("train.batch_size", f"{train.batch_size} is not divisible by the {shards} data-parallel devices")
  if per_device % train.device_batch_size:
    bad_key("train.device_batch_size", f"{train.device_batch_size} does not divide the sequences each device holds "
            f"in a step: train.batch_size={train.batch_size} over {shards} data-parallel devices")
  accum = per_device // train.device_batch_size
  # A config saved by a run (its derived count written back) reads again on the same mesh.
  if train.grad_accum_steps not in (1, accum):
    bad_key("train.device_batch_size", f"set together with train.grad_accum_steps={train.grad_accum_steps}; the "
            "micro-batches follow from it")
  return accum


# The sections under their config names; `model` and `quant` are ModelConfig and Recipe.
@dataclasses.dataclass(frozen=True)
class Pipeline:
  """How a pipelined step runs its stages (ember/parallel/pipeline.py); read where the mesh has a pipeline axis."""
  schedule: str = key("str", choices=PIPELINE_SCHEDULES)
  virtual_stages: int = key("int", ">=1")


SECTIONS = {"model": ModelConfig, "train": Train, "quant": Recipe, "remat": Remat, "data": Data, "mesh": Mesh,
            "pipeline": Pipeline, "checkpoint": Checkpoint, "log": Log, "distributed": Distributed}


@dataclasses.dataclass(frozen=True)
class Settings:
  """The whole config, typed. `quant` is the recipe these settings run (the first precision phase's, or the one
  `at_phase` picked), the one place the layers get it from (`model` is the shape alone); `phases` is the
  schedule: each phase's first step and recipe (`quant.schedule`)."""
  workdir: str = key("str")
  seed: int = key("int", ">=0")
  steps: int = key("int", ">=1")
  model: ModelConfig = None
  train: Train = None
  quant: Recipe = None
  remat: Remat = None
  data: Data = None
  mesh: Mesh = None
  pipeline: Pipeline = None
  checkpoint: Checkpoint = None
  log: Log = None
  distributed: Distributed = None
  phases: tuple[tuple[int, Recipe], ...] = ()
  schedule: tuple = dataclasses.field(default=(), compare=False)  # `quant.schedule` as written.

  @classmethod
  def from_config(cls, cfg, num_devices: int | None) -> "Settings":
    """The builder, the one place a ConfigDict becomes typed. `cfg` is checked against the key table
    (config_schema.check) before; the sections' own rules run here. With `num_devices`, the mesh's -1 axis
    is resolved and `mesh.data|fsdp|tensor|expert` become the sizes within a host."""
    def recipe(quant_node):
      return section(Recipe, quant_node, stats=cfg.log.quant_stats_every > 0,
                     wgrad_dtype=cfg.train.grad_reduce_dtype)

    m = cfg.model
    if not m.head_dim and m.d_model % m.num_heads:
      bad_key("model.num_heads", f"{m.num_heads} heads do not divide model.d_model={m.d_model} (or set model.head_dim)")
    quant = recipe(cfg.quant)
    data = section(Data, cfg.data)
    # model.vocab_size=0: the tokenizer's vocabulary rounded up to a multiple of 128 (the embedding's and the LM
    # head's GEMMs then tile evenly; the extra rows are never a target). Loading it checks data.tokenizer.
    padded_vocab = -(-tokenizer_vocab(data.tokenizer) // 128) * 128
    model = section(ModelConfig, m, head_dim=m.head_dim or m.d_model // m.num_heads,
                    vocab_size=m.vocab_size or padded_vocab)
    # The run's directories made absolute once, here (`~` expanded, a URL as given, "" still off): every file of the
    # run (checkpoints, metrics, TensorBoard, the local tier, the compilation cache) is then under the directory it
    # was named by where the run started, and every reader of the settings is handed a path it can use as it is.
    directory = lambda path: path and storage.absolute(path)
    train = section(Train, cfg.train, decay_steps=cfg.train.decay_steps or max(cfg.steps - cfg.train.warmup_steps, 1),
                    compilation_cache_dir=directory(cfg.train.compilation_cache_dir))
    phases = tuple((start, quant if start == 0 else recipe(phase.quant))
                   for start, phase in config_phases.precision_phases(cfg))
    settings = cls(workdir=directory(cfg.workdir), seed=cfg.seed, steps=cfg.steps, model=model, train=train,
                   quant=quant, remat=section(Remat, cfg.remat), data=data, mesh=section(Mesh, cfg.mesh),
                   pipeline=section(Pipeline, cfg.pipeline),
                   checkpoint=section(Checkpoint, cfg.checkpoint, local_dir=directory(cfg.checkpoint.local_dir)),
                   log=section(Log, cfg.log), distributed=section(Distributed, cfg.distributed), phases=phases,
                   schedule=_plain(cfg.quant.schedule))
    return settings if num_devices is None else settings.for_devices(num_devices)

  def for_devices(self, num_devices: int) -> "Settings":
    """These settings on `num_devices` devices: the mesh's -1 axis resolved and `mesh.data|fsdp|...` the sizes
    within a host (the mesh multiplies them by the dcn host counts); with `train.device_batch_size`, the
    micro-batches that give each device that many sequences. Settings already on `num_devices` stay as they are."""
    sizes, _ = mesh_lib.ici_dcn(self.mesh, num_devices)
    mesh = dataclasses.replace(self.mesh, **sizes)
    train = self.train
    if train.device_batch_size:
      train = dataclasses.replace(train, grad_accum_steps=_accumulation(train, mesh))
    return dataclasses.replace(self, mesh=mesh, train=train)

  @property
  def stacked_blocks(self) -> int:
    """The rows of the decoder's stacked layers, all its segments': the model's blocks and, under a pipeline, the
    staged segment's padding rows (ModelConfig.staged_segment; ember/parallel/pipeline.py, `staged_rows`)."""
    stages = self.mesh.sizes()[PIPELINE]
    if stages <= 1:
      return self.model.num_blocks
    front, staged, _ = self.model.pipeline_blocks(self.quant)
    return self.model.num_blocks + pipeline_lib.staged_rows(front, staged, stages, self.pipeline.virtual_stages) - staged

  # --- Views --------------------------------------------------------------------------------------------

  def at_phase(self, index: int) -> "Settings":
    """The settings that run precision phase `index`: its recipe in `quant`."""
    return dataclasses.replace(self, quant=self.phases[index][1])

  def replace(self, dotted: str, value) -> "Settings":
    """A copy with one key changed (`"remat.policy"`, `"train.batch_size"`); the section's rules run again.
    Keys of `quant` change the first phase's recipe too."""
    section, _, name = dotted.rpartition(".")
    if not section:
      return dataclasses.replace(self, **{name: value})
    cls_ = SECTIONS[section]
    field = next(f.name for n, f, _ in declared(cls_) if n == name)
    new = dataclasses.replace(getattr(self, section), **{field: value})
    if section == "quant":
      return dataclasses.replace(self, quant=new, phases=((0, new),) + self.phases[1:])
    return dataclasses.replace(self, **{section: new})

  def to_dict(self) -> dict:
    """The config's keys and values (derived values resolved): what `ml_collections.ConfigDict(...)` and
    `from_config` read back (a checkpoint saves it)."""
    out = {name: getattr(self, f.name) for name, f, _ in declared(Settings)}
    for name, cls_ in SECTIONS.items():
      obj = getattr(self, name)
      out[name] = {k: _saved(getattr(obj, f.name)) for k, f, _ in declared(cls_)}
    out["quant"]["schedule"] = self.schedule
    return out


def section(cls, node, **given):
  """Section `cls` from a config node (a ConfigDict section) by its declared keys; `given` fields as given."""
  values = {f.name: _plain(node[name]) for name, f, _ in declared(cls) if f.name not in given}
  return cls(**values, **given)


def _plain(value):
  """A ConfigDict value as the typed field holds it: lists become tuples (hashable, compare by value)."""
  return tuple(_plain(v) for v in value) if isinstance(value, (list, tuple)) else value


def _saved(value):
  """A typed value as a config key holds it (a dtype by its name)."""
  return value.name if isinstance(value, np.dtype) else value
