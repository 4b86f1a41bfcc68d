"""Qwen3-235B-A22B shapes: 94 layers, width 4096, 64 query heads of 128 (4 kv heads) with QK-norm, 128 experts of
SwiGLU 1536 in every layer, top-8 with the chosen weights renormalised, no shared expert, vocab 151936, RoPE base
1e6.

235B parameters (22B active a token). Megatron-Bridge's benchmark trains it on 256 H100s with a global batch of
8,192 sequences of 4,096 (TP 2, PP 8, 4 virtual stages, EP 32). ember's pipeline stages need not divide the 94
layers: 8 stages hold 96 rows, 2 of them padding (docs/parallelism.md, "Uneven stages"). Hugging Face import and
export: the Qwen3-MoE layout (ember/hf/layout.py), as qwen3_30b_a3b.
"""
MODEL = dict(name="qwen3_235b_a22b", num_layers=94, d_model=4096, num_heads=64, num_kv_heads=4, head_dim=128,
             d_ff=1536, vocab_size=151936, seq_len=4096, rope_theta=1e6, norm_eps=1e-6, qk_norm=True,
             num_experts=128, experts_per_token=8, router_softmax_first=True)
TRAIN = dict(batch_size=8192, learning_rate=1e-4, warmup_steps=2000)
REMAT = dict(policy="full")
