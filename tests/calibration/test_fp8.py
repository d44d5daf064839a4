"""Block-FP8 checkpoints (DeepSeek-V3's release format): calibrate dequantises each expert
weight with its `weight_scale_inv` companion, exactly as a float checkpoint of the same values."""

from __future__ import annotations

import json
import shutil

import torch
from safetensors.torch import load_file, save_file

from moe_proxy.pruning.build import build_proxy
from moe_proxy.calibrate import criteria
from moe_proxy.calibrate import statistics as cal
from moe_proxy.demo.tiny import make_tiny

BLOCK = 16


def quantise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    o, i = w.shape
    blocks = w.float().reshape(o // BLOCK, BLOCK, i // BLOCK, BLOCK)
    s = blocks.abs().amax(dim=(1, 3)) / 448
    return (blocks / s[:, None, :, None]).reshape(o, i).to(torch.float8_e4m3fn), s.contiguous()


def dequantise(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (q.float().reshape(s.shape[0], BLOCK, s.shape[1], BLOCK) * s[:, None, :, None]).reshape(q.shape)


def make_fp8_deepseek(src) -> None:
    """A tiny DeepSeek-V3 (16 experts in 2 routing groups) with block-FP8 experts, as released."""
    make_tiny("deepseek_v3", src, seed=1, n_routed_experts=16, n_group=2, topk_group=2)
    sd = load_file(src / "model.safetensors")
    for k in [k for k in sd if ".experts." in k and k.endswith("proj.weight")]:
        sd[k], sd[k + "_scale_inv"] = quantise(sd[k])
    save_file(sd, src / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [BLOCK, BLOCK]}
    (src / "config.json").write_text(json.dumps(config))


def fp8_builds(tmp_path, samples: int, seq_len: int, **option) -> tuple[dict, dict, dict]:
    """make_fp8_deepseek, calibrated, built plain and with `option` alone (4 experts by saliency):
    (the option's manifest, plain tensors, option's tensors), checked to share names, shapes, dtypes."""
    from .test_heal import tensors

    src = tmp_path / "fp8"
    make_fp8_deepseek(src)
    cal.calibrate(str(src), str(tmp_path / "stats"), samples=samples, seq_len=seq_len)
    common = dict(experts=4, method="saliency", calibration=str(tmp_path / "stats"))
    build_proxy(str(src), str(tmp_path / "plain"), reconstruct=False, **common)
    m = build_proxy(str(src), str(tmp_path / "built"), **common, **{"reconstruct": False, **option})
    a, b = tensors(tmp_path / "plain"), tensors(tmp_path / "built")
    assert a.keys() == b.keys() and all(a[n].shape == b[n].shape and a[n].dtype == b[n].dtype for n in a)
    return m, a, b


def test_fp8_statistics_equal_those_of_the_dequantised_float_checkpoint(tmp_path):
    fp8, ref = tmp_path / "fp8", tmp_path / "ref"
    make_tiny("deepseek_v3", fp8)
    shutil.copytree(fp8, ref)
    sd = load_file(fp8 / "model.safetensors")
    quantised, dequantised = dict(sd), dict(sd)
    for k in [k for k in sd if ".experts." in k and k.endswith("proj.weight")]:
        q, s = quantise(sd[k])
        quantised[k], quantised[k + "_scale_inv"] = q, s
        dequantised[k] = dequantise(q, s)
    save_file(quantised, fp8 / "model.safetensors", metadata={"format": "pt"})
    save_file(dequantised, ref / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [BLOCK, BLOCK]}
    (fp8 / "config.json").write_text(json.dumps(config))

    a = cal.calibrate(str(fp8), str(tmp_path / "sa"), samples=4, seq_len=16)
    b = cal.calibrate(str(ref), str(tmp_path / "sb"), samples=4, seq_len=16)
    assert a["layers"] == b["layers"]
    sa, sb = cal.load(str(tmp_path / "sa")), cal.load(str(tmp_path / "sb"))
    for prefix in sa.layers:
        for name in criteria.LayerStats.NAMES:
            assert torch.equal(getattr(sa.layers[prefix], name), getattr(sb.layers[prefix], name)), (prefix, name)
