"""The layer-pass driver (layerwise.driver.walk): which layers a pass sees, which are loaded,
and the hidden states carried through the layers a pass does not visit; several passes in one
walk (walk_all)."""

from __future__ import annotations

import torch

from moe_proxy.architectures import detect
from moe_proxy.checkpoint.layout import find_layout
from moe_proxy.checkpoint.reader import open_checkpoint
from moe_proxy.layerwise.driver import Layer, LayerPass, walk, walk_all
from moe_proxy.layerwise.model import LayerwiseModel


class Seen(LayerPass[list]):
    """Records the layers it visits and carries the hidden states through them."""

    def __init__(self, dense: bool = False, layers: set[int] | None = None):
        self.dense, self.layers, self.seen = dense, layers, []

    def visits(self, block) -> bool:
        return self.layers is None or block.layer in self.layers

    def begin(self, model, states) -> None:
        self.states = states

    def visit(self, layer: Layer) -> None:
        self.seen.append((layer.index, layer.block.prefix if layer.block else None, layer.moe is not None))
        if layer.states is not None:
            layer.states.advance(layer.module, layer.index)

    def result(self) -> list:
        return self.seen


def opened(tiny):
    """DeepSeek-V3: a dense first layer, then MoE layers, and an MTP layer that is not walked."""
    ckpt = open_checkpoint(str(tiny("deepseek_v3")))
    layout = find_layout(ckpt, detect(ckpt.config))
    moe = [b.layer for b in layout.blocks if b.layer < ckpt.config["num_hidden_layers"]]
    assert moe and 0 not in moe and len(moe) < len(layout.blocks)
    return ckpt, layout, moe


def test_without_hidden_states_only_the_visited_moe_layers_load(tiny, monkeypatch):
    ckpt, layout, moe = opened(tiny)
    loaded = []
    real = LayerwiseModel.layer
    monkeypatch.setattr(LayerwiseModel, "layer", lambda self, i: loaded.append(i) or real(self, i))
    assert walk(ckpt, layout, Seen()) == [(i, f"model.layers.{i}.mlp", True) for i in moe]
    assert loaded == moe
    loaded.clear()
    assert walk(ckpt, layout, Seen(layers={moe[-1]})) == [(moe[-1], f"model.layers.{moe[-1]}.mlp", True)]
    assert loaded == [moe[-1]]


def test_the_driver_carries_the_hidden_states_as_a_pass_does(tiny):
    ckpt, layout, moe = opened(tiny)
    ids = torch.randint(0, 256, (3, 12), generator=torch.Generator().manual_seed(2))
    every, none = Seen(dense=True), Seen(layers=set())
    assert [i for i, _, _ in walk(ckpt, layout, every, ids, batch_size=2)] == list(range(ckpt.config["num_hidden_layers"]))
    assert every.seen[0] == (0, None, False)  # the dense layer, visited because the pass is dense
    assert walk(ckpt, layout, none, ids, batch_size=2) == []
    assert len(every.states.hidden) == 2  # batches of 2 sequences
    for a, b in zip(every.states.hidden, none.states.hidden):
        assert torch.equal(a, b)


def test_passes_in_one_walk_share_each_loaded_layer_and_keep_their_own_states(tiny, monkeypatch):
    ckpt, layout, moe = opened(tiny)
    loaded, order = [], []
    real = LayerwiseModel.layer
    monkeypatch.setattr(LayerwiseModel, "layer", lambda self, i: loaded.append(i) or real(self, i))
    ids = torch.randint(0, 256, (3, 12), generator=torch.Generator().manual_seed(2))

    class Ordered(Seen):
        def visit(self, layer: Layer) -> None:
            order.append((layer.index, self.name))
            super().visit(layer)

    fit, measure = Ordered(layers={moe[-1]}), Ordered(dense=True)
    fit.name, measure.name = "fit", "measure"
    found = walk_all(ckpt, layout, [(fit, None), (measure, ids[:2])], batch_size=2)
    n = ckpt.config["num_hidden_layers"]
    assert found == [fit.seen, measure.seen] and [i for i, _, _ in measure.seen] == list(range(n))
    assert loaded == list(range(n))  # each layer once, though the walk of `fit` alone loads one
    assert order.index((moe[-1], "fit")) + 1 == order.index((moe[-1], "measure"))  # fit first, in the same visit
    alone = Seen(dense=True)
    walk(ckpt, layout, alone, ids[:2], batch_size=2)  # the same states as in a walk of its own
    assert all(torch.equal(a, b) for a, b in zip(measure.states.hidden, alone.states.hidden))
