"""A model-driven fp16 overflow: experts whose outputs exceed fp16's range (65504), as a super
expert's massive activation does. fp32 runs it fine; fp16 (even with loss scaling, which only
protects gradients) overflows in the forward pass, and the detector calls it an overflow."""

import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_proxy.metrics.detect import FailureDetector
from moe_proxy.rl.config import ReproConfig
from moe_proxy.rl.runner import run_repro
from moe_proxy.metrics.readers import read_metrics

FP16_MAX = 65504.0


@pytest.fixture(scope="module")
def massive(tiny_qwen3, tmp_path_factory):
    """The tiny model with layer 1's expert outputs scaled far past fp16's range."""
    path = tmp_path_factory.mktemp("massive") / "ckpt"
    shutil.copytree(tiny_qwen3, path)
    tensors = load_file(path / "model.safetensors")
    for name in tensors:
        if name.startswith("model.layers.1.mlp.experts.") and name.endswith("down_proj.weight"):
            tensors[name] = tensors[name] * 1e9
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_fp32_carries_the_massive_activation(massive, tmp_path):
    result = run_repro(str(massive), tmp_path, ReproConfig(steps=2, lr=1e-4))
    rows = read_metrics(tmp_path)
    assert result.failures == {}
    assert min(m["numerics/max_activation"] for m in rows.values()) > FP16_MAX
    assert all(m["numerics/nonfinite_activations"] == 0 for m in rows.values())


def test_fp16_overflows_in_the_forward_pass_despite_loss_scaling(massive, tmp_path):
    result = run_repro(str(massive), tmp_path, ReproConfig(steps=3, lr=1e-4, precision="fp16"))
    assert result.failures["overflow"]["step"] == 0
    assert "forward overflow" in result.failures["overflow"]["detail"]
    assert read_metrics(tmp_path)[0]["numerics/nonfinite_activations"] > 0


def test_unmodified_model_has_no_inf_activations_in_fp16(tiny_qwen3, tmp_path):
    run_repro(str(tiny_qwen3), tmp_path, ReproConfig(steps=2, lr=1e-4, precision="fp16"))
    assert all(m["numerics/nonfinite_activations"] == 0 for m in read_metrics(tmp_path).values())


def test_detector_nonfinite_half_precision_activations_are_an_overflow_besides_the_nan():
    half = {"numerics/half_precision": 1.0, "numerics/loss_scale": 65536.0}
    detector = FailureDetector()
    detector.update(0, {"actor/pg_loss": 0.1, "numerics/nonfinite_activations": 0.0, **half})
    detector.update(1, {"actor/pg_loss": math.nan, "numerics/nonfinite_activations": 12.0, **half})
    assert {k: v.step for k, v in detector.onsets.items()} == {"overflow": 1, "nan": 1}


def test_nonfinite_activations_in_fp32_are_a_nan_not_an_overflow():
    detector = FailureDetector()
    detector.update(0, {"actor/pg_loss": math.nan, "numerics/nonfinite_activations": 5.0,
                        "numerics/half_precision": 0.0})
    assert set(detector.onsets) == {"nan"}


def test_mean_max_load_share_is_reported(tiny_qwen3, tmp_path):
    run_repro(str(tiny_qwen3), tmp_path, ReproConfig(steps=1))
    row = read_metrics(tmp_path)[0]
    layers = [v for k, v in row.items() if k.startswith("moe/load_max_share/layer_")]
    assert row["moe/load_max_share/mean"] == pytest.approx(sum(layers) / len(layers))
    assert row["moe/load_max_share/mean"] <= row["moe/load_max_share"]


def test_planted_weights_really_changed(massive, tiny_qwen3):
    a = load_file(tiny_qwen3 / "model.safetensors")["model.layers.1.mlp.experts.0.down_proj.weight"]
    b = load_file(massive / "model.safetensors")["model.layers.1.mlp.experts.0.down_proj.weight"]
    assert torch.allclose(b, a * 1e9)


def test_router_rows_without_gradient_are_not_underflow(tiny_qwen3):
    """An expert no token chose gets no router gradient (renormalised top-k): exact zeros there
    are not fp16 flushing; zeros in a dense weight are."""
    from moe_proxy.rl.distributed import Comm
    from moe_proxy.rl.runner import _Loop

    loop = _Loop(tiny_qwen3, ReproConfig(steps=1), Comm())
    for p in loop.params:
        p.grad = torch.ones_like(p)
    router = loop.tap.routers[0].module.weight
    router.grad[0] = 0.0  # expert 0 unchosen in this batch
    assert loop._grad_stats()["numerics/dense_grad_zero_frac"] == 0
    attention = next(p for p in loop.params if "self_attn.q_proj" in loop.names[id(p)])
    attention.grad[0, 0] = 0.0
    assert loop._grad_stats()["numerics/dense_grad_zero_frac"] > 0
