"""Every validation error exits 2 with one line naming the key and the reason."""

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

from ember import config as config_lib
from tests import helpers
from tests.helpers import ROOT

CASES = [
    (["--config.no_such_key=1"], "no_such_key: unknown config key"),
    (["--config.train.steps=3"], "config.train.steps: unknown config key; did you mean config.steps?"),  # Wrong section.
    (["--config.quant.recipie=bf16"], "config.quant.recipie: unknown config key; did you mean config.quant.recipe?"),
    (["--config.model.d_model=abc"], "config.model.d_model"),
    (["--config.model.num_heads=5"], "config.model.num_heads: 5 heads do not divide model.d_model=64"),
    (["--config.model.num_kv_heads=3"], "config.model.num_kv_heads: 3 kv heads do not divide model.num_heads=4"),
    (["--config.mesh.data=3", "--config.mesh.fsdp=1"],
     "config.mesh: mesh (pipeline=1, data=3, fsdp=1, context=1, tensor=1, expert=1) has 3"),
    (["--config.train.batch_size=6", "--config.mesh.fsdp=4", "--config.mesh.data=2"],
     "config.train.batch_size: 6 is not divisible by the data-parallel size"),
    (["--config.train.grad_accum_steps=3"],
     "config.train.grad_accum_steps: 3 does not divide the sequences each device holds: train.batch_size=8 / "
     "data*fsdp*expert=8 = 1"),
    (["--config.train.grad_accum_steps=0"], "config.train.grad_accum_steps: must be >= 1, got 0"),
    (["--config.train.optimizer_state_dtype=bfloat16", "--config.train.b2=0.999"],
     "config.train.b2: 0.999 with train.optimizer_state_dtype=bfloat16: a moment stored in bf16 moves by at most"),
    # Sizes the sharding rules split, each named before a parameter is built (they crashed there once).
    (["--config.model.d_model=36", "--config.model.num_heads=2"],
     "config.mesh.fsdp: the fsdp=8 devices every weight's embed axis is split over do not divide "
     "model.d_model=36"),
    (["--config.mesh.tensor=2", "--config.mesh.fsdp=4", "--config.model.vocab_size=257"],
     "config.mesh.tensor: 2 does not divide the vocabulary's 257 units (model.vocab_size)"),
    (["--config=configs/default.py:tiny_moe", "--config.mesh.tensor=4", "--config.mesh.fsdp=2",
      "--config.model.shared_expert_d_ff=66"],
     "config.mesh.tensor: 4 does not divide the MLP's 66 units (model.shared_expert_d_ff)"),
    (["--config.data.path=/nonexistent/*.txt"], "config.data.path: no file matches '/nonexistent/*.txt'"),
    (["--config.data.tokenizer=/nonexistent/tokenizer.json"],
     "config.data.tokenizer: '/nonexistent/tokenizer.json' is neither 'byte', a SentencePiece .model file nor a tokenizer.json"),
    (["--config.quant.recipe=fp7"], "config.quant.recipe: unknown value 'fp7'; choose one of bf16, fp8_delayed"),
    (["--config.remat.policy=custom", "--config.remat.save_names=('bogus',)"],
     "config.remat.save_names: unknown checkpoint name 'bogus'; valid names: decoder_layer_input"),
    (["--config.remat.policy=custom"], "config.remat.policy: 'custom' with remat.save_names and remat.offload_names"),
    (["--config.train.preempted_exit_status=256"], "config.train.preempted_exit_status: 256 is not an exit status"),
    # The axis set is named, not the one left to fill (-1): it named mesh.fsdp for a tensor=3 the user wrote.
    (["--config.mesh.tensor=3"], "config.mesh.tensor: mesh.tensor=3 (3) does not divide the 8 devices"),
    (["--config.mesh.tensor=3", "--config.mesh.data=3"], "config.mesh: mesh.data=3 x mesh.tensor=3 (9) does not"),
    (["--config.data.eval_fraction=1.0"], "config.data.eval_fraction"),
    (["--config.data.mixture=(('a', 'synthetic', '', 'text', 1e400),)"], "config.data.mixture: source 'a': "
     "the weight must be a number > 0"),
    # Checks that used to run late (model build, data pipeline, workdir creation) or not at all.
    (["--config=configs/default.py:tiny_moe", "--config.model.moe_every=3"],
     "config.model.moe_every: model.num_layers=2 is not a multiple of moe_every=3"),
    ([f"--config.workdir={ROOT}/README.md/run"], "config.workdir: cannot create"),
    ([f"--config.train.compilation_cache_dir={ROOT}/README.md/cache"], "config.train.compilation_cache_dir: cannot create"),
    (["--config.checkpoint.local_dir=gs://bucket/local", "--config.checkpoint.local_every_steps=1"],
     "config.checkpoint.local_dir: gs://bucket/local is a URL; the local tier is node-local storage"),
    (["--config.data.num_shards=3"], "config.data.num_shards: 3 data shards do not divide train.batch_size=8"),
    (["--config.quant.exclude=(bad"], "config.quant.exclude: entry '(bad' is not a projection"),
    (["--config.quant.exclude=('layers.1*',)"], "config.quant.exclude: entry 'layers.1*' is not a projection"),
    (["--config.quant.exclude=('layers[7]',)"], "config.quant.exclude: entry 'layers[7]': layer 7 is outside"),
    (["--config.model.vocab_size=128"],
     "config.model.vocab_size: 128 is smaller than the tokenizer's vocabulary (256)"),
    (["--config.data.source=synthetic", "--config.model.vocab_size=128",  # A mixture's text is tokenized too.
      "--config.data.mixture=(('code', 'text', '', '', 1.0),)"],
     "config.model.vocab_size: 128 is smaller than the tokenizer's vocabulary (256)"),
    (["--config.model.vocab_size=128",  # Training reads data.source's text, whatever the eval mixture holds.
      "--config.data.eval_mixture=(('s', 'synthetic', '', '', 1.0),)"],
     "config.model.vocab_size: 128 is smaller than the tokenizer's vocabulary (256)"),
    (["--config.quant.exclude=('mtp',)"], "config.quant.exclude: entry 'mtp': the model has no multi-token-prediction"),
    (["--config.remat.offload_names=(1,)"], "config.remat.offload_names: must hold strings only, got 1"),
    (["--config.train.min_lr_ratio=2.0"], "config.train.min_lr_ratio: must be in [0, 1], got 2.0"),
    (["--config.steps=0"], "config.steps: must be >= 1, got 0"),
    (["--config.checkpoint.keep=0"], "config.checkpoint.keep: must be >= 1, got 0"),
    (["--config.model.attention=flash"], "config.model.attention: unknown value 'flash'"),
    (["--config.mesh.rules=(('batch', 'data'), ('tokens', None))"], "config.mesh.rules: unknown logical axis 'tokens'"),
    (["--config.data.source=jsonl"], "config.data.path: source jsonl needs a glob of files"),
    (["--config.data.mixture=(('a', 'text', '', '', 0.0),)"],
     "config.data.mixture: source 'a': the weight must be a number > 0, got 0.0"),
    (["--config.data.mixture=(('a', 'tfds', '', '', 1.0),)"], "config.data.mixture: source 'a': unknown kind 'tfds'"),
    (["--config.data.eval_mixture=(('a', 'jsonl', '/nonexistent/*.jsonl', 'text', 1.0),)"],
     "config.data.eval_mixture: source 'a': no file matches '/nonexistent/*.jsonl'"),
    (["--config.checkpoint.restore_from=/nonexistent/run"],
     "config.checkpoint.restore_from: no checkpoint directory at /nonexistent/run"),
    # The unknown key is the one no flag names right, not the first flag ending in the same name.
    (["--config.steps=2", "--config.train.steps=3"], "config.train.steps: unknown config key"),
    (["--config.steps=abc"], "config.steps: cannot parse 'abc': invalid literal for int()"),
    (["--config.model.tie_embeddings=maybe"], "config.model.tie_embeddings: cannot parse 'maybe': must be true or false"),
    (["--config.model.d_model"], "config.model.d_model: no value; pass --config.model.d_model=VALUE"),
    # Not the next flag taken as the value (a workdir named "--config.steps=3").
    (["--config.workdir", "--config.steps=3"], "config.workdir: no value; pass --config.workdir=VALUE"),
    (["--config.steps", "3"], "config.steps: no value; pass --config.steps=VALUE"),
    (["--config.train.batch_size.x=3"], "config.train.batch_size.x: unknown config key"),
    (["--config..steps=3"], "--config..steps=3: not a config override; pass --config.KEY=VALUE"),
    (["--config=configs/default.py:nope"], "--config: configs/default.py:nope: ValueError: unknown model preset 'nope'"),
    (["--config="], "--config: empty; pass --config=FILE[:ARG]"),
    (["--config=configs"], "--config: no such config file: configs"),
    # Keys that were read by nothing where they were set.
    (["--config.model.q_lora_rank=16"], "config.model.q_lora_rank: 16 is read only by multi-head latent attention"),
    (["--config.pipeline.virtual_stages=2"], "config.pipeline.virtual_stages: 2 chunks a stage need a pipeline"),
    (["--config.checkpoint.local_dir=/tmp/local"],
     "config.checkpoint.local_dir: '/tmp/local' is set, but checkpoint.local_every_steps=0 saves nothing there"),
    (["--config.model.d_ff=100"],  # The down projection is split along its 100 units over fsdp (8 devices).
     "config.mesh.fsdp: the fsdp=8 devices a down projection's input is split over do not divide its 100 MLP units"),
    (["--config.mesh.rules=(('batch', 'data'),)"],  # fsdp (-1: 8 devices) is mapped to nothing.
     "config.mesh.fsdp: 8 devices along 'fsdp', which no entry of mesh.rules maps a logical axis to"),
]
if importlib.util.find_spec("tensorflow_datasets") is None:  # The [tfds] extra is not installed here.
  CASES.append((["--config.data.source=tfds", "--config.data.tfds_name=lm1b"],
                "config.data.source: 'tfds' needs tensorflow-datasets"))


@pytest.mark.parametrize("flags,expected", CASES, ids=[c[1].split(":")[0] for c in CASES])
def test_validation_errors_name_the_key(flags, expected):
  argv = ["train.py", "--config=configs/default.py:tiny", *flags]
  argv = [a for i, a in enumerate(argv) if not (a.startswith("--config=") and any(f.startswith("--config=")
                                                                                 for f in argv[i + 1:]))]
  cwd = os.getcwd()
  os.chdir(ROOT)
  try:
    with pytest.raises(config_lib.ConfigError) as err:
      cfg = config_lib.load(argv)
      config_lib.validate(cfg, num_devices=8)
  finally:
    os.chdir(cwd)
  message = str(err.value)
  assert expected in message, message
  assert "\n" not in message


# Each error that once escaped as a traceback (or after one), end to end through train.py.
EXIT_2 = [["--config.no_such_key=1"], ["--config.model.num_kv_heads=3"], ["--config.data.path=/nonexistent/*.txt"],
          ["--config.model.num_experts=4", "--config.model.moe_every=3"], [f"--config.workdir={ROOT}/README.md/run"],
          ["--config.data.num_shards=3"], ["--config.quant.exclude=(bad"], ["--config.data.source=tfds"],
          ["--config.workdir=/proc/ember"], ["--config.train.steps=3"]]


@pytest.mark.parametrize("flags", EXIT_2, ids=[f[-1].split("=")[0] for f in EXIT_2])
@pytest.mark.variants
def test_train_py_exits_2_with_one_line(flags):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "train.py", "--config=configs/default.py:tiny", *flags], cwd=ROOT,
                        capture_output=True, text=True, env=env, timeout=120)
  assert proc.returncode == 2, proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: config."), proc.stderr
  assert "Traceback" not in proc.stderr


# A preset outside the repository: every key is checked against the defaults the package ships.
OWN_PRESET = """from ember.config import defaults


def get_config():
  c = defaults.get_config()
  c.steps = 3
  c.model.{extra}
  return c
"""


@pytest.mark.parametrize("beside", [False, True], ids=["alone", "configs_beside"])
@pytest.mark.parametrize("extra,key", [("d_model = 32", "config.bogus"), ("bogus = 1", "config.model.bogus")],
                         ids=["override", "in_file"])
@pytest.mark.variants
def test_an_unknown_key_exits_2_from_any_directory(tmp_path, beside, extra, key):
  """The key list ships in the package (ember/config/defaults.py): a preset copied elsewhere, run from another
  directory by a package installed without the repository's configs/ (copied here), has its keys checked with
  or without a configs/ folder beside the preset (an override, or a key the file itself adds)."""
  site = tmp_path / "site"
  shutil.copytree(ROOT / "ember", site / "ember", ignore=shutil.ignore_patterns("__pycache__"))
  where = tmp_path / "presets"
  where.mkdir()
  if beside:
    (where / "configs").mkdir()
    (where / "configs" / "base.py").write_text((ROOT / "configs" / "base.py").read_text())
  preset = where / "mine.py"
  preset.write_text(OWN_PRESET.format(extra=extra))
  run = tmp_path / "elsewhere"
  run.mkdir()
  flags = ["--config.bogus=1"] if key == "config.bogus" else []
  proc = subprocess.run([sys.executable, "-m", "ember.tools.compile", f"--config={preset}", *flags, "--target=cpu"],
                        cwd=run, capture_output=True, text=True, timeout=120,
                        env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(site)))
  assert proc.returncode == 2, proc.stderr
  assert proc.stderr.strip().splitlines() == [f"error: {key}: unknown config key"
                                               + ("" if key == "config.bogus" else
                                                  " (ember/config/defaults.py lists every key)")], proc.stderr


def test_missing_config_file():
  with pytest.raises(config_lib.ConfigError, match="no such config file: configs/nope.py"):
    config_lib.load(["train.py", "--config=configs/nope.py"])


# A config file that does not load: the error names the file and what is wrong with it, not a config key.
BAD_FILES = [
    ("x = (\n", "'(' was never closed"),
    ("X = 1\n", "defines no get_config()"),
    ("def get_config():\n  raise RuntimeError('boom')\n", "RuntimeError: boom"),
    ("import no_such_module_xyz\n", "ModuleNotFoundError: No module named 'no_such_module_xyz'"),
    ("def get_config():\n  return 3\n", "get_config() returned int, not a ConfigDict"),
    ("def get_config():\n  pass\n", "get_config() returned NoneType, not a ConfigDict"),
]


@pytest.mark.parametrize("text,expected", BAD_FILES, ids=[e.split(":")[0][:20] for _, e in BAD_FILES])
def test_a_config_file_that_does_not_load(tmp_path, capfd, text, expected):
  path = tmp_path / "bad_config.py"
  path.write_text(text)
  with pytest.raises(config_lib.ConfigError) as err:
    config_lib.load(["train.py", f"--config={path}", "--config.steps=3"])
  assert str(err.value).startswith(f"--config: {path}: {expected}") and "\n" not in str(err.value), str(err.value)
  assert not capfd.readouterr().err  # No warning of ml_collections' own beside the one line.


def test_validate_without_devices_checks_all_but_the_mesh_sizes():
  """num_devices=None (a sweep checks its runs before starting any): every rule but the mesh's sizes."""
  cfg = config_lib.load(["train.py", f"--config={ROOT}/configs/default.py:tiny", "--config.mesh.data=3",
                         "--config.mesh.fsdp=1"])
  config_lib.validate(cfg, num_devices=None)
  cfg.model.num_kv_heads = 3
  with pytest.raises(config_lib.ConfigError, match="config.model.num_kv_heads: 3 kv heads"):
    config_lib.validate(cfg, num_devices=None)


def test_local_sh_says_a_bad_flag_once():
  """Every process of launch/local.sh fails alike on a bad flag: one line on stderr, exit 2 (no line per
  process, no line of the launcher's own)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(["launch/local.sh", "2", "1", sys.executable, "train.py", "--config=configs/default.py:tiny",
                         "--config.no_such_key=1"], cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
  assert proc.returncode == 2, proc.stderr
  assert proc.stderr.splitlines() == ["error: config.no_such_key: unknown config key"], proc.stderr


def test_derive_fills_head_dim_and_mesh():
  cfg = config_lib.load(["train.py", f"--config={ROOT}/configs/default.py:tiny"])
  out = config_lib.derive(cfg, 8)
  assert out.model.head_dim == 16 and out.mesh.fsdp == 8
  assert out.train.decay_steps == cfg.steps - cfg.train.warmup_steps  # Decay from the warm-up's end to the last step.
  assert config_lib.derive(config_lib.load(["train.py", f"--config={ROOT}/configs/default.py:tiny",
                                            "--config.train.decay_steps=7"]), 8).train.decay_steps == 7


def test_a_recipe_built_in_code_has_the_config_defaults():
  """ember/config/defaults.py holds every default; a Recipe built in code (tests, notebooks) must not drift from it. (But
  for `exclude`: a model's config keeps its LM head in bf16, a recipe on its own excludes nothing.)"""
  import dataclasses
  from ember.config import defaults
  from ember.quant.recipe import Recipe
  built = config_lib.derive(defaults.get_config(), 1).quant
  assert dataclasses.replace(built, name="bf16", exclude=()) == Recipe()


def test_config_given_twice_is_refused():
  with pytest.raises(config_lib.ConfigError, match=r"^--config: given 2 times \(--config=a.py, --config=b.py\)"):
    config_lib.load(["train.py", "--config=a.py", "--config.steps=2", "--config=b.py"])


def test_help_prints_the_usage_and_the_presets():
  proc = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0 and proc.stdout.startswith("usage: python train.py --config="), proc.stderr
  from configs.models import PRESETS
  assert all(p in proc.stdout for p in PRESETS) and "llama3_8b" in PRESETS


def test_the_model_section_is_the_model_shape_alone():
  """The recipe is held once (`Settings.quant`, the precision phase's) and handed to the layers beside the model's
  shape, which is the same in every phase."""
  import dataclasses
  from ember.config.model import ModelConfig
  from ember.quant.recipe import Recipe
  assert not [f.name for f in dataclasses.fields(ModelConfig) if "recipe" in f.name.lower() or f.type in (Recipe, "Recipe")]
  s = config_lib.validate(config_lib.load(["train.py", f"--config={ROOT}/configs/default.py:tiny",
                                           "--config.quant.schedule=((3, {'recipe': 'bf16'}),)", "--config.steps=5"]), None)
  assert s.at_phase(1).model == s.model and s.at_phase(1).quant.name == "bf16" != s.quant.name


def test_a_workdir_under_home_is_one_directory(monkeypatch, tmp_path):
  """`~` is expanded once, where the settings are made: checkpoints, metrics and TensorBoard all go under it (the
  metrics went to a literal `./~/...` beside checkpoints under the home directory)."""
  monkeypatch.setenv("HOME", str(tmp_path))
  s = config_lib.validate(helpers.config(**{"workdir": "~/run"}), None)
  assert s.workdir == str(tmp_path / "run")


def test_the_run_directories_are_absolute_where_the_settings_are_made(monkeypatch, tmp_path):
  """Relative directories are resolved once, against the directory the run starts in: the loop, the checkpointers,
  the compilation cache and W&B then take them as they are (Orbax takes no relative path)."""
  monkeypatch.chdir(tmp_path)
  s = config_lib.validate(helpers.config(**{"workdir": "run", "train.compilation_cache_dir": "cache",
                                            "checkpoint.local_dir": "local-{process}",
                                            "checkpoint.local_every_steps": 2}), None)
  assert (s.workdir, s.train.compilation_cache_dir, s.checkpoint.local_dir) == (
      str(tmp_path / "run"), str(tmp_path / "cache"), str(tmp_path / "local-{process}"))
  assert config_lib.validate(helpers.config(**{"workdir": "run", "train.compilation_cache_dir": ""}),
                             None).train.compilation_cache_dir == ""  # Off stays off.


def test_a_config_saved_before_a_key_existed_loads_with_its_default():
  """A checkpoint's config (sampling, export, the precision probe read it back) saved by an older ember lacks the
  keys added since: each takes its default, the behaviour that run had, instead of a KeyError."""
  from ember.config import from_saved
  saved = helpers.settings("tiny_moe", 1, **{"model.router_softmax_first": True}).to_dict()
  del saved["model"]["norm_topk_prob"], saved["train"]["device_batch_size"]
  loaded = from_saved(saved)
  assert loaded.model.norm_topk_prob is True and loaded.train.device_batch_size == 0
  assert loaded.model.router_softmax_first  # What it saved stays.


def test_a_config_file_given_apart_from_its_flag_is_named_so():
  """`--config FILE` (a space, not `=`): the file is an argument of its own; it was reported as an empty --config."""
  cwd = os.getcwd()
  os.chdir(ROOT)
  try:
    with pytest.raises(config_lib.ConfigError, match=r"^--config: give the file in the same argument, --config=FILE"):
      config_lib.load(["train.py", "--config", "configs/default.py:tiny"])
  finally:
    os.chdir(cwd)


def test_a_known_key_the_config_file_lacks_is_named_so(tmp_path):
  """A file built without ember's defaults, a key of ember's set on the command line: the file lacks it (it was
  called an unknown key, with itself as the nearest known one)."""
  path = tmp_path / "bare.py"
  path.write_text("import ml_collections\n\n\ndef get_config():\n  c = ml_collections.ConfigDict()\n"
                  "  c.steps = 3\n  return c\n")
  with pytest.raises(config_lib.ConfigError, match=r"^config\.train\.batch_size: the config file does not define"):
    config_lib.load(["train.py", f"--config={path}", "--config.train.batch_size=2"])


@pytest.mark.parametrize("overrides,line", [
    ({"remat.policy": "full", "remat.save_names": ("attention_context",)},
     "remat.save_names=('attention_context',) is read only under remat.policy=custom"),
    ({"train.muon_momentum": 0.9}, "train.muon_momentum=0.9 is read only under train.optimizer=muon"),
    ({"quant.recipe": "fp8_current", "quant.margin": 1}, "quant.margin=1 is read only by fp8_delayed (quant.recipe"),
    ({"quant.recipe": "fp8_delayed", "quant.nvfp4_rht": False}, "quant.nvfp4_rht=False is read only by nvfp4"),
    ({"remat.memory_budget_gb": 40.0}, "remat.memory_budget_gb=40.0 is read only under remat.policy=auto"),
    ({"pipeline.schedule": "1f1b"}, "pipeline.schedule='1f1b' is read only with a pipeline"),
    ({"quant.recipe": "bf16", "log.quant_stats_every": 10}, "log.quant_stats_every=10 is read only under a quantized"),
    ({"log.wandb_entity": "team"}, "log.wandb_entity='team' is read only with log.wandb_project"),
    ({"checkpoint.params_only": True}, "checkpoint.params_only=True is read only with checkpoint.restore_from"),
    ({"model.mtp_loss_weight": 0.5}, "model.mtp_loss_weight=0.5 is read only with model.mtp_depth > 0"),
    ({"data.tfds_data_dir": "/data/tfds"}, "data.tfds_data_dir='/data/tfds' is read only under data.source=tfds"),
], ids=lambda v: next(iter(v)) if isinstance(v, dict) else None)
def test_a_key_this_run_does_not_read_is_said_to_be_unused(capsys, overrides, line):
  """A key set away from its default where the run reads nothing of it: one warning line naming it (not an error:
  one file serves a sweep's runs and a schedule's phases). Where the run reads it, nothing is said."""
  config_lib.validate(helpers.config("tiny", **overrides), num_devices=1)
  assert f"warning: {line}" in capsys.readouterr().err
  readers = {"remat.save_names": {"remat.policy": "custom"}, "train.muon_momentum": {"train.optimizer": "muon"},
             "quant.margin": {"quant.recipe": "fp8_delayed"}, "quant.nvfp4_rht": {"quant.recipe": "nvfp4"},
             "remat.memory_budget_gb": {"remat.policy": "auto"}, "pipeline.schedule": {"mesh.pipeline": 2},
             "log.quant_stats_every": {"quant.recipe": "fp8_current"}, "model.mtp_loss_weight": {"model.mtp_depth": 1}}
  key = line.split("=")[0]
  if key not in readers:  # Its reader needs what this machine may lack (a W&B login, a checkpoint, TFDS).
    return
  config_lib.validate(helpers.config("tiny", **{**overrides, **readers[key]}), num_devices=None)
  assert key not in capsys.readouterr().err


def test_a_run_saved_with_latent_sizes_and_latent_attention_off_still_loads():
  """The refusal of latent sizes where latent attention is off is a check on load: a run saved before it
  (sampling, export) still reads its config."""
  saved = config_lib.validate(helpers.config("tiny"), None).to_dict()
  saved["model"]["q_lora_rank"] = 32
  assert config_lib.from_saved(saved).model.q_lora_rank == 32
