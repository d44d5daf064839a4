"""bisect (#26 item 3): the binary search and its report, and a real bisection over a run of 8
checkpoints whose last 3 carry a planted massive activation (a dense MLP's output beyond fp16's
range): the first of the 3 is found in at most 5 probe builds, the boundary confirmed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from moe_proxy.cli import main
from moe_proxy.investigate import bisect as bisect_module
from moe_proxy.investigate.bisect import Probe, ProbeSettings, search


class _Ckpt:
    def __init__(self, step):
        self.step, self.uri, self.source, self.complete = step, f"ckpt-{step}", True, True


def _probing(bad_from: int, flips=()):
    def test(i):
        return Probe(f"ckpt-{i}", i, (i >= bad_from) != (i in flips), None, None)
    return test


@pytest.mark.parametrize("n, bad_from", [(8, 5), (8, 0), (8, 7), (2, 1), (17, 9), (64, 33)])
def test_the_search_finds_the_first_bad_in_log_n_probes(n, bad_from):
    first, probes = search([_Ckpt(i) for i in range(n)], _probing(bad_from), good_given=False)
    assert first == bad_from
    assert len(probes) <= math.ceil(math.log2(n)) + 3  # and the ones after the first bad, before the last clean
    if bad_from > 0:  # the checkpoint before was probed clean: the boundary is confirmed
        assert any(i == bad_from - 1 and not p.reproduced for i, p in probes)


def test_a_clean_last_checkpoint_means_nothing_to_find():
    first, probes = search([_Ckpt(i) for i in range(8)], _probing(99), good_given=False)
    assert first is None and [i for i, _ in probes] == [7]


def test_probes_that_are_not_monotone_are_said(monkeypatch, tmp_path):
    """Step 5 reproduces, step 6 does not, step 7 does: the probe after the first bad one shows
    that the probes contradict each other, and the report says so with them."""
    ckpts = [_Ckpt(i) for i in range(8)]
    monkeypatch.setattr(bisect_module, "sources", lambda *a, **k: ckpts)
    monkeypatch.setattr(bisect_module, "probe_plan", lambda *a, **k: None)  # no checkpoint to read
    monkeypatch.setattr(bisect_module, "probe", lambda c, out, s: _probing(5, flips={6})(c.step))
    report = bisect_module.bisect("run", tmp_path, ProbeSettings("nan", [], [], []))
    assert report["first_bad"]["step"] == 5 and [p["step"] for p in report["probes"]] == [7, 3, 5, 4, 6]
    assert not report["monotone"] and report["not_monotone"] == ["step 6 clean after step 5 reproduced"]
    assert "**Not monotone**" in (tmp_path / "report.md").read_text()


def planted_run(root: Path, steps, planted) -> Path:
    """A run in verl's layout under `root`/run, one tiny Qwen3-MoE checkpoint per step; those in
    `planted` carry a dense MLP whose output overflows fp16 (its down_proj x 1e6)."""
    from moe_proxy.demo.run import OVERFLOWS, write_run
    from moe_proxy.demo.tiny import make_tiny

    make_tiny("qwen3_moe", root / "base")
    return write_run(root / "base", root / "run", {step: OVERFLOWS if step in planted else 1 for step in steps})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """verl's layout, 8 checkpoints; steps 60, 70, 80 carry a dense MLP whose output overflows fp16."""
    return planted_run(tmp_path_factory.mktemp("bisect"), range(10, 90, 10), (60, 70, 80))


ARGS = ["--fail-on", "overflow", "--experts", "4", "--steps", "1", "--precision", "fp16"]


def test_a_bisection_finds_the_first_planted_checkpoint(run, tmp_path, capsys):
    out = tmp_path / "b"
    assert main(["bisect", str(run), "--out", str(out), *ARGS]) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert report["first_bad"] == {"checkpoint": str(run / "global_step_60" / "actor" / "huggingface"), "step": 60}
    assert report["builds"] <= 5 and report["monotone"]  # 80, 40, 60, 50, then 70 after the first bad
    assert report["boundary"] == "confirmed: step 50, the checkpoint before, ran clean"
    assert {p["step"]: p["reproduced"] for p in report["probes"]} == {80: True, 40: False, 60: True, 50: False,
                                                                     70: True}
    assert "first bad checkpoint: step 60" in printed and (out / "report.md").is_file()
    # A rerun reuses every probe: nothing is built or run again.
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*.json") if p.name != "report.json"}
    assert main(["bisect", str(run), "--out", str(out), *ARGS]) == 0
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*.json") if p.name != "report.json"} == stamps


@pytest.mark.parametrize("extra, message", [
    (["--good", "15"], "--good 15: no complete checkpoint at that step"),
    (["--good", "80"], "1 complete checkpoint(s) with a step in the range given"),
    (["--experts", "0"], "the build options:"),
    (["--lr", "-1"], "the repro options:"),
    (["--samples", "4"], "need --dataset"),
    # #41: said as it is, and checked against the checkpoints before anything is written
    (["--good", "30", "--bad", "10"], "--good 30 is not before --bad 10"),
    (["--experts", "99"], "cannot keep 99 experts per layer: the model has 8 routed experts per layer"),
    (["--top-k", "5"], "top-k 5 must be between 1 and the kept experts (4)"),
    (["--seeds", "0"], "--seeds 0: at least 1"),
])
def test_bad_input_is_one_line_and_runs_nothing(run, tmp_path, capsys, extra, message):
    out = tmp_path / "b"
    assert main(["bisect", str(run), "--out", str(out), *ARGS, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moe-proxy bisect: error:") and message in err and "\n" not in err, err
    assert not out.exists()


def test_a_size_is_required(run, tmp_path, capsys):
    assert main(["bisect", str(run), "--out", str(tmp_path / "b"), "--fail-on", "nan"]) == 2
    assert "one of the arguments --experts --keep-ratio is required" in capsys.readouterr().err


def test_probes_fill_dead_experts_so_a_collapsed_checkpoint_builds(tmp_path):
    """A probe's build and its sequential statistics keep the most-routed dead experts where a
    layer has fewer alive ones than the count (--fill-dead, tests/calibration): a collapsed
    router is a failure to reproduce, not a reason to stop the search. Asked once, not twice."""
    data = tmp_path / "cal.txt"
    data.write_text("some text")
    s = bisect_module.probe_settings("collapse", ["--experts", "4"], ["--dataset", str(data)], [], 1)
    assert s.build_flags == ["--experts", "4", "--fill-dead"]
    assert "--fill-dead" in s.calibrate_flags and "--sequential" in s.calibrate_flags
    again = bisect_module.probe_settings("collapse", s.build_flags, ["--dataset", str(data)], [], 1)
    assert again.build_flags.count("--fill-dead") == 1
    assert bisect_module.build_options(s.build_flags).fill_dead
