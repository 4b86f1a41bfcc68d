"""Llama-3.2-1B-like: 16 layers, width 2048, 32 heads (8 kv), SwiGLU 8192, tied embeddings."""
MODEL = dict(name="1b", num_layers=16, d_model=2048, num_heads=32, num_kv_heads=8, d_ff=8192,
             vocab_size=128256, seq_len=2048, rope_theta=500000.0, tie_embeddings=True)
TRAIN = dict(batch_size=256, learning_rate=3e-4)
