"""The tiny decoder with 4 experts, top-2, in every layer: MoE unit tests and CPU runs.

Batch 128 x 64 bytes at a learning rate of 3e-3 (this width takes it): the 200 steps of
configs/default.py take a few minutes on a CPU and reach an eval loss below 2.2 nats per byte on
the stdlib text with fp8_current and nvfp4 (docs/moe.md). Tests set their own batch."""
MODEL = dict(name="tiny_moe", num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128, seq_len=64,
             num_experts=4, experts_per_token=2)
TRAIN = dict(batch_size=128, learning_rate=3e-3)
