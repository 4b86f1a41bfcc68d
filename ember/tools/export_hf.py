"""Export a checkpoint as a Hugging Face model directory (LlamaForCausalLM, MixtralForCausalLM, Qwen3's or
DeepseekV3ForCausalLM, by the model: ember/hf/layout.py).

  python -m ember.tools.export_hf --checkpoint=runs/default_small --out=hf/default_small [--dtype=bfloat16]
      [--max_shard_size=5GB]

`--checkpoint` is a workdir, its checkpoints/ directory (the newest step) or one step directory. The
directory gets config.json, model.safetensors (or numbered files and model.safetensors.index.json past
`--max_shard_size`), generation_config.json and the tokenizer files (ember/hf/tokenizer.py): it loads
with transformers' AutoModelForCausalLM and AutoTokenizer. The tensor layout is ember/hf/layout.py.
Architectures the format cannot express are refused with one line (exit 2), not exported wrongly.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys

from ember import native_output, storage

DTYPES = ("bfloat16", "float32", "float16")


def parse_size(text: str) -> int:
  """'5GB', '500MB', '2GiB' or a number of bytes."""
  m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", text, re.IGNORECASE)
  if not m:
    raise ValueError(text)
  unit = (m.group(2) or "B").upper()
  scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
           "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
  return int(float(m.group(1)) * scale)


def export(checkpoint: str, out: str, *, dtype: str = "bfloat16", max_shard_bytes: int = 5 * 10**9) -> list[str]:
  """Writes the HF directory `out`; returns the files written."""
  import jax
  import ml_dtypes
  import numpy as np
  from flax import nnx

  from ember.data import build_tokenizer
  from ember.errors import CheckpointError, ConfigError, warn
  from ember.hf import layout, safetensors, tokenizer
  from ember.inference.checkpoint import load_model
  from ember.layers.moe import RouterBias

  cfg, _, model = load_model(checkpoint, what="--checkpoint", one_device=True, host=True)
  m = cfg.model
  deepseek = layout.family(m) == "deepseek_v3"  # Its format keeps the router's bias and the MTP modules.
  problem = layout.unsupported(m) or (m.is_moe and m.router_bias_update_rate and not deepseek and (
      "its router bias (model.router_bias_update_rate > 0) has no Mixtral or Qwen3-MoE form, and without it the "
      "model would route to other experts"))
  if problem:
    raise CheckpointError(f"--checkpoint: {problem}; not exported")
  # A tokenizer that is gone is a one-line error before anything is written. Its EOS, where it ends documents with
  # one, is the exported model's (transformers' generate stops there).
  eos = getattr(build_tokenizer(cfg.data), "eos_id", None)
  if m.capacity_factor > 0:
    warn(f"the model was trained with model.capacity_factor={m.capacity_factor} (tokens past capacity dropped); "
         "the exported Mixtral is dropless")
  if m.mtp_depth and not deepseek:
    warn(f"the {m.mtp_depth} multi-token-prediction modules have no {layout.FAMILIES[layout.family(m)][0]} form; "
         "the model is exported without them (sampling never runs them)")
  params = jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Any(nnx.Param, RouterBias) if deepseek
                                                     else nnx.Param)))
  np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
  hf_tensors = layout.to_hf(m, cfg.quant, params)
  tensors = {name: w.astype(layout.export_dtype(m, name, np_dtype)) for name, w in hf_tensors.items()}
  try:
    os.makedirs(out, exist_ok=True)
  except OSError as e:  # Where the permission bits allow it but the file system does not (/proc, read-only).
    raise ConfigError(f"--out: cannot create {out}: {e.strerror or e}") from None
  keep = tokenizer.source_files(cfg.data.tokenizer)  # An export into the directory the tokenizer is read from.
  for stale in glob.glob(os.path.join(out, "model*.safetensors*")) + glob.glob(os.path.join(out, "tokenizer*")):
    if os.path.abspath(stale) not in keep:
      os.remove(stale)  # An earlier export's files would win over this one's (an old index, tokenizer.json).
  files = safetensors.write_dir(out, tensors, max_shard_bytes)
  storage.write_atomic(os.path.join(out, "config.json"),
                       json.dumps({**layout.hf_config(m, dtype), "eos_token_id": eos}, indent=2))
  storage.write_atomic(os.path.join(out, "generation_config.json"), json.dumps(
      {"bos_token_id": None, "eos_token_id": eos, "pad_token_id": None, "do_sample": False}, indent=2))
  files += ["config.json", "generation_config.json"]
  files += tokenizer.write(out, cfg.data.tokenizer, m.seq_len)
  return files


def main(argv: list[str]) -> int:
  from ember.errors import ArgumentParser, ConfigError, EmberError, fail_and_exit
  from ember.tools import cli

  parser = ArgumentParser(prog="python -m ember.tools.export_hf")
  parser.add_argument("--checkpoint", required=True, help="workdir, checkpoints/ directory or step directory")
  parser.add_argument("--out", required=True, help="the Hugging Face directory to write")
  parser.add_argument("--dtype", default="bfloat16", help="tensor dtype: " + ", ".join(DTYPES))
  parser.add_argument("--max_shard_size", default="5GB", help="largest safetensors file before splitting")
  try:
    args = cli.parse(parser, argv[1:])
    if args.dtype not in DTYPES:
      raise ConfigError(f"--dtype: {args.dtype!r} is not one of {', '.join(DTYPES)}")
    try:
      max_bytes = parse_size(args.max_shard_size)
    except ValueError:
      raise ConfigError(f"--max_shard_size: {args.max_shard_size!r} is not a size like 5GB or 500MB") from None
    if max_bytes <= 0:
      raise ConfigError(f"--max_shard_size: {args.max_shard_size!r} must be more than 0 bytes")
    cli.check_out_dir("--out", args.out)
    files = export(args.checkpoint, args.out, dtype=args.dtype, max_shard_bytes=max_bytes)
  except EmberError as e:
    fail_and_exit(e)
  print(f"wrote {args.out}: {', '.join(files)}")
  return 0


if __name__ == "__main__":
  native_output.quiet(sys.argv)
  sys.exit(main(sys.argv))
