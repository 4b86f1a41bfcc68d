"""Sample from a checkpoint: KV-cached, jitted decoding (ember/inference/generate.py).

  python -m ember.tools.sample --checkpoint=runs/default_small --prompt='def ' [--max_new_tokens=128]
      [--temperature=0.8] [--top_p=0.95] [--seed=0] [--prompt_file=prompts.txt] [--quantized] [--dtype=float32]
      [--one_device] [--no_cache]

Prints the continuation (the new tokens, decoded). Temperature 0 (the default) is greedy.
`--prompt_file` holds one prompt per line (`\\n` inside a line is a newline), decoded as one batch;
each continuation is printed after a `--- prompt i` line. The
model runs unquantized by default, as Hugging Face and serving stacks run the exported weights;
`--quantized` keeps the recipe it was trained with. It runs on the mesh it was trained on when this
job has that many devices, else (or with `--one_device`) on one device. The KV cache's size per token goes to
stderr (multi-head latent attention caches its latent and RoPE key); `--no_cache` runs the whole forward pass for
every new token instead (the same tokens in float32, slower; bfloat16 near-ties may round either way).
"""

from __future__ import annotations

import math
import sys

from ember import native_output


def main(argv: list[str]) -> int:
  from ember.errors import ArgumentParser, ConfigError, EmberError, fail_and_exit
  from ember.tools import cli

  parser = ArgumentParser(prog="python -m ember.tools.sample")
  parser.add_argument("--checkpoint", required=True, help="workdir, checkpoints/ directory or step directory")
  parser.add_argument("--prompt", default=None, help="the text to continue")
  parser.add_argument("--prompt_file", default="", help="one prompt per line, sampled as one batch")
  parser.add_argument("--max_new_tokens", type=int, default=128)
  parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
  parser.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--quantized", action="store_true", help="run the forward pass in the trained recipe")
  parser.add_argument("--dtype", default="", help="compute dtype (default: the trained model.dtype)")
  parser.add_argument("--one_device", action="store_true", help="one device, whatever the trained mesh")
  parser.add_argument("--no_cache", action="store_true", help="no KV cache: the whole forward pass for every token")
  try:
    args = cli.parse(parser, argv[1:])
    if (args.prompt is None) == (not args.prompt_file):
      raise ConfigError("--prompt / --prompt_file: give exactly one of them")
    if args.max_new_tokens < 1:
      raise ConfigError(f"--max_new_tokens: {args.max_new_tokens} must be at least 1")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
      raise ConfigError(f"--temperature: {args.temperature} must be a number >= 0")
    if not 0 < args.top_p <= 1:
      raise ConfigError(f"--top_p: {args.top_p} must be in (0, 1]")
    if args.top_p < 1 and args.temperature == 0:
      raise ConfigError(f"--top_p: {args.top_p} draws from the nucleus, but --temperature=0 (the default) takes the "
                        "most likely token: set --temperature too")
    if args.dtype not in ("", "float32", "bfloat16", "float16"):
      raise ConfigError(f"--dtype: {args.dtype!r} is not float32, bfloat16 or float16")
    prompts = [args.prompt] if args.prompt is not None else _read_prompts(args.prompt_file)
    texts = sample(args.checkpoint, prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                   top_p=args.top_p, seed=args.seed, quantized=args.quantized, dtype=args.dtype or None,
                   one_device=args.one_device, cache=not args.no_cache)
  except EmberError as e:
    fail_and_exit(e)
  for i, text in enumerate(texts):
    if len(prompts) > 1:
      print(f"--- prompt {i}")
    print(text)
  return 0


def _read_prompts(path: str) -> list[str]:
  from ember.errors import ConfigError
  try:
    with open(path, encoding="utf-8") as f:
      lines = [line.rstrip("\n").replace("\\n", "\n") for line in f]
  except (OSError, UnicodeDecodeError) as e:
    raise ConfigError(f"--prompt_file: cannot read {path} ({type(e).__name__})") from None
  prompts = [line for line in lines if line]
  if not prompts:
    raise ConfigError(f"--prompt_file: {path} holds no prompt")
  return prompts


def sample(checkpoint: str, prompts: list[str], *, max_new_tokens: int, temperature: float = 0.0,
           top_p: float = 1.0, seed: int = 0, quantized: bool = False, dtype: str | None = None,
           one_device: bool = False, cache: bool = True) -> list[str]:
  """The continuation of each prompt, decoded to text."""
  from ember.data import build_tokenizer
  from ember.errors import ConfigError
  from ember.inference.checkpoint import load_model
  from ember.inference.generate import cache_bytes_per_token, generate
  from ember.parallel import sharding
  from ember.parallel.sharding import use_rules
  from ember.quant.recipe import UNQUANTIZED

  cfg, mesh, model = load_model(checkpoint, what="--checkpoint", recipe=None if quantized else UNQUANTIZED, dtype=dtype,
                                one_device=one_device)
  tokenizer = build_tokenizer(cfg.data)
  encoded = prompt_ids(tokenizer, prompts)
  empty = next((i for i, e in enumerate(encoded) if len(e) == 0), None)
  if empty is not None:
    raise ConfigError(f"--prompt: prompt {empty} encodes to no tokens")
  batch_shards = sharding.shards(sharding.batch_axes(cfg.mesh.rules_dict, mesh), dict(mesh.shape))
  m = cfg.model
  per_token = cache_bytes_per_token(model)
  what = (f"(kv_lora_rank {m.kv_lora_rank} + qk_rope_head_dim {m.qk_rope_head_dim})" if m.is_mla else
          f"2 x {m.num_kv_heads} kv heads x head_dim {m.head_dim}")
  print(f"KV cache: {per_token:,} bytes per token = {what} x {m.num_layers} layers x {m.dtype.itemsize} bytes "
        f"({m.dtype.name}){'' if cache else '; not used (--no_cache)'}", file=sys.stderr)
  with use_rules(mesh, cfg.mesh.rules):
    out = generate(model, encoded, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                   batch_multiple=batch_shards, cache=cache, vocab=tokenizer.vocab_size)
  return [_continuation(tokenizer, prompt, new) for prompt, new in zip(encoded, out)]


def prompt_ids(tokenizer, prompts: list[str]) -> list:
  """Each prompt's ids as a text that goes on: without the end-of-document token a tokenizer ends a training
  document with (after it the model would start a new document, not continue the prompt)."""
  return [tokenizer.encode(p, eos=False) for p in prompts]


def _continuation(tokenizer, prompt, new_ids) -> str:
  """The new tokens' text as it reads after the prompt's ids, up to the end of the document (the tokenizer's EOS,
  where it ends documents with one: past it the model starts another): decoded together with the prompt, then the
  prompt's text removed (SentencePiece drops a leading space from tokens decoded alone)."""
  import numpy as np
  eos = getattr(tokenizer, "eos_id", None)
  if eos is not None and eos in new_ids:
    new_ids = new_ids[:list(new_ids).index(eos) + 1]
  whole = tokenizer.decode(np.concatenate([prompt, new_ids]))
  prefix = tokenizer.decode(prompt)
  return whole[len(prefix):] if whole.startswith(prefix) else tokenizer.decode(new_ids)


if __name__ == "__main__":
  native_output.quiet(sys.argv)
  sys.exit(main(sys.argv))
