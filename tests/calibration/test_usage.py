"""`build --calibration`: usage-aware selection on planted checkpoints (the plain selection:
reconstruction, on by default, keeps the same experts and is tested in test_reconstruct.py)."""

from __future__ import annotations

import json

import pytest
import torch

from moe_proxy.calibrate import statistics as cal
from moe_proxy.pruning.build import build_proxy
from moe_proxy.cli import main
from moe_proxy.errors import InvalidExpertCount

from .conftest import DEAD, FAMILIES, SUPER


@pytest.fixture(scope="module")
def planted_stats(planted, tmp_path_factory):
    out = tmp_path_factory.mktemp("planted-stats")
    cal.calibrate(str(planted), str(out), samples=16, seq_len=32)
    return out


@pytest.fixture(scope="module")
def duplicate_stats(duplicates, tmp_path_factory):
    out = tmp_path_factory.mktemp("dup-stats")
    cal.calibrate(str(duplicates), str(out), samples=16, seq_len=32)
    return out


def test_planted_super_expert_is_rare_but_not_dead(planted_stats):
    s = cal.load(str(planted_stats)).layers["model.layers.1.mlp"]
    assert 0 < s.tokens[SUPER] < s.tokens.mean() / 2
    assert all(s.tokens[e] == 0 for e in DEAD)


@pytest.mark.parametrize("method,features", [("frequency", "router"), ("saliency", "router"),
                                             ("cluster", "router"), ("cluster", "output"),
                                             ("cluster", "routing"), ("cluster", "weights")])
def test_dead_never_kept_super_always_kept(planted, planted_stats, tmp_path, method, features):
    m = build_proxy(str(planted), str(tmp_path / "p"), experts=8, method=method, features=features,
                    calibration=str(planted_stats), reconstruct=False)
    layer = m["layers"]["model.layers.1.mlp"]
    assert not set(DEAD) & set(layer["kept"])
    assert SUPER in layer["kept"] and layer["super"] == [SUPER]
    assert [k // 8 for k in layer["kept"]].count(0) == 4  # 4 per routing group
    assert layer["dead"] == list(DEAD)
    assert 0 < layer["gate_mass_kept"] <= 1
    assert m["calibration"]["tokens"]["samples"] == 16 and m["calibration"]["super"] == {"model.layers.1.mlp": [SUPER]}
    # The MTP layer has no statistics: selected without them, and the manifest says so.
    assert any("model.layers.2.mlp" in note for note in m["notes"])


def test_no_keep_super_drops_the_rare_super_expert(planted, planted_stats, tmp_path):
    m = build_proxy(str(planted), str(tmp_path / "p"), experts=8, method="frequency",
                    calibration=str(planted_stats), reconstruct=False, keep_super=False)
    layer = m["layers"]["model.layers.1.mlp"]
    assert SUPER not in layer["kept"] and layer["super_dropped"] == [SUPER]


def test_frequency_keeps_most_gate_mass_per_group(planted, planted_stats, tmp_path):
    s = cal.load(str(planted_stats)).layers["model.layers.1.mlp"]
    m = build_proxy(str(planted), str(tmp_path / "p"), experts=8, method="frequency",
                    calibration=str(planted_stats), reconstruct=False, keep_super=False)
    kept = m["layers"]["model.layers.1.mlp"]["kept"]
    for g in range(2):
        members = range(8 * g, 8 * g + 8)
        want = sorted(sorted(members, key=lambda e: -float(s.gate_mass[e]))[:4])
        assert [e for e in kept if e in members] == want
    share = float(s.share[kept].sum())
    assert m["layers"]["model.layers.1.mlp"]["gate_mass_kept"] == pytest.approx(share, abs=1e-6)


def test_output_features_recover_near_duplicates(duplicates, duplicate_stats, tmp_path):
    # keep_super off: REAP's rule flags the model's largest output (above the 99.5th percentile of
    # a few dozen experts), which would be pinned in place of its family's most salient member
    m = build_proxy(str(duplicates), str(tmp_path / "p"), experts=FAMILIES, features="output",
                    calibration=str(duplicate_stats), reconstruct=False, keep_super=False)
    kept = m["layers"]["model.layers.1.mlp"]["kept"]
    assert sorted(e % FAMILIES for e in kept) == list(range(FAMILIES)), kept
    assert m["layers"]["model.layers.1.mlp"]["cluster_sizes"] == [4, 4, 4, 4]
    # The representative is each family's most salient member.
    s = cal.load(str(duplicate_stats)).layers["model.layers.1.mlp"]
    for e in kept:
        family = [f for f in range(16) if f % FAMILIES == e % FAMILIES]
        assert e == max(family, key=lambda f: float(s.saliency[f]))


def test_without_calibration_nothing_changes(planted, tmp_path):
    a = build_proxy(str(planted), str(tmp_path / "a"), experts=8)
    assert "calibration" not in a
    assert set(a["layers"]["model.layers.1.mlp"]) == {"layer", "kept", "cluster_sizes"}


def test_few_kept_experts_warn_that_routing_is_trivial(planted, planted_stats, tmp_path):
    m = build_proxy(str(planted), str(tmp_path / "p"), experts=2 * 2, method="saliency",
                    calibration=str(planted_stats), reconstruct=False, top_k=2)
    assert not any("every token uses every kept expert" in n for n in m["notes"])
    m = build_proxy(str(planted), str(tmp_path / "q"), experts=4, method="saliency",
                    calibration=str(planted_stats), reconstruct=False, top_k=4)
    assert any("every token uses every kept expert" in n for n in m["notes"])


def test_cli_build_with_calibration(planted, planted_stats, tmp_path, capsys):
    assert main(["build", str(planted), str(tmp_path / "p"), "--experts", "8", "--method", "saliency",
                 "--calibration", str(planted_stats), "--no-reconstruct", "--no-progress", "--json"]) == 0
    m = json.loads(capsys.readouterr().out)
    assert m["method"]["calibration"] == str(planted_stats) and m["method"]["keep_super"] is True
    assert SUPER in m["layers"]["model.layers.1.mlp"]["kept"]
    assert main(["build", str(planted), str(tmp_path / "q"), "--experts", "8", "--method", "frequency",
                 "--calibration", str(planted_stats), "--no-reconstruct", "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "gate mass kept" in text and f"super [{SUPER}]" in text and "dead 2" in text
