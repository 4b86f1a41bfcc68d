"""The default CPU model: 4 layers of width 256, trained on 16 x 256 bytes per step."""
MODEL = dict(name="small", num_layers=4, d_model=256, num_heads=4, num_kv_heads=2, d_ff=768, seq_len=256)
TRAIN = dict(batch_size=16)
