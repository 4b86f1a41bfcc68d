"""Mixtral-8x7B shapes: 32 layers, width 4096, 32 heads (8 kv), 8 experts of SwiGLU 14336, top-2.

46.7B parameters with float32 master weights and Adam moments are 16 bytes a parameter: 93 GB per GPU
on one node of 8 before any activation, so no remat preset fits `h100x8` (docs/remat.md, "Will it
fit?"); run it on two nodes or more. Remat: `save_dot_except_mlp`, which fits two nodes
(`--target=h100x16`, FSDP 16, one 4096-token sequence per GPU, fp8_current: 65.5 GiB of 79.1) where
`minimal` (79.9 GiB) and `minimal_quantized` (127.9 GiB) do not. The faster layout on two nodes is expert
parallelism inside each and FSDP across them (`--config.mesh.fsdp=1 --config.mesh.expert=8
--config.mesh.dcn_fsdp=2`, what `ember.tools.plan` picks): 44.3% MFU ceiling against 6.3% (docs/moe.md).
The batch of 256 sequences needs micro-batches: `--config.train.device_batch_size=1` (one sequence per GPU at a
time, the figures above), or each GPU takes 16 at once.
"""
MODEL = dict(name="mixtral_8x7b", num_layers=32, d_model=4096, num_heads=32, num_kv_heads=8, d_ff=14336,
             vocab_size=32000, seq_len=4096, rope_theta=1e6, num_experts=8, experts_per_token=2)
TRAIN = dict(batch_size=256, learning_rate=3e-4, warmup_steps=2000)
REMAT = dict(policy="save_dot_except_mlp")
