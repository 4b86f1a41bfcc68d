"""A two-layer decoder for unit tests: compiles in seconds on one CPU core."""
MODEL = dict(name="tiny", num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128, seq_len=64)
TRAIN = dict(batch_size=8)
