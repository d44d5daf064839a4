"""The default calibrated build is the fidelity lab's winner (issue #16, docs/fidelity.md):
`calibrate --experts N` makes sequential statistics for the proxy `build --experts N` makes with
its default selection, and `build --calibration` reconstructs; `--one-pass` and
`--no-reconstruct` opt out, and `--experts auto` uses one-pass statistics and says so."""

from __future__ import annotations

import argparse
import importlib
import json

import pytest

import moe_proxy.pruning.reconstruct as rec
from moe_proxy.options import reconstructs
from moe_proxy.cli import main
from moe_proxy.demo.tiny import make_tiny

COMMON = ["--samples", "8", "--seq-len", "16", "--no-progress"]


@pytest.fixture(autouse=True)
def short_fit(monkeypatch):
    """Reconstruction is what is checked here, not how well it fits: a few steps."""
    monkeypatch.setattr(rec, "RECON_STEPS", 6)
    monkeypatch.setattr(rec, "RECON_PATIENCE", 3)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """Qwen3-MoE, 2 MoE layers of 16 experts (top-2)."""
    root = tmp_path_factory.mktemp("defaults")
    make_tiny("qwen3_moe", root / "src", seed=4, num_experts=16, num_experts_per_tok=2, num_hidden_layers=2,
              mlp_only_layers=[])
    return root / "src"


@pytest.fixture(scope="module")
def seq(src):
    """`calibrate --experts 4`, no other flag."""
    assert main(["calibrate", str(src), "--out", str(src.parent / "seq"), "--experts", "4", *COMMON]) == 0
    return src.parent / "seq"


@pytest.fixture(scope="module")
def one(src):
    """`calibrate` without --experts."""
    assert main(["calibrate", str(src), "--out", str(src.parent / "one"), *COMMON]) == 0
    return src.parent / "one"


def _parsed(command: str, args: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    importlib.import_module(f"moe_proxy.commands.{command}").add_parser(parser.add_subparsers())
    return parser.parse_args([command, *args])


def _manifest(path) -> dict:
    return json.loads((path / "proxy-manifest.json").read_text())


def test_calibrate_makes_statistics_for_the_build_s_default_selection():
    calibrate = _parsed("calibrate", ["SRC", "--out", "STATS", "--experts", "4"])
    build = _parsed("build", ["SRC", "DST", "--experts", "4", "--calibration", "STATS"])
    for field in ("method", "features", "representative", "keep_super"):
        assert getattr(calibrate, field) == getattr(build, field), field
    assert build.reconstruct is None  # decided by build_proxy: on with --calibration
    # not with --heal, which the build cannot combine with it (test_kimi_k2 builds with heal alone)
    assert (reconstructs(True, False), reconstructs(True, True), reconstructs(False, False)) == (True, False, False)
    assert reconstructs(True, False, False) is False and reconstructs(True, True, True) is True


def test_calibrate_with_experts_is_sequential_and_the_default_build_takes_it_and_reconstructs(src, seq, capsys):
    stats, dst = seq, src.parent / "default"
    summary = json.loads((stats / "calibration.json").read_text())
    assert summary["mode"] == "sequential" and summary["made_for"]["method"] == "cluster"
    # no selection flags: the statistics were made for exactly this build's proxy
    assert main(["build", str(src), str(dst), "--experts", "4", "--calibration", str(stats), "--no-progress"]) == 0
    m = _manifest(dst)
    assert m["method"]["reconstruct"] is True and m["calibration"]["mode"] == "sequential"
    assert set(m["reconstruct"]) >= {"tokens", "optimizer"}, m["reconstruct"].keys()
    assert all("reconstruct" in layer for layer in m["layers"].values())
    assert "reconstructed: held-out error" in capsys.readouterr().out


def test_one_pass_and_no_reconstruct_opt_out(src, capsys):
    stats, dst = src.parent / "plain-stats", src.parent / "plain"
    assert main(["calibrate", str(src), "--out", str(stats), *COMMON]) == 0
    assert "pass the build's --experts N here" in capsys.readouterr().out  # said without --experts
    assert json.loads((stats / "calibration.json").read_text())["mode"] == "one-pass"
    assert main(["build", str(src), str(dst), "--experts", "4", "--calibration", str(stats), "--no-reconstruct",
                 "--no-progress", "--json"]) == 0
    m = _manifest(dst)
    assert m["method"]["reconstruct"] is False and "reconstruct" not in m
    assert not any("reconstruct" in layer for layer in m["layers"].values())
    forced = src.parent / "forced"
    assert main(["calibrate", str(src), "--out", str(forced), "--one-pass", *COMMON]) == 0
    assert json.loads((forced / "calibration.json").read_text())["mode"] == "one-pass"
    assert "pass the build's --experts N here" not in capsys.readouterr().out  # asked for: nothing to advise
    assert main(["calibrate", str(src), "--out", str(forced), "--one-pass", "--experts", "4", *COMMON]) == 2
    assert "--one-pass makes statistics for any expert count" in capsys.readouterr().err


def test_auto_uses_one_pass_statistics_reconstructs_and_says_so(src, one, seq, capsys):
    dst = src.parent / "auto"
    assert main(["build", str(src), str(dst), "--experts", "auto", "--max-kl", "10", "--max-experts", "4",
                 "--calibration", str(one), "--no-progress"]) == 0
    m = _manifest(dst)
    assert m["method"]["reconstruct"] is True and "reconstruct" in m
    assert any(n.startswith("one-pass statistics, as --experts auto needs") for n in m["notes"])
    assert any(" full build(s) with fits, in order: " in n for n in m["notes"])  # the counts fitted
    assert "one-pass statistics, as --experts auto needs" in capsys.readouterr().out
    assert main(["build", str(src), str(src.parent / "auto-seq"), "--experts", "auto", "--max-kl", "10",
                 "--calibration", str(seq), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "sequential statistics made for 4 experts only" in err and "calibrate without --experts" in err
