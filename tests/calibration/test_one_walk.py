"""One walk per calibrated build (issue 42 item 4): the fit (heal, merge, reconstruct) and the
fidelity figure share one walk of the decoder layers, each source layer loaded once, and the
figure measured in that walk is the figure of the proxy as written, measured apart."""

from __future__ import annotations

from collections import Counter

import pytest

from moe_proxy.calibrate import statistics as cal
from moe_proxy.architectures import detect
from moe_proxy.checkpoint.layout import find_layout
from moe_proxy.checkpoint.reader import open_checkpoint
from moe_proxy.demo.tiny import make_tiny
from moe_proxy.layerwise.driver import walk
from moe_proxy.layerwise.model import LayerwiseModel
from moe_proxy.pruning import fidelity
from moe_proxy.pruning import reconstruct as rec
from moe_proxy.pruning.build import build_proxy

OPTIONS = {  # a calibrated build's fits
    "reconstruct": {},
    "heal": {"heal": True},
    "merge": {"merge": True, "reconstruct": False},
    "merge-reconstruct": {"merge": True, "reconstruct": True},
}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """Qwen3-MoE, 16 experts, three MoE layers, and its one-pass statistics."""
    root = tmp_path_factory.mktemp("one-walk")
    make_tiny("qwen3_moe", root / "src", seed=3, num_experts=16, num_experts_per_tok=2, num_hidden_layers=3,
              mlp_only_layers=[])
    cal.calibrate(str(root / "src"), str(root / "stats"), samples=16, seq_len=32)
    return root


@pytest.fixture
def loads(monkeypatch) -> Counter:
    """(model's checkpoint uri, layer index) -> how often that layer was loaded."""
    counted: Counter = Counter()
    layer = LayerwiseModel.layer

    def counting(self, index):
        counted[(self.ckpt.uri, index)] += 1
        return layer(self, index)

    monkeypatch.setattr(LayerwiseModel, "layer", counting)
    monkeypatch.setattr(rec, "RECON_STEPS", 20)
    monkeypatch.setattr(rec, "RECON_PATIENCE", 5)
    return counted


@pytest.mark.parametrize("name", OPTIONS)
def test_a_calibrated_build_loads_each_layer_once_and_its_figure_is_the_written_proxys(source, tmp_path, loads, name):
    manifest = build_proxy(str(source / "src"), str(tmp_path / "proxy"), experts=2, method="saliency",
                           calibration=str(source / "stats"), **OPTIONS[name])
    assert manifest["method"]["reconstruct"] == ("reconstruct" in name)
    src = open_checkpoint(str(source / "src"))
    assert {i: n for (uri, i), n in loads.items() if uri == src.uri} == {i: 1 for i in range(3)}

    # The figure again, apart: the proxy as written (read back from its files) against the source.
    stats = cal.load(str(source / "stats"))
    ids, _ = fidelity.held_out(stats.token_ids)
    written = open_checkpoint(str(tmp_path / "proxy"))
    found = walk(src, find_layout(src, detect(src.config)), fidelity.FidelityPass([written], ids), ids)
    assert fidelity.figures(found, stats)[0] == manifest["fidelity"]
