"""A tiny DeepSeek-V3-like decoder for tests and CPU runs: multi-head latent attention (query latent 32, key/value
latent 32, RoPE key 8, 16 + 8 query/key dims and 16 value dims a head), a dense first layer of SwiGLU 128, then
MoE layers of 8 routed experts of 64 in 4 groups (top-2 within the best 2 groups, sigmoid scores scaled by 2.5)
beside one shared expert, the aux-loss-free router bias, and one multi-token-prediction module. Initialised as
DeepSeek-V3 is (std 0.006)."""
MODEL = dict(name="deepseek_tiny", num_layers=3, d_model=64, num_heads=4, num_kv_heads=4, d_ff=64, dense_d_ff=128,
             seq_len=64, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
             num_experts=8, experts_per_token=2, router_score="sigmoid", n_group=4, topk_group=2,
             routed_scaling_factor=2.5, num_shared_experts=1, first_k_dense=1, router_bias_update_rate=1e-3,
             seq_load_balance_weight=1e-4,
             load_balance_weight=0.0, router_z_weight=0.0, mtp_depth=1, mtp_loss_weight=0.3, init_std=0.006)
TRAIN = dict(batch_size=128, learning_rate=3e-3)
