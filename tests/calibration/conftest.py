"""Tiny real checkpoints for the calibration tests, some with planted experts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from moe_proxy.demo.tiny import add_mtp_layer, make_tiny, tiny_config


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """Sharded tiny checkpoints; DeepSeek-V3 with a dense first layer and its MTP layer."""
    root = tmp_path_factory.mktemp("cal-tiny")
    cache: dict[str, Path] = {}

    def get(model_type: str) -> Path:
        if model_type not in cache:
            path = root / model_type
            make_tiny(model_type, path, max_shard_size="100KB", mtp=model_type == "deepseek_v3")
            cache[model_type] = path
        return cache[model_type]

    return get


def save_model(model, path: Path, mtp: bool = False) -> Path:
    model.save_pretrained(path, max_shard_size="200KB")
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "none"}))
    if mtp:
        add_mtp_layer(path)
    return path


DEAD = (1, 9)  # never routed: correction bias -10
SUPER = 12  # rarely routed, with a massive down_proj output
PLANTED_SUPER_SCALE = 300.0


@pytest.fixture(scope="session")
def planted(tmp_path_factory) -> Path:
    """DeepSeek-V3, 16 experts in 2 routing groups, top-2: dead experts 1 and 9, and expert 12
    a rarely routed super expert (its down_proj scaled up 300x, its correction bias lowered)."""
    torch.manual_seed(0)
    config = tiny_config("deepseek_v3", n_routed_experts=16, n_group=2, topk_group=2, num_experts_per_tok=2)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        mlp = model.model.layers[1].mlp
        mlp.gate.weight.normal_(0, 0.5)
        mlp.gate.e_score_correction_bias.zero_()
        for e in DEAD:
            mlp.gate.e_score_correction_bias[e] = -10.0
        mlp.gate.e_score_correction_bias[SUPER] = -0.35
        mlp.experts.down_proj[SUPER] *= PLANTED_SUPER_SCALE
    return save_model(model, tmp_path_factory.mktemp("planted") / "ds", mtp=True)


FAMILIES = 4  # groups of near-duplicate experts (in output) in the `duplicates` checkpoint


@pytest.fixture(scope="session")
def duplicates(tmp_path_factory) -> Path:
    """Qwen3-MoE, 16 experts: 4 families of 4 near-copies (expert e belongs to family e % 4);
    the router rows stay random, so only the experts' outputs reveal the families."""
    torch.manual_seed(1)
    config = tiny_config("qwen3_moe", num_experts=16, num_experts_per_tok=2)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        experts = model.model.layers[1].mlp.experts
        model.model.layers[1].mlp.gate.weight.normal_(0, 0.5)
        for e in range(FAMILIES, 16):
            base = e % FAMILIES
            for p in (experts.gate_up_proj, experts.down_proj):
                p[e] = p[base] * (1 + 0.01 * torch.randn_like(p[base]))
    return save_model(model, tmp_path_factory.mktemp("dups") / "qwen3")
