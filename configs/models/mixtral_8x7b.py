"""Mixtral-8x7B shapes: 32 layers, width 4096, 32 heads (8 kv), 8 experts of SwiGLU 14336, top-2."""
MODEL = dict(name="mixtral_8x7b", num_layers=32, d_model=4096, num_heads=32, num_kv_heads=8, d_ff=14336,
             vocab_size=32000, seq_len=4096, rope_theta=1e6, num_experts=8, experts_per_token=2)
TRAIN = dict(batch_size=256, learning_rate=3e-4, warmup_steps=2000)
