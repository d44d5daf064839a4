"""bench/auto_search.py replays --experts auto's search, before (6b841d8) and today, on given
figures: on the unit test's drifting fit factor it runs in seconds without a model, and prints
what docs/performance.md quotes."""

from __future__ import annotations

import subprocess
import sys

from .conftest import BENCH


def test_synthetic_sweep_prints_builds_before_and_after(tmp_path):
    out = subprocess.run([sys.executable, str(BENCH / "auto_search.py"), "--synthetic", "0.03"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "6b841d8: full builds mean 3.83, max 4 over 60 targets; answer = exhaustive at 60/60" in lines
    assert "today: full builds mean 2.95, max 3 over 60 targets; answer = exhaustive at 60/60" in lines
