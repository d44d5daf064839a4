"""Layer by layer, hidden states and routing are exactly the full transformers model's."""

from __future__ import annotations

import pytest
import torch
import transformers

from moe_proxy.checkpoint.reader import open_checkpoint
from moe_proxy.layerwise.model import LayerwiseModel, moe_modules, run_layer

ALL = ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "qwen2_moe", "deepseek_v2", "glm4_moe", "olmoe"]


def record(layers, outputs: dict, routes: dict) -> list:
    """Hooks that record each decoder layer's output and the routing its MoE block used."""
    hooks = []
    for i, layer in layers:
        hooks.append(layer.register_forward_hook(
            lambda m, a, o, i=i: outputs.__setitem__(i, o[0] if isinstance(o, tuple) else o)))
        mods = moe_modules(layer)
        if mods is not None:
            hooks.append(mods.experts.register_forward_pre_hook(
                lambda m, a, i=i: routes.setdefault(i, (a[1].clone(), a[2].clone())) and None))
    return hooks


@pytest.mark.parametrize("model_type", ALL)
def test_layerwise_equals_full_model(tiny, model_type):
    path = tiny(model_type)
    full = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(5))
    want_out, want_route = {}, {}
    hooks = record(enumerate(full.model.layers), want_out, want_route)
    with torch.no_grad():
        full(ids)
    for h in hooks:
        h.remove()

    lw = LayerwiseModel(open_checkpoint(str(path)))
    assert lw.n_layers == full.config.num_hidden_layers  # DeepSeek-V3's MTP layer is not a decoder layer
    hidden, extras = lw.layer_inputs(ids)
    got_route: dict = {}
    for i in range(lw.n_layers):
        with lw.layer(i) as layer:
            hooks = record([], {}, {})  # nothing on the layer itself
            mods = moe_modules(layer)
            if mods is not None:
                hooks.append(mods.experts.register_forward_pre_hook(
                    lambda m, a, i=i: got_route.setdefault(i, (a[1].clone(), a[2].clone())) and None))
            hidden = run_layer(layer, hidden, extras[i])
            for h in hooks:
                h.remove()
        assert torch.equal(hidden, want_out[i]), f"layer {i}: hidden states differ"
        # Freed after use: only one layer is ever materialised.
        assert all(p.is_meta for p in lw.layers[i].parameters())
    assert set(got_route) == set(want_route) and got_route
    for i, (idx, w) in want_route.items():
        assert torch.equal(got_route[i][0], idx) and torch.equal(got_route[i][1], w), f"layer {i}: routing differs"
    if model_type == "deepseek_v3":
        assert 0 not in want_route  # the dense first layer has no routing, and is run all the same
