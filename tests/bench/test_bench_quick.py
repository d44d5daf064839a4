"""Every other benchmark, and the fidelity lab, still runs: each one's `--quick` mode (tiny
sizes, seconds) in a fresh process, as a person would run it. Nothing here is timed: the
figures of a quick run mean nothing; that the script runs to its end and prints its table, does.
(`bench/build.py --quick`: test_bench_smoke.py.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .conftest import BENCH


def run_bench(script: str, *args: str, timeout: int = 540) -> str:
    out = subprocess.run([sys.executable, str(BENCH / script), "--quick", *args],
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


@pytest.mark.slow
def test_quick_calibrate_memory_bench_measures_every_variant(tmp_path):
    text = run_bench("calibrate_memory.py", "--out", str(tmp_path))
    result = json.loads((tmp_path / "calibrate_memory.json").read_text())
    whats = ["imports only", "calibrate (layer by layer)", "calibrate, kernel caches 1024", "calibrate, no heap trim",
             "whole model in memory"]
    assert [row["what"] for row in result["rows"]] == whats and result["quick"]
    assert all(row["peak_rss_bytes"] > 0 for row in result["rows"])
    for what in whats:
        assert f"{what}" in text and "peak RSS" in text, what


def test_quick_checkpoints_listing_bench_lists_local_and_s3(tmp_path):
    local = run_bench("checkpoints_listing.py", "--dir", str(tmp_path))
    s3 = run_bench("checkpoints_listing.py", "--s3", "--dir", str(tmp_path))
    for text in (local, s3):
        assert "quick: listed 3 checkpoints" in text and "deep : listed 3 checkpoints" in text, text
    assert "per checkpoint" in local and "uploaded 3 checkpoints" in s3 and "from SeaweedFS" in s3


def test_quick_s3_store_bench_prints_its_table(tmp_path):
    text = run_bench("s3_store.py", "--out", str(tmp_path))
    assert "MB/s  peak RSS MB" in text
    result = json.loads((tmp_path / "s3_store.json").read_text())
    assert result["bytes"] == 80 << 20 and len(result["results"]) == 4
    for name, r in result["results"].items():
        assert name in text and r["seconds"] > 0 and r["peak_rss"] > 0


@pytest.mark.slow
def test_quick_fidelity_lab_prints_its_tables_and_figures(tmp_path):
    text = run_bench("fidelity.py", "--out", str(tmp_path))
    for heading in ("| proxy | held-out loss | gate mass kept | clean: median Pearson",
                    "| original (reference) |", "| family | model | held-out loss | task reward at step 0 |",
                    "| super | frequency-no-super-0.5 |"):
        assert heading in text, heading
    result = json.loads((tmp_path / "results.json").read_text())
    assert {(r["family"], r["scenario"]) for r in result["rows"]} == {
        ("main", "clean"), ("healed", "clean"), ("super", "fp16-super"), ("super", "fp32-super")}
    assert (tmp_path / "summary.md").read_text() in text and (tmp_path / "table.md").exists()
    assert {p.name for p in tmp_path.glob("*.png")} == {"clean-0.5.png", "healed-clean-0.5.png",
                                                         "fp16-super-0.5.png", "fp32-super-0.5.png"}
