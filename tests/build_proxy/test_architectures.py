"""Every supported architecture: a tiny real checkpoint is pruned, the proxy loads in
transformers with no missing/unexpected/mismatched keys, and computes exactly what the
original computes with its routers restricted to the kept experts."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from moe_proxy.pruning.build import build_proxy
from moe_proxy.checkpoint.reader import open_checkpoint

from .conftest import ARCHS
from .equivalence import restricted


def load(path):
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    # transformers skips only DeepSeek-V3's full-size MTP index (61); the tiny one sits at 2.
    mtp = f"model.layers.{model.config.num_hidden_layers}."
    info["unexpected_keys"] = {k for k in info["unexpected_keys"] if not k.startswith(mtp)}
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def inputs():
    return torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("model_type", ARCHS)
def test_proxy_computes_the_restricted_original(model_type, tiny_checkpoints, tmp_path):
    src = tiny_checkpoints[model_type]
    manifest = build_proxy(str(src), str(tmp_path / "proxy"), experts=4)
    kept = {v["layer"]: v["kept"] for v in manifest["layers"].values()}
    assert all(len(k) == 4 and k == sorted(k) for k in kept.values())

    original, proxy = load(src), load(tmp_path / "proxy")
    x = inputs()
    with torch.no_grad(), restricted(original, kept):
        want = original(x).logits
    with torch.no_grad():
        got = proxy(x).logits
        unrestricted = original(x).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, unrestricted, atol=1e-4), "pruning should change something"


@pytest.mark.parametrize("model_type", ARCHS)
def test_keeping_all_experts_reproduces_logits_exactly(model_type, tiny_checkpoints, tmp_path):
    src = tiny_checkpoints[model_type]
    build_proxy(str(src), str(tmp_path / "proxy"), experts=8)
    x = inputs()
    with torch.no_grad():
        assert torch.equal(load(src)(x).logits, load(tmp_path / "proxy")(x).logits)


@pytest.mark.parametrize("model_type", ARCHS)
def test_output_layout(model_type, tiny_checkpoints, tmp_path):
    """Backbone bytes identical; router/expert tensors sliced to the kept experts, same dtype;
    config counts updated; tokenizer files copied; manifest hashes every file."""
    src = tiny_checkpoints[model_type]
    dst = tmp_path / "proxy"
    m = build_proxy(str(src), str(dst), experts=4)
    before, after = open_checkpoint(str(src)), open_checkpoint(str(dst))
    router_leaves = (".gate.weight", ".router.weight", ".router.bias", ".gate.e_score_correction_bias")
    expert_like = [n for n in before.tensors if ".experts." in n or
                   (n.endswith(router_leaves) and any(n.startswith(p + ".") and n.count(".") == p.count(".") + 2
                                                      for p in m["layers"]))]
    for name, t in before.tensors.items():
        if name in expert_like:
            continue
        assert before.read(name) == after.read(name), name
        assert after.tensors[name].dtype == t.dtype
    for prefix, layer in m["layers"].items():
        kept = layer["kept"]
        for name in [n for n in before.tensors if n.startswith(prefix + ".")]:
            t = before.tensors[name]
            if ".experts." not in name and name not in expert_like:
                continue
            with safe_open(t_path(src, before, name), "pt") as f:
                orig = f.get_tensor(name)
            if ".experts." in name and name.split(".experts.")[1].split(".")[0].isdigit():
                e = int(name.split(".experts.")[1].split(".")[0])
                if e not in kept:
                    continue
                new = name.replace(f".experts.{e}.", f".experts.{kept.index(e)}.")
                assert after.read(new) == before.read(name)
            else:
                with safe_open(t_path(dst, after, name), "pt") as f:
                    got = f.get_tensor(name)
                axis = 0 if orig.shape[0] == 8 else orig.dim() - 1
                assert torch.equal(got, orig.index_select(axis, torch.tensor(kept)))
                assert got.dtype == orig.dtype
    config = json.loads((dst / "config.json").read_text())
    src_config = json.loads((src / "config.json").read_text())
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if key in src_config:
            assert config[key] == 4
    assert {k: v for k, v in config.items() if k not in ("num_local_experts", "num_experts", "n_routed_experts")} == \
        {k: v for k, v in src_config.items() if k not in ("num_local_experts", "num_experts", "n_routed_experts")}
    assert (dst / "tokenizer_config.json").read_bytes() == (src / "tokenizer_config.json").read_bytes()
    assert set(m["files"]) == {p.name for p in dst.iterdir() if p.name != "proxy-manifest.json"}
    assert m["params"]["total_after"] < m["params"]["total_before"]
    assert m["params"]["total_after"] == sum(t.numel for t in after.tensors.values())


def t_path(root, ckpt, name):
    return root / ckpt.tensors[name].file


def test_deepseek_v3_mtp_layer_is_pruned_like_the_others(tiny_checkpoints, tmp_path):
    src = tiny_checkpoints["deepseek_v3"]
    m = build_proxy(str(src), str(tmp_path / "proxy"), experts=4)
    layers = {v["layer"] for v in m["layers"].values()}
    assert 2 in layers  # num_hidden_layers == 2: the MTP layer
    after = open_checkpoint(str(tmp_path / "proxy"))
    assert after.tensors["model.layers.2.mlp.gate.weight"].shape[0] == 4
    assert after.tensors["model.layers.2.mlp.gate.e_score_correction_bias"].shape == (4,)
    mtp_experts = {n.split(".experts.")[1].split(".")[0] for n in after.tensors if n.startswith("model.layers.2.mlp.experts.")}
    assert mtp_experts == {"0", "1", "2", "3"}
    assert "model.layers.2.eh_proj.weight" in after.tensors
