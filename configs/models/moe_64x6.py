"""Fine-grained MoE (DeepSeekMoE-16B-like): 28 layers, width 2048, 64 experts of 1408, top-6,
plus a shared expert of 2816; every layer MoE (docs/moe.md's figures). DeepSeekMoE-16B's first layer is dense
(`--config.model.first_k_dense=1 --config.model.dense_d_ff=10944`), and its top-6 weights are the probabilities
as they are (`--config.model.norm_topk_prob=false`); this preset renormalises them, as Qwen3-MoE does."""
MODEL = dict(name="moe_64x6", num_layers=28, d_model=2048, num_heads=16, num_kv_heads=16, d_ff=1408,
             vocab_size=102400, seq_len=4096, num_experts=64, experts_per_token=6, shared_expert_d_ff=2816,
             router_softmax_first=True)
TRAIN = dict(batch_size=512, learning_rate=4.2e-4, warmup_steps=2000)
