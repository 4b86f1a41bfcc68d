"""Qwen3-30B-A3B shapes: 48 layers, width 2048, 32 query heads of 128 (4 kv heads) with QK-norm, 128 experts
of SwiGLU 768 in every layer, top-8 with the chosen weights renormalised (softmax, top-k, renormalise), no
shared expert, vocab 151936, RoPE base 1e6. Megatron-Bridge's benchmark trains it on 16 H100s (global batch
512 of 4096 tokens, EP 8) and on 8 B200s. The layouts `ember.tools.plan` picks, with
`--config.train.grad_reduce_dtype=bfloat16`: on `--target=h100x16` EP 8 inside each node and FSDP across the two
(`--config.mesh.fsdp=1 --config.mesh.expert=8 --config.mesh.dcn_fsdp=2`), 8 micro-batches of four sequences per
GPU (`--config.train.grad_accum_steps=8`), remat `full`. On `--target=b200x8`, FSDP 8, 8 micro-batches,
`save_dot_except_mlp`, mxfp8. docs/performance.md ("The peers' benchmarks, one for one") has each layout's
ceiling, predicted throughput and peak as last compiled.
"""
MODEL = dict(name="qwen3_30b_a3b", num_layers=48, d_model=2048, num_heads=32, num_kv_heads=4, head_dim=128,
             d_ff=768, vocab_size=151936, seq_len=4096, rope_theta=1e6, norm_eps=1e-6, qk_norm=True,
             num_experts=128, experts_per_token=8, router_softmax_first=True)
TRAIN = dict(batch_size=512, learning_rate=3e-4, warmup_steps=2000)
