"""The build benchmark still runs: `bench/build.py --quick` (a tiny checkpoint through paced
relays, a parallel copy, two pods, the projection) in a fresh process. Nothing here is timed:
the figures of a quick run mean nothing; that it prints its tables, and that two pods build
the single build's proxy, does."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .conftest import BENCH


@pytest.mark.slow
def test_quick_paced_build_bench_prints_its_tables(tmp_path):
    out = subprocess.run([sys.executable, str(BENCH / "build.py"), "--quick", "--workers", "2",
                          "--copy-concurrency", "4", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=540)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    text = out.stdout
    for heading in ("| latency ms | MB/s per conn | MB/s per pod | --streams | build s |", "parallel copy of the proxy's bytes",
                    "scale-out, each pod behind its own relay", "| pods | seconds | speedup |",
                    "per-pod figures", "DeepSeek-V3, 32 of 256 experts kept", "| sized to the link (32) | 16 |"):
        assert heading in text, heading
    result = json.loads((tmp_path / "paced.json").read_text())
    (row,) = result["paced"]
    assert row["down_over_needed"] < 1.5 and row["planning_requests"] > 0 and row["copy_n"] == 4
    (two,) = result["scale_out"]
    assert two["pods"] == 2 and two["identical"] and all(mb > 0 for mb in two["down_mb"])
