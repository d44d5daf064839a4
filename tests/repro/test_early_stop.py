"""diagnose stops what cannot change the answer (#45 item 2): a candidate that reproduced on one
seed is `reproduced` whatever its other seeds do, so its queued seeds are not started and its
running ones stopped (SIGTERM to the run's process group), unless --all-seeds asks for the full
matrix. The baseline always runs every seed (its onsets decide what the candidates are judged
on), and so does a no-change candidate (its runs are the method's own check)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from moe_proxy.cli import main
from moe_proxy.investigate import diagnose as diagnose_module
from moe_proxy.investigate import processes
from moe_proxy.investigate.diagnose import BASELINE, Diagnosis, Variant, run_all
from moe_proxy.investigate.processes import Cancelled, Ran
from moe_proxy.rl.config import ReproConfig

from .test_diagnose import BASE, proxy  # noqa: F401 - the tiny proxy; BASE diverges at step 1 on it


def test_a_cancelled_tag_stops_its_running_child_and_starts_none(tmp_path):
    started = time.monotonic()
    with open(tmp_path / "log", "w") as out:
        import threading

        got: list = []

        def run():
            try:
                processes._CHILDREN.run([sys.executable, "-c", "import time; time.sleep(60)"], out, {}, "t-1")
            except Cancelled as exc:
                got.append(exc)
        thread = threading.Thread(target=run)
        thread.start()
        while not processes._CHILDREN._running:
            time.sleep(0.05)
        assert processes.cancel("t-1") == 1
        thread.join(20)
        assert got and time.monotonic() - started < 20
        with pytest.raises(Cancelled):
            processes._CHILDREN.run([sys.executable, "-c", "pass"], out, {}, "t-1")


def test_a_running_seed_is_stopped_once_another_seed_of_its_candidate_reproduced(tmp_path, monkeypatch):
    """Seeds 0 and 1 of a candidate side by side (parallel 2): seed 0 reproduces, seed 1 (a child
    that would run a minute) is stopped and named in d.skipped; nothing of it is judged."""
    def fake_run_recorded(argv, directory, record, log, env=None, done=None, inputs=None, tag=None):
        seed = int(argv[argv.index("--seed") + 1])
        directory.mkdir(parents=True, exist_ok=True)
        if seed == 0:
            time.sleep(0.5)
            (directory / "summary.json").write_text(json.dumps({
                "reproduced": True, "first_failure": {"signature": "divergence", "step": 1}, "steps_completed": 2,
                "stopped": "divergence"}))
            return Ran(0, None, 0.5)
        with open(directory / log, "w") as out:
            processes._CHILDREN.run([sys.executable, "-c", "import time; time.sleep(60)"], out, {}, tag)
        raise AssertionError("not stopped")
    monkeypatch.setattr(diagnose_module, "run_recorded", fake_run_recorded)
    worse = Variant("worse", ["--lr", "1"], changes={"lr": 1.0}, steps=4)
    d = Diagnosis("proxy", tmp_path, "divergence", [], [0, 1], ReproConfig(), [Variant(BASELINE, []), worse])
    started = time.monotonic()
    results = run_all(d, 2, [worse], all_seeds=False)
    assert time.monotonic() - started < 30
    assert list(results["worse"]) == [0] and results["worse"][0].reproduced
    assert d.skipped == {"worse": {1: "stopped: reproduced on seed 0"}}


def _diagnose(proxy, out, *extra):  # noqa: F811
    return main(["diagnose", str(proxy), "--out", str(out), "--fail-on", "divergence", *BASE,
                 "--candidate", "worse=--lr 0.2", "--candidate", "again=--lr 0.1", "--seeds", "2", *extra])


def test_a_candidate_that_reproduces_on_its_first_seed_starts_none_of_the_others(proxy, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "d"
    assert _diagnose(proxy, out) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    worse = report["candidates"]["worse"]
    assert worse["verdict"] == "reproduced" and list(worse["seeds"]) == ["0"]
    assert worse["not_run"] == {"1": "not run: reproduced on seed 0"}
    assert not (out / "runs" / "worse" / "seed-1").exists()
    # the baseline, and the no-change candidate (the method's own check), ran every seed
    assert sorted(report["baseline"]["seeds"]) == ["0", "1"]
    assert sorted(report["candidates"]["again"]["seeds"]) == ["0", "1"]
    assert report["not_run"] == 1 and "; seed 1 not run: reproduced on seed 0" in printed
    markdown = (out / "report.md").read_text()
    assert "| not run: reproduced on seed 0 |" in markdown
    assert "Not run: 1 run(s)" in markdown and (out / "matrix.png").stat().st_size > 0

    # --all-seeds: the full matrix (the runs made before are reused, the one left runs now)
    assert _diagnose(proxy, out, "--all-seeds") == 0
    report = json.loads((out / "report.json").read_text())
    worse = report["candidates"]["worse"]
    assert sorted(worse["seeds"]) == ["0", "1"] and "not_run" not in worse and report["not_run"] == 0
    assert all((out / "runs" / "worse" / f"seed-{s}" / "diagnose-run.json").is_file() for s in range(2))
