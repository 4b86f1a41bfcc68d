"""Llama-3-8B shapes: 32 layers, width 4096, 32 heads (8 kv), SwiGLU 14336, vocab 128256.

Layers unrolled (`scan_layers=False`): a step without the scan's copies of the saved activations, 5% faster on
8 H100s (fp8_current: 387 against 413 ms floors, with the gate/up output saved whole), for a compile of seconds
more (docs/remat.md, "Scanned or unrolled layers").

Remat: `minimal_quantized`, the preset with the least recompute that fits an 80 GB H100 at one 8192-token
sequence per GPU under FSDP 8 (51.0 GiB with fp8_current, this unrolled program: README's table). The whole table
of the scanned program, and the command that made it: docs/remat.md ("Will it fit?").

The batch of 256 sequences needs micro-batches on any cluster: `--config.train.device_batch_size=1` runs one
sequence per GPU at a time (the figures above) whatever the node count; without it each GPU takes 256 / GPUs at
once.
"""
MODEL = dict(name="llama3_8b", num_layers=32, d_model=4096, num_heads=32, num_kv_heads=8, d_ff=14336,
             vocab_size=128256, seq_len=8192, rope_theta=500000.0, scan_layers=False)
TRAIN = dict(batch_size=256, learning_rate=3e-4, warmup_steps=2000)
REMAT = dict(policy="minimal_quantized")
