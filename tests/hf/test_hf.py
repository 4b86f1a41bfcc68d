"""Hugging Face export and import, and KV-cached sampling, against transformers itself (float32, CPU).

Checkpoints here are saved straight from an initialised state (a larger init_std so that logits and
routing are far from uniform), through the trainer's own Checkpointer with the config as metadata.
"""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from ember import config as config_lib
from ember.data import train_tokenizer
from ember.data.pipeline import data_iterator
from ember.data.tokenizers import SentencePieceTokenizer, build_tokenizer
from ember.errors import CheckpointError
from ember.hf import layout, load, safetensors, tokenizer
from ember.inference.checkpoint import load_model
from ember.inference.generate import generate
from ember.parallel.mesh import make_mesh
from ember.parallel.sharding import use_rules
from ember.trainer.checkpointing import Checkpointer
from ember.trainer.loop import train
from ember.trainer.metrics import read_records
from ember.trainer.optimizer import make_optimizer
from ember.trainer.state import abstract_init, state_shardings
from configs import models
from tests import helpers

# One worker runs this module (`--dist loadgroup`): its tests share module-scoped state.
pytestmark = pytest.mark.xdist_group("test_hf")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TEXTS = ["def add(a, b):\n    return a + b\n", "import os\nprint(os.path.join('a', 'b'))\n",
         "class Point:\n    x: int = 0\n    y: int = 0\n", "for i in range(10):\n    print(i * i)\n"]


def _save_checkpoint(workdir, **overrides):
  cfg = helpers.config(**{"workdir": str(workdir), "model.init_std": 0.2, "model.rope_theta": 50000.0,
                          "model.dtype": "float32", "quant.recipe": "bf16", **overrides})
  start = helpers.start(cfg, jax.device_count())
  cfg, state = start.cfg, start.state
  state = dataclasses.replace(state, quant_state=_random_router_biases(state.quant_state))
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), every_steps=1, keep=1, async_save=False)
  ckpt.save(1, state, None, seed=cfg.seed, metadata={"config": cfg.to_dict()})
  ckpt.close()
  return cfg, state


def _random_router_biases(quant_state):
  """Router biases (DeepSeek-V3's) of a few tenths, as a trained model has, so that an export that lost them would
  route otherwise; other leaves unchanged."""
  rng = np.random.default_rng(1)
  return jax.tree_util.tree_map_with_path(
      lambda p, a: jax.device_put(jnp.asarray(rng.normal(0, 0.3, a.shape), a.dtype), a.sharding)
      if jax.tree_util.keystr(p).endswith("['router_bias']") else a, quant_state)


def _tool(module, *args, text=True):
  return subprocess.run([sys.executable, "-m", f"ember.tools.{module}", *args], capture_output=True, text=text,
                        cwd=helpers.ROOT, env={**os.environ, "PYTHONPATH": str(helpers.ROOT)})


def _ember_logits(workdir, tokens):
  cfg, mesh, model = load_model(str(workdir), what="test", one_device=True)
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  with use_rules(mesh, cfg.mesh.rules):
    h, _ = model(jnp.asarray(tokens), jnp.ones_like(tokens), positions)
    return np.asarray(model.head(h))


def _hf_tokens(out_dir):
  tok = transformers.AutoTokenizer.from_pretrained(out_dir)
  ids = [tok(t)["input_ids"] for t in TEXTS]
  assert ids[0] == list(TEXTS[0].encode())  # Byte tokens: the ids are ember's.
  n = min(map(len, ids))
  return np.asarray([i[:n] for i in ids], np.int32)


_EXPORTS = {}
# Each family of Hugging Face layouts (ember/hf/layout.py): Llama, Mixtral, Qwen3, Qwen3-MoE.
KINDS = {"dense": {}, "moe": {"model.num_experts": 4, "model.experts_per_token": 2}, "qwen3": {"model.qk_norm": True},
         "qwen3_moe": {"model.num_experts": 4, "model.experts_per_token": 2, "model.qk_norm": True,
                       "model.router_softmax_first": True},
         # DeepSeek-V3's: latent attention, a dense first layer, grouped sigmoid routing with biases, a shared
         # expert and a multi-token-prediction module (exported as DeepSeek's checkpoints keep it). At this module's
         # init, not the preset's small one: logits far from uniform, where a layout error shows.
         "deepseek": {f"model.{k}": v for k, v in models.get("deepseek_tiny").MODEL.items() if k != "init_std"}}
# Qwen3's QK-norm is checked with its MoE variant; the dense one is an extended case.
KIND_PARAMS = [pytest.param(k, marks=pytest.mark.extended) if k == "qwen3" else k for k in KINDS]


def _export(kind, tmp_path_factory):
  """A tiny `kind` ("dense" or "moe") checkpoint and its float32 export in sharded files, made once per module."""
  if kind not in _EXPORTS:
    root = tmp_path_factory.mktemp(kind)
    cfg, state = _save_checkpoint(root / "run", **KINDS[kind])
    out = root / "hf"
    result = _tool("export_hf", f"--checkpoint={root / 'run'}", f"--out={out}", "--dtype=float32",
                   "--max_shard_size=100KB")
    assert result.returncode == 0, result.stderr
    _EXPORTS[kind] = (kind, cfg, state, root / "run", str(out))
  return _EXPORTS[kind]


@pytest.fixture(scope="module", params=KIND_PARAMS)
def exported(request, tmp_path_factory):
  return _export(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def exported_dense(tmp_path_factory):
  return _export("dense", tmp_path_factory)


@pytest.mark.long
def test_transformers_logits_equal_embers(exported):
  kind, _, _, run, out = exported
  files = os.listdir(out)
  assert "model.safetensors.index.json" in files and "tokenizer.json" in files  # Sharded past 100 KB.
  with open(os.path.join(out, "config.json")) as f:
    assert json.load(f)["architectures"] == [{"dense": "LlamaForCausalLM", "moe": "MixtralForCausalLM",
                                               "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                                               "deepseek": "DeepseekV3ForCausalLM"}[kind]]
  tokens = _hf_tokens(out)
  model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
  with torch.no_grad():
    theirs = model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
  ours = _ember_logits(run, tokens)
  assert np.abs(theirs).max() > 1.0  # Far from uniform: a layout error would show.
  np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4 * np.abs(theirs).max())


@pytest.mark.variants
def test_export_then_import_is_bit_identical(exported):
  """The exported directory loads back, sharded over 4 devices, into the very same parameters."""

  _, cfg, state, _, out = exported
  sizes = dict(fsdp=2, tensor=1, expert=2) if cfg.model.num_experts else dict(fsdp=2, tensor=2)
  mesh_cfg = dataclasses.replace(cfg.mesh, **sizes)
  mesh = make_mesh(mesh_cfg, helpers.devices(4))
  tx, _ = make_optimizer(cfg)
  _, shardings, abstract = state_shardings(cfg, mesh, tx)
  params = load.load_params(out, cfg.model, cfg.quant, abstract.params, shardings.params)
  got, want = jax.tree_util.tree_leaves_with_path(params), jax.tree_util.tree_leaves_with_path(state.params)
  assert [p for p, _ in got] == [p for p, _ in want]
  for (path, a), (_, b) in zip(got, want):
    assert a.sharding == jax.tree_util.tree_reduce(lambda x, y: x, [s for p, s in jax.tree_util.tree_leaves_with_path(
        shardings.params) if p == path]), path
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
  if load.keeps_router_biases(cfg.model):  # DeepSeek's routers' biases come back into the router state.
    placed = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract.quant_state,
                          shardings.quant_state)
    got = load.router_biases(out, cfg.model, cfg.quant, placed)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got, state.quant_state)


# Sampling's own paths are the full-attention cache and DeepSeek's latent one: the other layouts' sampling is an
# extended case (their logits are checked above).
@pytest.mark.long
@pytest.mark.parametrize("exported", [k if k in ("dense", "deepseek") else pytest.param(k, marks=pytest.mark.extended)
                                      for k in KINDS], indirect=True)
def test_greedy_sampling_equals_transformers_generate(exported):
  kind, _, _, run, out = exported
  result = _tool("sample", f"--checkpoint={run}", "--prompt=def ", "--max_new_tokens=24", text=False)
  assert result.returncode == 0, result.stderr
  ours = result.stdout[:-1]  # print's newline.
  model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
  prompt = torch.tensor([list(b"def ")], dtype=torch.long)
  theirs = model.generate(prompt, max_new_tokens=24, do_sample=False)[0].tolist()
  tokenizer = transformers.AutoTokenizer.from_pretrained(out)
  assert ours.decode() == tokenizer.decode(theirs[4:])  # The tool's continuation (invalid UTF-8 replaced alike)...
  cfg, mesh, model = load_model(str(run), what="test", recipe="bf16")
  assert mesh.size == 8  # ...and the tokens themselves, on the 8-device mesh the checkpoint was saved from.
  with use_rules(mesh, cfg.mesh.rules):
    tokens = generate(model, [np.frombuffer(b"def ", np.uint8).astype(np.int32)], max_new_tokens=24,
                      batch_multiple=8)[0]
  assert tokens.tolist() == theirs[4:]


@pytest.mark.long
def test_latent_cache_samples_the_text_of_no_cache(tmp_path_factory):
  """DeepSeek's latent attention samples from its cache (the latent and RoPE key) the tokens that the whole forward
  pass gives for each new token, and the tool states the cache's size: (kv_lora_rank 32 + qk_rope_head_dim 8) x
  3 layers x 4 bytes (float32)."""
  _, cfg, _, run, _ = _export("deepseek", tmp_path_factory)
  args = (f"--checkpoint={run}", "--prompt_file=" + str(_prompts(tmp_path_factory)), "--max_new_tokens=16")
  cached, uncached = _tool("sample", *args), _tool("sample", *args, "--no_cache")
  assert cached.returncode == 0 and uncached.returncode == 0, cached.stderr + uncached.stderr
  assert cached.stdout == uncached.stdout and cached.stdout.count("--- prompt") == 2
  m = cfg.model
  per_token = (m.kv_lora_rank + m.qk_rope_head_dim) * m.num_layers * 4
  assert per_token == 480 and f"KV cache: {per_token:,} bytes per token" in cached.stderr


@pytest.mark.long
def test_a_bf16_deepseek_export_keeps_its_routers_in_float32(tmp_path_factory, tmp_path):
  """transformers keeps DeepSeek-V3's router kernel and score-correction bias in float32 (small bias updates would
  round away in bf16); a bf16 export writes them so, bit for bit, and every other tensor in bf16."""
  _, _, _, run, out32 = _export("deepseek", tmp_path_factory)
  result = _tool("export_hf", f"--checkpoint={run}", f"--out={tmp_path}", "--dtype=bfloat16")
  assert result.returncode == 0, result.stderr
  ours, full = safetensors.Reader(str(tmp_path)), safetensors.Reader(out32)
  routers = [n for n in ours.names() if n.endswith(("mlp.gate.weight", "mlp.gate.e_score_correction_bias"))]
  assert len(routers) >= 4 and any(n.endswith("e_score_correction_bias") for n in routers)
  for name in ours.names():
    assert ours[name].dtype == (np.float32 if name in routers else ml_dtypes.bfloat16), name
  for name in routers:
    np.testing.assert_array_equal(ours[name], full[name])


def _prompts(tmp_path_factory):
  path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
  path.write_text("def \nimport os\n")
  return path


@pytest.mark.variants
def test_import_mismatch_names_the_tensor(exported, tmp_path):
  _, cfg, _, _, out = exported
  other = cfg.replace("model.d_ff", 96)
  abstract, _ = abstract_init(other)
  with pytest.raises(CheckpointError, match=r"tensor model\.layers\.\d+\..*(mlp|experts).* has shape .* but"):
    load.check(out, other.model, other.quant, abstract)
  if cfg.model.mtp_depth:  # A shallower model would expect its prediction module where a layer lies.
    return
  other = cfg.replace("model.num_layers", 1)
  abstract, _ = abstract_init(other)
  with pytest.raises(CheckpointError, match=r"model\.layers\.1\..* has no place in this config"):
    load.check(out, other.model, other.quant, abstract)


def _hf_loss(out_dir, batch):
  """transformers' mean next-token loss on a packed batch: each document run on its own, at its own positions."""
  model = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
  nll, count = 0.0, 0
  for row in range(batch["inputs"].shape[0]):
    segments = batch["segment_ids"][row]
    for s in np.unique(segments[segments > 0]):
      at = segments == s
      inputs = torch.tensor(batch["inputs"][row][at][None], dtype=torch.long)
      positions = torch.tensor(batch["positions"][row][at][None], dtype=torch.long)
      with torch.no_grad():
        logits = model(inputs, position_ids=positions).logits[0].double()
      targets = torch.tensor(batch["targets"][row][at], dtype=torch.long)
      nll += float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
      count += int(at.sum())
  return nll / count


@pytest.mark.long
def test_a_run_starts_from_the_hf_directory(exported_dense, tmp_path, capsys):
  """The first step's loss is transformers' loss of the exported model on that step's batch; without
  init_from_hf the same config (its own init, init_std 0.02 against the export's 0.2) logs another loss."""
  _, _, _, _, out = exported_dense
  overrides = {"model.rope_theta": 50000.0, "model.dtype": "float32", "quant.recipe": "bf16", "steps": 1,
               "checkpoint.every_steps": -1}
  cfg = helpers.config(**{**overrides, "workdir": str(tmp_path / "hf"), "checkpoint.init_from_hf": out})
  data_cfg = cfg.copy_and_resolve_references()
  config_lib.validate(data_cfg, jax.device_count())
  it = data_iterator(config_lib.derive(data_cfg, jax.device_count()), "train")
  try:
    batch = next(it)  # The batch of the run's first step.
  finally:
    it.close()
  want = _hf_loss(out, batch)

  train(helpers.checked(cfg))
  assert "started from the Hugging Face model" in capsys.readouterr().err
  first = [r for r in read_records(str(tmp_path / "hf" / "metrics.jsonl")) if r["step"] == 1]
  assert len(first) == 1 and first[0]["loss"] == pytest.approx(want, rel=1e-5)
  train(helpers.checked(helpers.config(**{**overrides, "workdir": str(tmp_path / "init")})))
  first_init = [r for r in read_records(str(tmp_path / "init" / "metrics.jsonl")) if r["step"] == 1]
  assert abs(first_init[0]["loss"] - want) > 0.1 * want, (first_init[0]["loss"], want)


@pytest.mark.long
def test_bad_hf_input_is_one_line(tmp_path):
  result = subprocess.run([sys.executable, "train.py", "--config=configs/default.py:tiny",
                           f"--config.workdir={tmp_path / 'w'}", f"--config.checkpoint.init_from_hf={tmp_path / 'nope'}"],
                          capture_output=True, text=True, cwd=helpers.ROOT)
  assert result.returncode == 2 and "checkpoint.init_from_hf" in result.stderr
  assert len(result.stderr.strip().splitlines()) == 1, result.stderr
  # A shared expert has no Mixtral form: refused, not exported wrongly.
  _save_checkpoint(tmp_path / "shared", **{"model.num_experts": 4, "model.shared_expert_d_ff": 32})
  result = _tool("export_hf", f"--checkpoint={tmp_path / 'shared'}", f"--out={tmp_path / 'shared_hf'}")
  assert result.returncode == 2 and "shared expert" in result.stderr, result.stderr
  assert len(result.stderr.strip().splitlines()) == 1, result.stderr
  assert not os.path.exists(tmp_path / "shared_hf" / "config.json")


def test_sentencepiece_tokenizer_files_give_embers_ids(tmp_path):
  """ember's SentencePiece tokenizer (BPE, as ember.data.train_tokenizer trains it) and transformers' reading
  of the exported tokenizer.model give the same ids (text that starts with spaces aside: see ember/hf/tokenizer.py)."""
  words = ["alpha", "beta", "gamma", "return", "lambda", "import", "class", "def"]
  rng = np.random.default_rng(0)
  (tmp_path / "corpus").mkdir()
  for i in range(8):
    lines = ["    " * int(rng.integers(0, 3)) + " ".join(rng.choice(words, size=8)) for _ in range(40)]
    (tmp_path / "corpus" / f"{i}.txt").write_text("\n".join(lines) + "\n")
  train_tokenizer.train(source="text", path=str(tmp_path / "corpus" / "*.txt"), vocab_size=300,
                        out=str(tmp_path / "sp"), input_sentence_size=500)
  ours = SentencePieceTokenizer(str(tmp_path / "sp.model"))
  os.makedirs(tmp_path / "hf")
  tokenizer.write(str(tmp_path / "hf"), str(tmp_path / "sp.model"), 128)
  theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
  for text in ["alpha beta return lambda", "def f():\n    return x\n\n", "\n\nimport é€ class", "a  b   c"]:
    assert theirs(text)["input_ids"] == ours.encode(text).tolist(), text
    assert theirs.decode(theirs(text)["input_ids"]) == text


@pytest.mark.long
def test_a_run_on_a_hugging_face_tokenizer_exports_it(tmp_path, capsys):
  """A byte-level BPE trained by `tokenizers` (Llama-3's and Qwen3's kind) with a BOS post-processor: a run on it
  trains and logs its vocabulary, documents start with its BOS, and the export's tokenizer gives transformers the
  same ids as ember's for a sample text."""
  tokenizers = pytest.importorskip("tokenizers")
  words = ["alpha", "beta", "gamma", "return", "lambda", "import", "class", "def"]
  rng = np.random.default_rng(0)
  (tmp_path / "corpus").mkdir()
  for i in range(8):
    (tmp_path / "corpus" / f"{i}.txt").write_text("\n".join(" ".join(rng.choice(words, size=8)) for _ in range(40)))
  bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
  bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  bpe.decoder = tokenizers.decoders.ByteLevel()
  bpe.train([str(p) for p in sorted((tmp_path / "corpus").glob("*.txt"))],
            tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>"],
                                           initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
  bpe.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
  bpe.save(str(tmp_path / "tokenizer.json"))

  cfg = helpers.config(**{"workdir": str(tmp_path / "run"), "steps": 2, "data.source": "text",
                          "data.path": str(tmp_path / "corpus" / "*.txt"), "data.tokenizer": str(tmp_path / "tokenizer.json"),
                          "checkpoint.every_steps": 2, "log.every_steps": 1})
  train(helpers.checked(cfg))  # model.vocab_size 0: the tokenizer's 300, padded to 384.
  assert (f"tokenizer {tmp_path / 'tokenizer.json'}: vocabulary {bpe.get_vocab_size()} (model.vocab_size 384)"
          in capsys.readouterr().err)
  ours = build_tokenizer(cfg.data)
  sample = "lambda alpha return beta"
  assert ours.encode(sample)[0] == 0  # The document's BOS.
  result = _tool("export_hf", f"--checkpoint={tmp_path / 'run'}", f"--out={tmp_path / 'hf'}")
  assert result.returncode == 0, result.stderr
  theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
  assert theirs(sample)["input_ids"] == ours.encode(sample).tolist()


def test_export_over_an_earlier_export_leaves_none_of_its_files(exported_dense):
  """An earlier sharded export's index would win over a new single file: it is removed first."""
  _, _, _, run, out = exported_dense
  scratch = os.path.join(os.path.dirname(out), "again")
  shutil.copytree(out, scratch)
  result = _tool("export_hf", f"--checkpoint={run}", f"--out={scratch}", "--dtype=float32")
  assert result.returncode == 0, result.stderr
  assert sorted(f for f in os.listdir(scratch) if "safetensors" in f) == ["model.safetensors"]


# Llama 3.1's RoPE scaling ("llama3"), with an original length whose three bands (kept, mixed, scaled) all hold
# frequencies of tiny's heads.
ROPE_KINDS = {"llama3_rope": {"model.rope_scaling_factor": 8.0, "model.rope_original_seq_len": 64}}


@pytest.mark.parametrize("kind", KIND_PARAMS + list(ROPE_KINDS))
@pytest.mark.variants
def test_a_model_written_by_transformers_imports_with_its_logits(kind, tmp_path):
  """A randomly initialised Llama / Mixtral / Qwen3 / Qwen3-MoE saved by transformers itself (not by ember's export) starts
  an ember model with transformers' logits."""

  # transformers' DeepseekV3 has no multi-token-prediction module to save.
  cfg = helpers.config(**{"model.dtype": "float32", "quant.recipe": "bf16", "model.rope_theta": 50000.0,
                          **{**KINDS, **ROPE_KINDS}[kind], **({"model.mtp_depth": 0} if kind == "deepseek" else {})})
  start = helpers.start(cfg)
  cfg = start.cfg
  m = cfg.model
  hf_config = layout.hf_config(m, "float32")
  hf_config["initializer_range"] = 0.2
  config = transformers.AutoConfig.for_model(**hf_config)
  torch.manual_seed(0)
  theirs_model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
  for name, buffer in theirs_model.named_buffers():  # DeepSeek's routers' biases: routing state to import too.
    if name.endswith("e_score_correction_bias"):
      buffer.copy_(torch.randn(buffer.shape) * 0.3)
  theirs_model.save_pretrained(tmp_path / "hf")
  tokens = np.asarray([list(text.encode())[:24] for text in TEXTS], np.int32)
  with torch.no_grad():
    theirs = theirs_model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()

  with start.rules():
    params = load.load_params(str(tmp_path / "hf"), m, start.cfg.quant, start.state.params, start.shardings.params)
    quant_state = start.state.quant_state
    if load.keeps_router_biases(m):
      quant_state = load.router_biases(str(tmp_path / "hf"), m, start.cfg.quant, quant_state)
    model = nnx.merge(start.graphdef, params, quant_state)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    h, _ = model(jnp.asarray(tokens), jnp.ones_like(tokens), positions)
    ours = np.asarray(model.head(h))
  assert np.abs(theirs).max() > 1.0
  np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4 * np.abs(theirs).max())


def test_unrenormalised_routing_has_no_mixtral_form_and_a_qwen3_moe_config_must_say_so():
  """Mixtral renormalises its top-k weights: a model that does not (model.norm_topk_prob=false) is refused, on
  export and on import (its logits were 30-38% off); Qwen3-MoE's config.json carries the setting, checked both ways."""
  overrides = {"model.router_softmax_first": True, "model.norm_topk_prob": False}
  mixtral = helpers.settings("tiny_moe", 1, **overrides).model
  assert "norm_topk_prob = false) have no Mixtral form" in layout.unsupported(mixtral)
  qwen = helpers.settings("tiny_moe", 1, **overrides, **{"model.qk_norm": True}).model
  assert layout.unsupported(qwen) is None
  written = layout.hf_config(qwen, "float32")
  assert written["norm_topk_prob"] is False and layout.config_mismatch(qwen, written) is None
  assert "config.model.norm_topk_prob is False" in layout.config_mismatch(qwen, {**written, "norm_topk_prob": True})


def test_an_export_into_the_tokenizers_own_directory_keeps_it(tmp_path):
  """init_from_hf=DIR with data.tokenizer=DIR, then an export back to DIR: the stale-file sweep deleted the
  tokenizer before copying it, and the export failed with the directory's tokenizer gone for good."""
  tokenizers = pytest.importorskip("tokenizers")
  from ember.tools.export_hf import export
  hf_dir = tmp_path / "hf"
  hf_dir.mkdir()
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<s>": 0, "</s>": 1, "hello": 2, "[UNK]": 3},
                                                         unk_token="[UNK]"))
  tok.save(str(hf_dir / "tokenizer.json"))
  (hf_dir / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
  before = (hf_dir / "tokenizer.json").read_bytes(), (hf_dir / "tokenizer_config.json").read_bytes()
  _save_checkpoint(tmp_path / "run", **{"data.tokenizer": str(hf_dir)})
  files = export(str(tmp_path / "run"), str(hf_dir), dtype="float32")
  assert "tokenizer.json" in files and (hf_dir / "config.json").exists()
  assert ((hf_dir / "tokenizer.json").read_bytes(), (hf_dir / "tokenizer_config.json").read_bytes()) == before
  # The tokenizer ends documents with </s>: the exported model stops there (transformers' generate reads it).
  for name in ("config.json", "generation_config.json"):
    assert json.loads((hf_dir / name).read_text())["eos_token_id"] == 1
  # And ember's sampler prints the text up to it.
  from ember.tools.sample import _continuation
  tok = build_tokenizer(helpers.settings(**{"data.tokenizer": str(hf_dir)}).data)
  assert _continuation(tok, np.asarray([2]), np.asarray([2, 1, 2, 2])) == tok.decode([2, 2, 1])[len(tok.decode([2])):]
