"""The tiny decoder with 4 experts, top-2, in every layer: MoE unit tests and CPU runs."""
MODEL = dict(name="tiny_moe", num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128, seq_len=64,
             num_experts=4, experts_per_token=2)
TRAIN = dict(batch_size=8)
