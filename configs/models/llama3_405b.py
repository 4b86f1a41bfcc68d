"""Llama-3.1-405B shapes: 126 layers, width 16384, 128 heads (8 kv), SwiGLU 53248, vocab 128256, RoPE base 5e5,
8192-token sequences (the pretraining length; the 128k-token extension is a later phase).

405.9B parameters with float32 master weights and Adam moments are 6.5 TB of train state. Megatron-Bridge's
benchmark runs it on 1,024 H100s with a global batch of 1,536 sequences of 8192 (TP 8, PP 8, CP 2, 8 virtual
stages). ember's pipeline stages need not divide the 126 layers: 8 stages hold 128 rows, 2 of them padding
(docs/parallelism.md, "Uneven stages").
Hugging Face export and import: the Llama layout (ember/hf/layout.py), as llama3_8b and llama3_70b. The published
Llama-3.1 checkpoints carry the RoPE scaling of their 128k-token extension ("llama3"); the preset, for the
8192-token pretraining, has none: import one with `--config.model.rope_scaling_factor=8` (docs/huggingface.md).
"""
MODEL = dict(name="llama3_405b", num_layers=126, d_model=16384, num_heads=128, num_kv_heads=8, d_ff=53248,
             vocab_size=128256, seq_len=8192, rope_theta=500000.0)
TRAIN = dict(batch_size=1536, learning_rate=8e-5, warmup_steps=8000)
REMAT = dict(policy="full")
