"""Proxy-aware (sequential) calibration: each MoE layer scored behind the proxy's already-pruned
earlier layers; the artifact says so, and builds for another proxy are refused."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from moe_proxy.options import PruningOptions
from moe_proxy.pruning.build import build_proxy
from moe_proxy.calibrate import statistics as cal
from moe_proxy.cli import main
from moe_proxy.demo.tiny import make_tiny

TARGET = dict(experts=4, method="saliency")


@pytest.fixture(scope="module")
def three_moe(tmp_path_factory):
    """Qwen3-MoE, 3 MoE layers of 16 experts (top-2), one-pass and sequential statistics."""
    root = tmp_path_factory.mktemp("seq")
    make_tiny("qwen3_moe", root / "src", seed=3, num_experts=16, num_experts_per_tok=2, num_hidden_layers=3,
              mlp_only_layers=[])
    one = cal.calibrate(str(root / "src"), str(root / "one"), samples=8, seq_len=16)
    seq = cal.calibrate(str(root / "src"), str(root / "seq"), samples=8, seq_len=16,
                        sequential=PruningOptions(**TARGET))
    return root, one, seq


def test_sequential_statistics_differ_after_pruned_layers_and_equal_at_layer_0(three_moe):
    root, one, seq = three_moe
    assert one["mode"] == "one-pass" and "made_for" not in one
    assert seq["mode"] == "sequential"
    assert seq["made_for"] == {"experts": 4, "top_k": 2, "method": "saliency", "keep_super": True}
    assert all(len(layer["kept"]) == 4 for layer in seq["layers"].values())
    a, b = cal.load(str(root / "one")), cal.load(str(root / "seq"))
    assert b.mode == "sequential" and a.mode == "one-pass"
    for name in cal.LayerStats.NAMES:  # layer 0 sees the same hidden states in both modes
        assert torch.equal(getattr(a.layers["model.layers.0.mlp"], name), getattr(b.layers["model.layers.0.mlp"], name))
    for prefix in ("model.layers.1.mlp", "model.layers.2.mlp"):
        assert not torch.allclose(a.layers[prefix].saliency, b.layers[prefix].saliency), prefix


def test_sequential_statistics_are_those_of_the_proxy(three_moe):
    """Independently of the layer-by-layer machinery: the original in transformers with its
    layer 0 MoE block replaced by the proxy's (built from the sequential statistics) routes
    layer 1's tokens with exactly the gate mass the statistics recorded."""
    root, _, seq = three_moe
    # the plain selection: the statistics were made behind it (reconstruction would change layer 0)
    build_proxy(str(root / "src"), str(root / "proxy"), calibration=str(root / "seq"), reconstruct=False, **TARGET)
    manifest = json.loads((root / "proxy" / "proxy-manifest.json").read_text())
    assert manifest["calibration"]["mode"] == "sequential"
    assert {p: layer["kept"] for p, layer in manifest["layers"].items()} == \
        {p: layer["kept"] for p, layer in seq["layers"].items()}
    original = transformers.AutoModelForCausalLM.from_pretrained(root / "src", dtype=torch.float32).eval()
    proxy = transformers.AutoModelForCausalLM.from_pretrained(root / "proxy", dtype=torch.float32).eval()
    mass = torch.zeros(16, dtype=torch.float64)

    def count(module, args) -> None:
        index, weights = args[1], args[2]
        mass.index_add_(0, index.reshape(-1), weights.reshape(-1).double())

    original.model.layers[0].mlp = proxy.model.layers[0].mlp
    original.model.layers[1].mlp.experts.register_forward_pre_hook(count)
    with torch.no_grad():
        original(cal.load(str(root / "seq")).token_ids)
    stats = cal.load(str(root / "seq")).layers["model.layers.1.mlp"]
    torch.testing.assert_close(mass, stats.gate_mass, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(cal.load(str(root / "one")).layers["model.layers.1.mlp"].gate_mass, mass, rtol=1e-3)


@pytest.mark.parametrize("options,why", [
    (dict(experts=8, method="saliency"), "experts 4"),
    (dict(experts=4, method="frequency"), "method 'saliency'"),
])
def test_build_refuses_sequential_statistics_of_another_proxy(three_moe, tmp_path, options, why):
    root, _, _ = three_moe
    with pytest.raises(cal.CalibrationError, match="sequential") as err:
        build_proxy(str(root / "src"), str(tmp_path / "p"), calibration=str(root / "seq"), **options)
    assert why in str(err.value) and "--one-pass" in str(err.value)  # the remedies: this proxy's statistics, or one-pass
    assert not (tmp_path / "p" / "proxy-manifest.json").exists()
    # One-pass statistics serve any build.
    build_proxy(str(root / "src"), str(tmp_path / "q"), calibration=str(root / "one"), reconstruct=False, **options)


def test_a_smaller_top_k_gets_its_statistics_from_the_command_the_refusal_names(three_moe, tmp_path, capsys):
    """`build --top-k` changes the proxy the sequential statistics were scored behind: the build refuses
    the default's statistics and names the calibrate command for its own, which takes --top-k (the
    operator and bisect pass it alike, options.SELECTION). That command, run as printed, makes
    statistics the build accepts."""
    import re
    import shlex

    root, _, _ = three_moe
    build = ["build", str(root / "src"), str(tmp_path / "p"), "--experts", "4", "--method", "saliency",
             "--top-k", "1", "--calibration"]
    assert main(build + [str(root / "seq")]) == 2
    err = capsys.readouterr().err
    assert "top_k 2 (this build: 1)" in err
    named = re.search(r"run (moe-proxy calibrate SRC --out STATS [^;]*?) for this proxy", err).group(1)
    assert "--top-k 1" in named
    stats = tmp_path / "s1"
    argv = shlex.split(named)[1:]
    argv[argv.index("SRC")], argv[argv.index("STATS")] = str(root / "src"), str(stats)
    assert main(argv + ["--samples", "8", "--seq-len", "16", "--no-progress"]) == 0
    assert json.loads((stats / cal.SUMMARY).read_text())["made_for"]["top_k"] == 1
    assert main(build + [str(stats)]) == 0
    assert json.loads((tmp_path / "p" / "config.json").read_text())["num_experts_per_tok"] == 1


def test_cli_sequential_and_mode_change_recomputes(three_moe, tmp_path, capsys):
    root, _, seq = three_moe
    out = str(tmp_path / "s")
    args = ["calibrate", str(root / "src"), "--out", out, "--samples", "8", "--seq-len", "16", "--no-progress"]
    assert main(args + ["--sequential", "--experts", "4", "--method", "saliency"]) == 0
    assert "mode    sequential (made for experts=4" in capsys.readouterr().out
    assert json.loads((tmp_path / "s" / cal.SUMMARY).read_text())["layers"] == seq["layers"]
    assert main(args + ["--sequential", "--experts", "4", "--method", "saliency"]) == 0
    assert "up to date" in capsys.readouterr().out
    assert main(args) == 0  # another mode: computed again, not reused
    printed = capsys.readouterr().out
    assert "up to date" not in printed and "mode    one-pass" in printed
    assert main(args + ["--sequential"]) == 2
    assert "--sequential needs --experts" in capsys.readouterr().err
