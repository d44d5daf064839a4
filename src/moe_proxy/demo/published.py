"""config.json of published MoE models (the fields the planner reads; no weights): for
`moe-proxy plan` examples, the tests and docs/performance.md's tables."""

DEEPSEEK_V3 = {  # deepseek-ai/DeepSeek-V3: 671B total, 37B active
    "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "n_group": 8, "topk_group": 4, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128, "v_head_dim": 128, "tie_word_embeddings": False,
}
QWEN3_235B = {  # Qwen/Qwen3-235B-A22B: 235B total, 22B active
    "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
    "moe_intermediate_size": 1536, "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "tie_word_embeddings": False,
}
QWEN3_30B = {  # Qwen/Qwen3-30B-A3B: 30.5B total, 3.3B active
    **QWEN3_235B, "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_hidden_layers": 48, "num_attention_heads": 32,
}
PUBLISHED = {"DeepSeek-V3": DEEPSEEK_V3, "Qwen3-235B-A22B": QWEN3_235B, "Qwen3-30B-A3B": QWEN3_30B}
