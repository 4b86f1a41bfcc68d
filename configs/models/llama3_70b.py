"""Llama-3-70B shapes: 80 layers, width 8192, 64 heads (8 kv), SwiGLU 28672, vocab 128256.

70.6B parameters with float32 master weights and Adam moments are 16 bytes a parameter, 1.1 TB: FSDP over
at least 16 H100s before any activation. Megatron-Bridge's benchmark runs it on 64 (8 nodes) with a global
batch of 128 sequences of 8192. Remat `full`: FSDP over the 64 GPUs of `--target=h100x64` (the layout
`ember.tools.plan` picks), fp8_current, two sequences per GPU, compiles to a 46.2 GiB peak. The floor is set by
the collectives: with float32 gradients (the default) 9.2 s a step, 1,773 tokens/s per GPU; with
`--config.train.grad_reduce_dtype=bfloat16` the gradients cross the NICs in bf16 and it is 6.5 s, 2,519 tokens/s.
`save_dot_except_mlp` needs 110 GiB. (`python -m ember.tools.compile --config=configs/default.py:llama3_70b
--config.data.source=synthetic --config.quant.recipe=fp8_current --target=h100x64`.)
"""
MODEL = dict(name="llama3_70b", num_layers=80, d_model=8192, num_heads=64, num_kv_heads=8, d_ff=28672,
             vocab_size=128256, seq_len=8192, rope_theta=500000.0)
TRAIN = dict(batch_size=128, learning_rate=1.5e-4, warmup_steps=2000)
REMAT = dict(policy="full")
