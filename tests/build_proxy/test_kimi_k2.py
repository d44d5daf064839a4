"""Kimi-K2 end to end: build, verify (with its transformers forward pass), calibrate, a
calibrated and healed build, and repro, on a tiny checkpoint made with transformers'
DeepSeek-V3 classes and saved with Kimi-K2's config.json fields (model_type "kimi_k2")."""

import json

import pytest
import torch
import transformers

from moe_proxy.pruning import heal
from moe_proxy.pruning.build import build_proxy
from moe_proxy.calibrate.statistics import calibrate
from moe_proxy.layerwise.load import load_causal_lm
from moe_proxy.rl.config import ReproConfig
from moe_proxy.metrics.readers import read_metrics
from moe_proxy.rl.runner import run_repro
from moe_proxy.demo.tiny import make_tiny_kimi_k2
from moe_proxy.pruning.verify import verify


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi") / "src"
    model = make_tiny_kimi_k2(path, max_shard_size="100KB")
    return path, model


def test_transformers_alone_cannot_load_it(kimi):
    """Why moe-proxy maps kimi_k2 to DeepSeek-V3's classes: transformers knows no such model."""
    with pytest.raises(Exception, match="kimi_k2|trust_remote_code"):
        transformers.AutoModelForCausalLM.from_pretrained(kimi[0])


def test_loads_as_deepseek_v3_with_every_weight(kimi):
    path, model = kimi
    loaded, info = load_causal_lm(str(path), output_loading_info=True)
    assert type(loaded).__name__ == "DeepseekV3ForCausalLM"
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"])
    assert loaded.config.n_group == 1 and loaded.config.routed_scaling_factor == 2.827
    x = torch.arange(16).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(loaded.eval()(x).logits, model(x).logits)


def test_build_verify_calibrate_heal_repro(kimi, tmp_path, monkeypatch):
    path, _ = kimi
    m = build_proxy(str(path), str(tmp_path / "proxy"), experts=4)
    assert m["source"]["architecture"] == "DeepSeek-V3" and m["source"]["model_type"] == "kimi_k2"
    config = json.loads((tmp_path / "proxy" / "config.json").read_text())
    assert config["model_type"] == "kimi_k2" and config["n_routed_experts"] == 4 and config["n_group"] == 1
    report = verify(str(tmp_path / "proxy"))
    assert report.ok and report.forward.startswith("ok"), report.problems

    summary = calibrate(str(path), str(tmp_path / "stats"), samples=4, seq_len=16)
    assert summary["tokens"]["random"]  # the tiny checkpoint ships no tokenizer
    monkeypatch.setattr(heal, "HEAL_STEPS", 5)  # the fit itself is tested in tests/calibration; here: it runs
    healed = build_proxy(str(path), str(tmp_path / "healed"), experts=4, method="saliency",
                         calibration=str(tmp_path / "stats"), heal=True)
    assert healed["method"]["heal"] and verify(str(tmp_path / "healed")).ok

    run_repro(str(tmp_path / "healed"), tmp_path / "run", ReproConfig(steps=1, batch_size=2, mini_batches=1))
    metrics = read_metrics(tmp_path / "run")[0]
    assert "moe/router_entropy/layer_1" in metrics and metrics["actor/grad_norm"] > 0
