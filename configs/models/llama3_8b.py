"""Llama-3-8B shapes: 32 layers, width 4096, 32 heads (8 kv), SwiGLU 14336, vocab 128256."""
MODEL = dict(name="llama3_8b", num_layers=32, d_model=4096, num_heads=32, num_kv_heads=8, d_ff=14336,
             vocab_size=128256, seq_len=8192, rope_theta=500000.0)
TRAIN = dict(batch_size=256, learning_rate=3e-4, warmup_steps=2000)
