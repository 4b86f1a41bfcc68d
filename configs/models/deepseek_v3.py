"""DeepSeek-V3 (671B, 37B active) shapes, as published (the report and its config.json): 61 layers of width 7168,
128 heads of multi-head latent attention (query latent 1536, key/value latent 512, 128 + 64 RoPE query/key dims and
128 value dims a head), the first 3 layers dense (SwiGLU 18432), the other 58 MoE: 256 routed experts of 2048 in 8
groups, top-8 within the best 4 groups (node-limited routing), sigmoid scores with the aux-loss-free bias and a
routed scaling of 2.5, one shared expert; one multi-token-prediction module (weight 0.3), vocab 129280; weights
drawn with std 0.006, the report's (section 4.2; ember's rule then scales the output projections' std by depth).
Megatron-Bridge trains it on 1,024 H100s (FP8, batch 8,192 x 4,096); `ember.tools.plan --target=h100x1024` picks
ember's layout (docs/deepseek.md, "Planning deepseek_v3 on 1,024 H100s")."""
MODEL = dict(name="deepseek_v3", num_layers=61, d_model=7168, num_heads=128, num_kv_heads=128, d_ff=2048,
             dense_d_ff=18432, vocab_size=129280, seq_len=4096, rope_theta=10000.0, norm_eps=1e-6, q_lora_rank=1536,
             kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, num_experts=256,
             experts_per_token=8, router_score="sigmoid", n_group=8, topk_group=4, routed_scaling_factor=2.5,
             num_shared_experts=1, first_k_dense=3, router_bias_update_rate=1e-3, seq_load_balance_weight=1e-4,
             load_balance_weight=0.0, router_z_weight=0.0,
             mtp_depth=1, mtp_loss_weight=0.3, init_std=0.006)
TRAIN = dict(batch_size=8192, learning_rate=2.2e-4, warmup_steps=2000)
REMAT = dict(policy="full")
