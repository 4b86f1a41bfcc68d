"""GPT-3 Small / Llama-style 125M: 12 layers, width 768, 12 heads, SwiGLU 2048."""
MODEL = dict(name="125m", num_layers=12, d_model=768, num_heads=12, num_kv_heads=12, d_ff=2048,
             vocab_size=32000, seq_len=2048)
TRAIN = dict(batch_size=256, learning_rate=6e-4)
