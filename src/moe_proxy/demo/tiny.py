"""Tiny real checkpoints of every supported architecture, made with the transformers model
classes (random weights, save_pretrained): for the demo, the tests and the benchmarks.
No hub access needed."""

from __future__ import annotations

import json
from pathlib import Path

import torch

COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, tie_word_embeddings=False)

# Per architecture: the transformers config class and its tiny settings (moe-formats.md §4.1).
# DeepSeek's multi-head latent attention has as many key/value heads as query heads (as the real
# configs say); fewer makes transformers repeat k/v heads and fail on padded attention masks.
TINY = {
    "mixtral": ("MixtralConfig", dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                                         num_experts_per_tok=2, shared_expert_intermediate_size=48,
                                         mlp_only_layers=[0])),
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=16, intermediate_size=128, moe_intermediate_size=32,
                                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                         mlp_only_layers=[0])),
    "deepseek_v2": ("DeepseekV2Config", dict(num_key_value_heads=4, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
                                             num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=1,
                                             kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
                                             qk_nope_head_dim=8, v_head_dim=16,
                                             topk_method="group_limited_greedy", n_group=2, topk_group=1)),
    "deepseek_v3": ("DeepseekV3Config", dict(num_key_value_heads=4, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
                                             num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                                             n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=32,
                                             qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)),
    "glm4_moe": ("Glm4MoeConfig", dict(head_dim=16, intermediate_size=128, moe_intermediate_size=32,
                                       n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                                       first_k_dense_replace=1, n_group=1, topk_group=1)),
    "olmoe": ("OlmoeConfig", dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                 eos_token_id=2, pad_token_id=1)),
    "gpt_oss": ("GptOssConfig", dict(head_dim=16, intermediate_size=32, num_local_experts=8,
                                     num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"],
                                     sliding_window=16)),
}


# Kimi-K2 (moonshotai/Kimi-K2-Instruct): DeepSeek-V3's architecture, config.json fields and
# tensor names, with model_type "kimi_k2" (transformers has no model of that name; the release
# ships DeepSeek-V3's remote code), one routing group, its own routed scaling, no MTP layer.
KIMI_K2 = dict(model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"],
               auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                         "AutoModel": "modeling_deepseek.DeepseekV3Model",
                         "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
               n_group=1, topk_group=1, topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
               routed_scaling_factor=2.827, moe_layer_freq=1, num_nextn_predict_layers=0)


def make_tiny_kimi_k2(path: str | Path, **kwargs):
    """A tiny Kimi-K2 checkpoint: made with transformers' DeepSeek-V3 classes, saved with Kimi's
    config fields. Returns the model."""
    settings = {k: v for k, v in KIMI_K2.items() if k not in ("model_type", "architectures", "auto_map")}
    model = make_tiny("deepseek_v3", path, **(settings | kwargs))
    config_file = Path(path) / "config.json"
    config_file.write_text(json.dumps(json.loads(config_file.read_text()) | KIMI_K2, indent=2))
    return model


def tiny_config(model_type: str, **overrides):
    import transformers

    cls_name, settings = TINY[model_type]
    return getattr(transformers, cls_name)(**(COMMON | settings | overrides))


def make_tiny(model_type: str, path: str | Path, *, seed: int = 0, dtype: torch.dtype = torch.float32,
              max_shard_size: str | None = None, mtp: bool = False, **overrides):
    """Save a random-weight checkpoint of `model_type` to `path`; returns the model (eval mode)."""
    import transformers

    torch.manual_seed(seed)
    config = tiny_config(model_type, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    # Non-trivial routers and biases: transformers initialises some to zeros, which would
    # make every expert look alike to router-row features.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gate.weight", "router.weight", "router.bias")) and "shared_expert_gate" not in name:
                p.normal_(0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.05)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    _write_tokenizer_files(Path(path))
    if mtp:
        add_mtp_layer(Path(path))
    return model


def _write_tokenizer_files(path: Path) -> None:
    """Minimal tokenizer side files, so copying them into the proxy is exercised."""
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 128, "tokenizer_class": "none"}))
    (path / "special_tokens_map.json").write_text(json.dumps({"eos_token": "</s>"}))


def add_mtp_layer(path: Path) -> None:
    """Append a DeepSeek-V3-style multi-token-prediction layer (index num_hidden_layers) with its
    own router and experts, as the released checkpoints carry (transformers ignores it)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    config = json.loads((path / "config.json").read_text())
    n, h = config["num_hidden_layers"], config["hidden_size"]
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text()) if index_file.exists() else None
    files = sorted(set(index["weight_map"].values())) if index else ["model.safetensors"]
    src, mtp = f"model.layers.{n - 1}.", {}
    for f in files:
        with safe_open(path / f, "pt") as st:
            for k in st.keys():
                if k.startswith(src):
                    mtp[f"model.layers.{n}." + k[len(src):]] = st.get_tensor(k).clone()
    mtp |= {f"model.layers.{n}.enorm.weight": torch.ones(h), f"model.layers.{n}.hnorm.weight": torch.ones(h),
            f"model.layers.{n}.eh_proj.weight": torch.randn(h, 2 * h)}
    if index:
        save_file(mtp, path / "model-mtp.safetensors", metadata={"format": "pt"})
        index["weight_map"] |= {k: "model-mtp.safetensors" for k in mtp}
        index_file.write_text(json.dumps(index, indent=2))
    else:
        with safe_open(path / "model.safetensors", "pt") as st:
            everything = {k: st.get_tensor(k) for k in st.keys()}
        save_file(everything | mtp, path / "model.safetensors", metadata={"format": "pt"})
    config["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(config, indent=2))
