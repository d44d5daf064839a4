"""Issue 41 §5, bad input as a new user meets it: an unknown flag is one line (not argparse's
usage block), `diagnose --list` prints the catalogue it is cited for, the failure signatures
are listed alike by the README, every command's --help and the --fail-on error (one source,
detect.SIGNATURES), and a candidate may not set diagnose's own flags."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from moe_proxy.cli import main, subcommands, build_parser
from moe_proxy.investigate.catalogue import CATALOGUE
from moe_proxy.metrics.detect import SIGNATURES

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.parametrize("argv", [
    ["diagnose", "PROXY", "--out", "D", "--fail-on", "nan", "--no-such-flag"],
    ["diagnose"],
    ["inspect", "CKPT", "--jsn"],
    ["no-such-command"],
])
def test_bad_usage_is_one_line_and_exit_2(argv):
    done = subprocess.run([sys.executable, "-m", "moe_proxy", *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moe-proxy") and ": error: " in lines[0], done.stderr
    assert "-h)" in lines[0]  # where the options are listed instead


def test_diagnose_list_prints_the_catalogue(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["diagnose", "--list"])
    assert exited.value.code == 0
    printed = capsys.readouterr().out
    for c in CATALOGUE.values():
        assert re.search(rf"^  {re.escape(c.name)} +{re.escape(c.what)}$", printed, re.M), c.name
    assert "flags: --lr 1e-06" in printed  # lower-lr at repro's default lr 1e-5


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_every_list_of_signatures_is_detects_own():
    choices = ", ".join(SIGNATURES)
    helps = {name: _flat(p.format_help()) for name, p in subcommands(build_parser()).items()
             if "--fail-on" in p.format_help()}
    assert set(helps) >= {"repro", "diagnose", "bisect", "watch"}
    for name, text in helps.items():
        assert choices in text, f"{name} --help does not list {choices}"
    with pytest.raises(Exception) as refused:
        from moe_proxy.metrics.detect import Signature

        Signature.parse("garbage")
    assert choices in str(refused.value)
    synopsis = re.search(r"--fail-on ([a-z|]+)\|METRIC", README.read_text())
    assert synopsis and synopsis.group(1).split("|") == list(SIGNATURES), synopsis and synopsis.group(0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from moe_proxy.demo.tiny import make_tiny

    path = tmp_path_factory.mktemp("own-flags") / "tiny"
    make_tiny("qwen3_moe", path)
    return path


@pytest.mark.parametrize("candidate, flag", [
    ("other-seed=--seed 3", "--seed"),
    ("elsewhere=--out=/tmp/x", "--out=/tmp/x"),
    ("more-ranks=--nproc-per-node 2", "--nproc-per-node"),
    ("quiet=--no-progress", "--no-progress"),
])
def test_a_candidate_may_not_set_diagnoses_own_flags(tiny, tmp_path, capsys, candidate, flag):
    out = tmp_path / "d"
    assert main(["diagnose", str(tiny), "--out", str(out), "--fail-on", "divergence", "--steps", "1",
                 "--seeds", "1", "--candidate", candidate]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moe-proxy diagnose: error: candidate") and flag in err and "diagnose's own" in err, err
    assert "\n" not in err and not (out / "runs").exists()
