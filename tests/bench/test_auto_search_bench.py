"""bench/auto_search.py replays --experts auto's search, before (a given commit's) and today, on
given figures: the unit test's drifting fit factor and the lab's checked-in figures each run in
seconds without a model, and print what docs/performance.md quotes."""

from __future__ import annotations

import subprocess
import sys

from .conftest import BENCH


def run(*args: str) -> list[str]:
    out = subprocess.run([sys.executable, str(BENCH / "auto_search.py"), *args],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.splitlines()


def test_synthetic_sweep_prints_builds_before_and_after():
    lines = run("--synthetic", "0.03", "--before", "6b841d8")
    assert "6b841d8: full builds mean 3.83, max 4, <= 3 at 7/60 targets; answer = exhaustive at 60/60" in lines
    assert ("today: full builds mean 2.95, max 3, <= 3 at 60/60 targets; answer = exhaustive at 60/60, "
            "within noise at 60/60") in lines


def test_lab_replay_prints_builds_before_and_after():
    lines = run("--replay")
    assert "b5dd109: full builds mean 3.83, max 6, <= 3 at 10/24 targets; answer = exhaustive at 17/24" in lines
    assert ("today: full builds mean 2.92, max 3, <= 3 at 24/24 targets; answer = exhaustive at 6/24, "
            "within noise at 24/24") in lines
