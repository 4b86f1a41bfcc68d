"""Validate and derive the one config tree: `validate(cfg, num_devices)` checks the whole tree once at start-up
(each key's own type, bound or choices: ember/config/schema.py; each section's own rules: ember/config/settings.py;
here, the rules across sections) and returns the typed settings that `derive(...)` builds (the values computed
from others, such as head_dim, the mesh's -1 axis and the decay length, filled in that one place). Any problem
raises `ConfigError` naming the key.
"""

from __future__ import annotations

import glob
import importlib.util
import logging
import os

import ml_collections

from ember import storage
from ember.config import defaults
from ember.config import phases as phases_lib
from ember.config import schema
from ember.config.model import MLA_DIMS
from ember.config.settings import Settings, hf_tokenizer_json, section, tokenizer_vocab
from ember.errors import ConfigError, bad_key, one_line, warn
from ember.names import EMBED, EXPERT, MESH_AXES, MLP_IN, PIPELINE
from ember.parallel import distributed, pipeline, sharding
from ember.quant.recipe import SCHEME_OPTIONS, SCHEMES, Recipe, check_excluded_layers


def validate(cfg: ml_collections.ConfigDict, num_devices: int | None, *, unread: bool = True) -> Settings:
  """Checks every key before anything is built; raises ConfigError naming the first bad key. Returns the typed
  settings it built for the checks (what `derive` gives): past here only they travel.

  Each key against its declaration (schema), the precision schedule's phases, each section's own rules
  (building the typed sections: ember/config/settings.py), then the rules across sections here.
  `num_devices=None`: the devices are not known yet (train.py checks the config before JAX starts; a sweep
  checks its runs before starting any); `on_devices` then resolves and checks the mesh's sizes. `unread=False`
  leaves out the warnings of keys the run does not read (a sweep's check: each run says them in its own log)."""
  schema.check(cfg)
  _validate_phases(cfg)
  settings = derive(cfg, None)  # The sections' own rules run as they are built.
  _validate_exclude(settings.quant, settings.model, "quant.exclude")
  for index, (start, recipe) in enumerate(settings.phases[1:]):
    _validate_exclude(recipe, settings.model, f"quant.schedule[{index}]: from step {start}: quant.exclude")
  _validate_data(settings)
  _validate_log(settings)
  if unread:
    _validate_unread(settings)
  _validate_checkpoint(settings)
  _validate_latent_sizes(settings)
  _validate_paths(settings)
  return settings if num_devices is None else on_devices(settings, num_devices)


def on_devices(settings: Settings, num_devices: int) -> Settings:
  """Validated `settings` on `num_devices` devices: the values that need the
  devices derived (`Settings.for_devices`: the mesh's sizes, the micro-batches) and the rules that read them
  checked. What the trainer, the compile and the planner do once they know the devices."""
  if not isinstance(settings, Settings):  # A config tree not yet validated: a caller's mistake, said plainly.
    raise TypeError(f"on_devices takes the Settings config.validate returns, not a {type(settings).__name__}")
  out = settings.for_devices(num_devices)
  _validate_mesh(out)
  return out


def _validate_phases(cfg) -> None:
  """Each `quant.schedule` entry's recipe is one (its keys' kinds and choices, its `exclude` grammar: the Recipe's
  own checks), named by the entry and its step."""
  for index, (start, phase) in enumerate(phases_lib.precision_phases(cfg)[1:]):
    try:
      section(Recipe, phase.quant)
    except ConfigError as e:
      reason = str(e).removeprefix("config.")
      raise ConfigError(f"config.quant.schedule[{index}]: from step {start}: {reason}") from None


def _validate_exclude(recipe: Recipe, model, key: str) -> None:
  """The selectors as the recipe parsed them (quant/recipe.py's `parse_exclude`), against the model's layers."""
  try:
    check_excluded_layers(recipe.selectors, model.num_layers, model.mtp_depth)
  except ValueError as e:
    bad_key(key, str(e))


def _validate_latent_sizes(s: Settings) -> None:
  """Latent attention's sizes where it is off would be read by nothing. (Checked on load, not in the model
  section's own rules: a run saved before this rule still loads, `from_saved`.)"""
  for name in MLA_DIMS if not s.model.is_mla else ():
    if getattr(s.model, name):
      bad_key(f"model.{name}", f"{getattr(s.model, name)} is read only by multi-head latent attention, which "
              "model.kv_lora_rank > 0 turns on (it is 0)")


def _unread_keys(s: Settings, reference: ml_collections.ConfigDict) -> list[tuple[tuple[str, ...], bool, str]]:
  """Keys read only under a condition: (the keys, whether this run reads them, when they are read). The one table
  of such keys; `_validate_unread` warns of those set where they are not read. `reference`: the default config."""
  recipes = [recipe for _, recipe in s.phases]
  read_options = {o for recipe in recipes for o in recipe.scheme.options}
  by = lambda option: " / ".join(n for n, scheme in SCHEMES.items() if option in scheme.options)
  stages = s.mesh.pipeline * s.mesh.dcn_pipeline  # Negative while a -1 axis is unresolved: maybe a pipeline.
  muon = tuple(f"train.{k}" for k in reference.train if k.startswith("muon_"))
  own_source = None if s.data.mixture else s.data.source  # A mixture's entries replace data.source.
  return [
      (muon, s.train.optimizer == "muon", "under train.optimizer=muon"),
      (("remat.save_names", "remat.offload_names"), s.remat.policy == "custom",
       "under remat.policy=custom (a preset keeps its own names)"),
      (("remat.memory_budget_gb",), s.remat.policy == "auto", "under remat.policy=auto"),
      (("pipeline.schedule",), stages != 1, "with a pipeline (mesh.pipeline or mesh.dcn_pipeline > 1)"),
      (("log.quant_stats_every",), any(recipe.quantized for recipe in recipes), "under a quantized recipe"),
      (("log.wandb_entity", "log.wandb_run_name"), bool(s.log.wandb_project), "with log.wandb_project"),
      (("checkpoint.params_only",), bool(s.checkpoint.restore_from), "with checkpoint.restore_from"),
      (("model.rope_low_freq_factor", "model.rope_high_freq_factor", "model.rope_original_seq_len"),
       bool(s.model.rope_scaling_factor), "with model.rope_scaling_factor (Llama 3.1's RoPE scaling)"),
      (("model.mtp_loss_weight",), s.model.mtp_depth > 0, "with model.mtp_depth > 0"),
      # (data.source, data.path and data.tfds_name are read under any source: a saved data position's fingerprint.)
      (("data.tfds_data_dir", "data.tfds_text_key"), own_source == "tfds", "under data.source=tfds"),
      (("data.hf_dataset", "data.hf_config", "data.hf_split"), own_source == "hf", "under data.source=hf"),
      *(((f"quant.{o}",), o in read_options, f"by {by(o)} (quant.recipe or a quant.schedule phase)")
        for o in SCHEME_OPTIONS),
  ]


def _validate_unread(s: Settings) -> None:
  """A key set away from its default where this run reads nothing of it: a warning line, not an error (one config
  file serves a sweep's runs or a schedule's phases, each reading its own keys)."""
  reference = defaults.get_config()
  for keys, read, when in _unread_keys(s, reference):
    for key in keys if not read else ():
      section, name = key.split(".")
      value = getattr(getattr(s, section), name)
      if value != reference[section][name]:
        warn(f"{key}={value!r} is read only {when}; this run does not read it")


def _validate_checkpoint(s: Settings) -> None:
  c = s.checkpoint
  if c.local_dir and not c.local_every_steps:  # On load: a run saved with it still loads (`from_saved`).
    bad_key("checkpoint.local_dir", f"{c.local_dir!r} is set, but checkpoint.local_every_steps=0 saves nothing "
            "there: set both")


def _validate_log(s: Settings) -> None:
  if s.log.wandb_project and importlib.util.find_spec("wandb") is None:
    bad_key("log.wandb_project", "Weights & Biases logging needs wandb; install the extra: pip install -e '.[wandb]'")


def _validate_data(s: Settings) -> None:
  d = s.data
  if d.source == "tfds":
    if importlib.util.find_spec("tensorflow_datasets") is None:
      bad_key("data.source", "'tfds' needs tensorflow-datasets; install the extra: pip install -e '.[tfds]'")
  if d.source == "hf" and importlib.util.find_spec("datasets") is None:
    bad_key("data.source", "'hf' needs Hugging Face datasets; install the extra: pip install -e '.[hf]'")
  for key in ("mixture", "eval_mixture"):
    for name, source, path, _, _ in getattr(d, key):
      if path and source != "synthetic" and not glob.glob(os.path.expanduser(path), recursive=True):
        bad_key(f"data.{key}", f"source {name!r}: no file matches {path!r}")
  # Raises naming the key; which shards a process reads is decided on the mesh (data/pipeline.py).
  distributed.data_shards(d.num_shards, s.train.batch_size)
  # The tokenizer's ids reach the model wherever a source other than synthetic data is read: training reads the
  # mixture's sources (or data.source), evaluation the eval mixture's (or training's).
  train_kinds = {source for _, source, *_ in d.mixture} or {d.source}
  kinds = train_kinds | ({source for _, source, *_ in d.eval_mixture} or train_kinds)
  if kinds != {"synthetic"} and (vocab := tokenizer_vocab(d.tokenizer)) > s.model.vocab_size:
    bad_key("model.vocab_size", f"{s.model.vocab_size} is smaller than the tokenizer's vocabulary ({vocab})")
  if kinds != {"synthetic"} and (shipped := _hf_tokenizer(s.checkpoint.init_from_hf)):
    # Weights trained on one tokenizer's ids, fed another's (the byte default, say), train without an error.
    if (vocab := tokenizer_vocab(d.tokenizer)) != (theirs := tokenizer_vocab(shipped)):
      bad_key("data.tokenizer", f"{d.tokenizer!r} ({vocab} ids) is not the tokenizer the weights of "
              f"checkpoint.init_from_hf were trained with ({shipped}, {theirs} ids); set "
              f"data.tokenizer={s.checkpoint.init_from_hf}")


def _hf_tokenizer(directory: str) -> str | None:
  """The tokenizer a Hugging Face model directory ships (tokenizer.json, or SentencePiece's tokenizer.model), or
  None (no directory, or none shipped)."""
  if not directory:
    return None
  sentencepiece = os.path.join(os.path.expanduser(directory), "tokenizer.model")
  return hf_tokenizer_json(directory) or (sentencepiece if os.path.isfile(sentencepiece) else None)


def _validate_paths(s: Settings) -> None:
  d = s.data
  if d.source not in ("synthetic", "tfds", "hf") and d.path and not glob.glob(
      os.path.expanduser(d.path), recursive=True):
    bad_key("data.path", f"no file matches {d.path!r}")
  restore = s.checkpoint.restore_from
  if restore and (storage.scheme_problem(restore) or not storage.isdir(storage.absolute(restore))):
    bad_key("checkpoint.restore_from", f"no checkpoint directory at {restore}")
  hf = s.checkpoint.init_from_hf
  if hf:
    if not os.path.isfile(os.path.join(os.path.expanduser(hf), "config.json")):
      bad_key("checkpoint.init_from_hf", f"no Hugging Face model directory (config.json) at {hf}")
  _validate_directory("workdir", s.workdir)
  if storage.is_remote(s.checkpoint.local_dir):  # Its writability is the training nodes' (LocalCheckpoints).
    bad_key("checkpoint.local_dir", f"{s.checkpoint.local_dir} is a URL; the local tier is node-local storage "
            "(a bucket is checkpoint's own tier: workdir)")
  if s.train.compilation_cache_dir:
    _validate_directory("train.compilation_cache_dir", s.train.compilation_cache_dir)


def _validate_directory(name: str, directory: str) -> None:
  """The run writes under `directory` (config key `name`: metrics and checkpoints, compiled programs): it must be
  (or be creatable as) a writable directory. Checked without creating anything."""
  problem = directory_problem(directory)
  if problem:
    bad_key(name, problem)


def directory_problem(directory: str) -> str | None:
  """Why `directory` cannot be (or be created as) a writable directory, or None; nothing is created.
  A gs:// URL (ember/storage.py) needs its library and an existing bucket."""
  if not directory:
    return "must name a directory"
  problem = storage.scheme_problem(directory)
  if problem or storage.is_remote(directory):
    return problem or _bucket_problem(directory)
  path = os.path.abspath(os.path.expanduser(directory))
  if os.path.exists(path) and not os.path.isdir(path):
    return f"{path} exists and is not a directory"
  existing = path
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    return f"cannot create {path}: {existing} is not a directory"
  if not os.access(existing, os.W_OK | os.X_OK):
    return f"cannot write to {path}: no write permission on {existing}"
  return None


def _bucket_problem(url: str) -> str | None:
  bucket = storage.bucket(url)
  # gcsfs logs each retry's traceback before giving up: the one line below says it.
  quiet = [logging.getLogger(name) for name in ("gcsfs", "fsspec")]
  levels = [q.level for q in quiet]
  for q in quiet:
    q.setLevel(logging.CRITICAL)
  try:
    if not storage.exists(bucket):
      return f"{url}: the bucket {bucket} does not exist (or these credentials cannot see it)"
  except ImportError as e:
    return str(e)
  except Exception as e:  # pylint: disable=broad-except  # No credentials, no network: say which.
    return f"{url}: cannot reach {bucket} ({type(e).__name__}: {one_line(e)[:200]})"
  finally:
    for q, level in zip(quiet, levels):
      q.setLevel(level)
  return None


# --- The mesh -----------------------------------------------------------------------------------------


def _validate_mesh(s: Settings) -> None:
  """The mesh (its sizes resolved) against the batch and the model."""
  sizes, rules, m = s.mesh.sizes(), s.mesh.rules_dict, s.model
  batch_axes = sharding.batch_axes(rules)  # The mesh axes the batch is split over, as the rules say.
  split = "*".join(batch_axes) or "1"
  batch_shards = sharding.shards(batch_axes, sizes)
  batch = s.train.batch_size
  if batch % batch_shards:
    bad_key("train.batch_size", f"{batch} is not divisible by the data-parallel size {split}={batch_shards}")
  accum = s.train.grad_accum_steps
  if (batch // batch_shards) % accum:
    bad_key("train.grad_accum_steps", f"{accum} does not divide the sequences each device holds: train.batch_size="
          f"{batch} / {split}={batch_shards} = {batch // batch_shards}")
  context = sharding.shards(sharding.sequence_axes(rules), sizes)
  if context > 1 and m.seq_len % (2 * context):  # The balanced layout's 2 chunks a device (parallel/context.py).
    bad_key("mesh.context", f"the 2 x {context} chunks of a sequence split over {context} devices do not divide "
            f"model.seq_len={m.seq_len}")
  if reason := m.tensor_refusal(sizes["tensor"]):
    bad_key("mesh.tensor", reason)
  if m.num_experts and m.num_experts % sizes["expert"]:
    bad_key("mesh.expert", f"{sizes['expert']} does not divide model.num_experts={m.num_experts}")
  embed = [a for a in rules.get(EMBED, ()) if sizes[a] > 1]  # Latent attention's ranks are sharded as `embed`.
  embed_shards = sharding.shards(embed, sizes)
  if m.d_model % embed_shards:
    bad_key(f"mesh.{embed[0]}", f"the {'*'.join(embed)}={embed_shards} devices every weight's embed axis is split "
            f"over do not divide model.d_model={m.d_model}")
  down = [a for a in rules.get(MLP_IN, ()) if sizes[a] > 1]  # The down projections' input (ember/names.py).
  down_shards = sharding.shards(down, sizes)
  dense_width = m.dense_width if m.num_moe_layers < m.num_layers else 0
  for name, units in (("dense_d_ff" if m.dense_d_ff else "d_ff", dense_width), ("shared_expert_d_ff", m.shared_d_ff)):
    if units % down_shards:
      bad_key(f"mesh.{down[-1]}", f"the {'*'.join(down)}={down_shards} devices a down projection's input is split "
              f"over do not divide its {units} MLP units (model.{name})")
  for rank in ("q_lora_rank", "kv_lora_rank") if m.is_mla else ():
    if getattr(m, rank) % embed_shards:
      bad_key(f"mesh.{embed[0]}", f"the {'*'.join(embed)}={embed_shards} devices the weights' embed axis is split "
              f"over do not divide model.{rank}={getattr(m, rank)} (latent attention's ranks are split alike)")
  if sizes[PIPELINE] > 1:
    _validate_pipeline(s)
  elif s.pipeline.virtual_stages > 1:
    bad_key("pipeline.virtual_stages", f"{s.pipeline.virtual_stages} chunks a stage need a pipeline "
            "(mesh.pipeline or mesh.dcn_pipeline > 1)")
  used = {a for mesh_axes in rules.values() for a in mesh_axes}
  for a in (a for a in MESH_AXES if sizes[a] > 1 and a not in used):
    bad_key(f"mesh.{a}", f"{sizes[a]} devices along {a!r}, which no entry of mesh.rules maps a logical axis to: "
            "they would all repeat the same work")
  if m.num_experts and sizes["expert"] > 1:
    expert_axes = [a for a in rules.get(EXPERT, ()) if sizes[a] > 1]
    missing = [a for a in expert_axes if a not in batch_axes]
    if missing:
      bad_key("mesh.rules", f"expert parallelism over {missing[0]!r} needs the batch sharded over it too "
            f"('batch' -> (..., {missing[0]!r}))")


def derive(cfg: ml_collections.ConfigDict, num_devices: int | None) -> Settings:
  """The typed config of a validated `cfg` on `num_devices` devices, unchecked across sections: built once,
  derived values filled in (head_dim, the mesh's sizes within a host, the decay length, each precision phase's
  recipe). `num_devices=None` leaves the mesh's sizes as written (for what does not depend on the devices)."""
  return Settings.from_config(cfg, num_devices)


def from_saved(saved: dict, overrides: dict | None = None) -> Settings:
  """The typed settings of a config a run saved (`Settings.to_dict`, in a checkpoint's metadata), with dotted
  `overrides` ({"model.dtype": "float32"}) applied before the derived values are worked out again (a recipe's
  health statistics follow `log.quant_stats_every`). The devices are left to the caller (`on_devices`). A key
  added to the config since the run saved it takes its default, which is the behaviour the run had."""
  cfg = ml_collections.ConfigDict(saved)
  _fill_missing(cfg, defaults.get_config())
  cfg.update_from_flattened_dict(overrides or {})
  return derive(cfg, None)


def _fill_missing(cfg: ml_collections.ConfigDict, reference: ml_collections.ConfigDict) -> None:
  """Adds to `cfg` every key of `reference` it lacks, with `reference`'s value, at any depth."""
  for key, value in reference.items():
    if key not in cfg:
      cfg[key] = value
    elif isinstance(value, ml_collections.ConfigDict) and isinstance(cfg[key], ml_collections.ConfigDict):
      _fill_missing(cfg[key], value)


def _validate_pipeline(s: Settings) -> None:
  """A pipelined mesh against the model and the step (ember/parallel/pipeline.py)."""
  stages, m, accum = s.mesh.sizes()[PIPELINE], s.model, s.train.grad_accum_steps
  key = "mesh.pipeline" if s.mesh.pipeline > 1 else "mesh.dcn_pipeline"
  if sharding.layer_axes(s.mesh.rules_dict) != (PIPELINE,):
    bad_key("mesh.rules", f"a pipeline needs the stacked layers split over it alone ('layers' -> 'pipeline'), got "
            f"{sharding.layer_axes(s.mesh.rules_dict)}")
  if PIPELINE in sharding.batch_axes(s.mesh.rules_dict) or PIPELINE in sharding.sequence_axes(s.mesh.rules_dict):
    bad_key("mesh.rules", "the pipeline axis splits the layers; the batch and the sequence cannot be split over it")
  virtual = s.pipeline.virtual_stages
  if virtual > 1 and s.pipeline.schedule != "interleaved_1f1b":
    bad_key("pipeline.virtual_stages", f"{virtual} chunks a stage need pipeline.schedule=interleaved_1f1b, not "
            f"{s.pipeline.schedule!r}")
  chunks = f"{stages} stages x {virtual} chunks" if virtual > 1 else f"{stages} stages"
  warned = set()
  for index, (start, recipe) in enumerate(s.phases):  # Each precision phase groups the layers by its own recipe.
    segments = m.segments(recipe)
    front, blocks, _ = m.pipeline_blocks(recipe)  # The run of layers split into stages; the others run whole.
    of, sized = f"the decoder's {blocks} blocks", f"the decoder's {blocks} blocks of {m.block_size} layer(s)"
    if len(segments) > 1:
      phase = "" if index == 0 else f" from step {start}"
      of = sized = (f"the {blocks} blocks of {m.block_size} layer(s) in the longest of the decoder's {len(segments)} "
                    f"scan segments{phase} (the others run whole on the first or the last stage)")
    rows = pipeline.staged_rows(front, blocks, stages, virtual)
    if front > rows // stages:  # Stage 0 runs them in place of padding rows, each stage's last come to the next.
      bad_key(key, f"stage 0 runs the {front} blocks before {of} in place of as many padding rows, more than the "
              f"{rows // stages} rows a stage holds (uneven stages: docs/parallelism.md); fewer stages hold more")
    if pipeline.stage_without_layers(front + blocks, stages, virtual):
      bad_key(key, f"{chunks} are too many for {sized}: padded to {rows} rows ({rows // (stages * virtual)} a chunk), "
              "a stage would run no layer or a chunk no block (uneven stages: docs/parallelism.md)")
    idle = rows - blocks - front
    if idle > pipeline.MAX_PADDING * m.num_blocks and blocks not in warned:
      warned.add(blocks)
      warn(f"{key}: {chunks} pad {of} to {rows} rows: {idle} idle layers ({idle / m.num_blocks:.0%} of the model) run "
           "every step; a count of stages (and chunks) that divides the blocks runs none (docs/parallelism.md, "
           "uneven stages)")
  if virtual > 1 and accum % stages:
    bad_key("train.grad_accum_steps", f"{accum} micro-batches do not form groups of the {stages} pipeline stages "
            "that interleaved 1F1B runs through each chunk in turn")
  context = sharding.shards(sharding.sequence_axes(s.mesh.rules_dict), s.mesh.sizes())
  if s.pipeline.schedule != "gpipe" and m.seq_len % (stages * context):
    over = f"the {stages} stages that share the LM head under 1F1B" + (f", on each of {context} context devices"
                                                                        if context > 1 else "")
    bad_key("model.seq_len", f"{m.seq_len} positions do not split over {over}")
  if m.mtp_depth and s.pipeline.schedule == "gpipe":
    bad_key("pipeline.schedule", "multi-token prediction (model.mtp_depth) runs in a pipeline under the 1F1B "
            "schedules ('1f1b', 'interleaved_1f1b'), not 'gpipe'")
  if m.mtp_depth and context > 1:
    bad_key(key, "multi-token prediction (model.mtp_depth) does not run with context parallelism in a pipeline")
  if accum % stages and s.pipeline.schedule == "gpipe":
    bad_key("train.grad_accum_steps", f"{accum} micro-batches do not split over the {stages} pipeline stages (the "
            "loss runs on each stage's share of them)")

