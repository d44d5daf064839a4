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
             "calibrate, both undone", "whole model in memory"]
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
@pytest.mark.timeout(1800)  # about 90 s of CPU; minutes of wall time on a busy machine
def test_quick_fidelity_lab_prints_its_tables_and_figures(tmp_path):
    # two originals trained, built (--reconstruct, --merge), run and compared, REAP where its venv is
    text = run_bench("fidelity.py", "--out", str(tmp_path), timeout=1500)
    for heading in ("### qwen3", "### deepseek-v3", "| proxy | held-out loss | KL (fidelity) | loss delta (fidelity)",
                    "| original (reference) |", "### Does the fidelity figure predict RL tracking?",
                    "Recommended maxKL", "| lab model | keep ratio | lowest held-out loss |",
                    "| lab model | target | figure | met |", "| seq-recon-0.5 | "):
        assert heading in text, heading
    result = json.loads((tmp_path / "results.json").read_text())
    families = ("qwen3", "deepseek-v3")
    assert {(r["family"], r["scenario"]) for r in result["rows"]} == {
        (f, s) for f in families for s in ("clean", "router-scale")}
    for family in families:
        quality = result["quality"][family]
        # every proxy is a calibrated build: the manifest's fidelity figure is in the table
        assert {n for n in quality if n != "original"} >= {"plain-0.5", "seq-recon-0.5"}
        assert all(q["kl"] is not None and q["kl"] >= 0 for n, q in quality.items() if n != "original")
        assert all(len(scores) == 1 for scores in result["seed_scores"][family].values())  # seed 1 of 2
        reap = result["reap"][family]["0.5"]
        assert ("held_out_loss" in reap) != ("skipped" in reap), reap
    assert (tmp_path / "summary.md").read_text() in text and (tmp_path / "table.md").exists()
    assert {p.name for p in tmp_path.glob("*.png")} == {
        f"{f}-{s}-0.5.png" for f in families for s in ("clean", "router-scale")}

    # bench/rl_batch.py: the same clean runs with more prompts per step, on the proxies just built
    text = run_bench("rl_batch.py", "--out", str(tmp_path), "--batch", "4", timeout=900)
    for family in families:
        for name in ("plain-0.5", "seq-recon-0.5", "original-reseeded"):
            [row] = [line for line in text.splitlines() if line.startswith(f"| {family} | {name} |")]
            assert len(row.strip("| ").split(" | ")) == 2 + 2 + 1, row  # model, proxy, seeds 0 and 1, mean
        key = json.loads((tmp_path / family / "rl-batch-4" / "1" / "clean" / "seq-recon-0.5" / "lab-key.json").read_text())
        assert (key["config"]["batch_size"], key["config"]["steps"], key["config"]["prompt_seed"]) == (4, 2, 1)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quick_super_expert_study_prints_its_table(tmp_path):
    """bench/fidelity.py --super-only (issue 30): the planted super expert in the first and the
    last MoE layer, every model run in fp16 and bf16, one table row per layer and model."""
    text = run_bench("fidelity.py", "--super-only", "--super-layers", "first", "last", "--variants", "plain",
                     "--out", str(tmp_path), timeout=800)
    assert "| planted in MoE layer (expert) | rules that flag it (max abs output) | model | keeps it | KL | " \
           "fp16: failures (max activation) | bf16: failures (max activation) |" in text
    rows = json.loads((tmp_path / "super.json").read_text())["rows"]
    assert {r["layer"] for r in rows} == {0, 1}  # the quick originals' two MoE layers
    for layer in (0, 1):
        models = {r["proxy"]: r for r in rows if r["layer"] == layer}
        assert set(models) == {"original", "plain-0.5", "plain-nosuper-0.5", "frequency-plain-0.5",
                               "frequency-plain-nosuper-0.5"}
        assert models["original"]["keeps_super"] is True and models["plain-0.5"]["kl"] is not None
        assert all(set(r["runs"]) == {"fp16", "bf16"} for r in models.values())
    assert (tmp_path / "super.md").read_text() in text


@pytest.mark.slow
def test_quick_repro_memory_bench_prints_a_row_per_rank_count():
    text = run_bench("repro_memory.py", timeout=900)  # 4 launches of 1-2 ranks, each importing torch
    assert "MiB per rank (the largest over the ranks):" in text and "largest FSDP units" in text
    rows = [line.split() for line in text.splitlines() if line.split()[:1] in (["1"], ["2"])]
    assert [row[0] for row in rows] == ["1", "2"] and all(len(row) == 12 for row in rows), text
    assert all(int(row[5]) >= int(row[3]) > 0 for row in rows)  # load peak >= what stays loaded


@pytest.mark.slow
def test_quick_deep_build_cost_bench_prints_peaks_and_layer_times(tmp_path):
    text = run_bench("deep_build_cost.py", "--out", str(tmp_path))
    rows = json.loads((tmp_path / "deep_build_cost.json").read_text())["rows"]
    assert [(r["depth"], r["what"]) for r in rows] == [(d, w) for d in (1, 2)
                                                       for w in ("calibrate --sequential", "build --reconstruct")]
    for r in rows:  # every layer's time, as the command printed it with its progress
        assert r["peak_rss_bytes"] > 0 and len(r["per_layer_s"]) == r["depth"], r
    for r in rows[1::2]:  # the build's peak per phase, each within the process's peak
        # the figure is measured in the walk that fits, where the fits are judged against the plain
        # selection, before the write
        assert list(r["phases"]) == ["reconstruct+fidelity", "write"], r
        assert all(0 < ph["peak_rss_bytes"] <= r["peak_rss_bytes"] for ph in r["phases"].values()), r
    assert "peak RSS" in text and "per layer (mean, max)" in text
    assert not (tmp_path / "deep_build_cost").exists()  # checkpoints and proxies deleted


def test_quick_calibrated_build_bench_times_both_trees():
    # bench/calibrated_build.py: builds by an older commit's tree and today's, alternately
    text = run_bench("calibrated_build.py")
    rows = [line.split(" | ")[:2] for line in text.splitlines() if line.startswith(("| default", "| merge"))]
    assert rows == [["| default", "old"], ["| default", "today"], ["| merge", "old"], ["| merge", "today"]], text


def test_smoke_local_build_bench_prints_its_tables(tmp_path):
    # bench/build.py without --paced: build vs copy on a local SeaweedFS, bytes, peak RSS, scale-out
    out = subprocess.run([sys.executable, str(BENCH / "build.py"), "--smoke", "--sizes", "0.01", "--workers", "1,2",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=540)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "build.json").read_text())
    (row,) = result["sizes"]
    assert row["build_s"] > 0 and row["copy_s"] > 0 and row["build_cpu_s"] > 0 and row["peak_rss_mb"] > 0
    assert 0.95 <= row["download_vs_target"] <= 1.1, row  # kept experts, headers and routers, once
    assert [s["manifest_identical_to_single"] for s in result["scale_out"]] == [True, True]
    assert "| checkpoint GB | MoE layers |" in out.stdout and "| workers | seconds | speedup |" in out.stdout
    assert not (tmp_path / "seaweedfs").exists()  # the S3 data it made is gone


def test_smoke_build_vs_commit_times_both_trees(tmp_path):
    out = subprocess.run([sys.executable, str(BENCH / "build_vs_commit.py"), "--smoke", "--size", "0.01",
                          "--commit", "HEAD", "--out", str(tmp_path)], capture_output=True, text=True, timeout=540)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in out.stdout.splitlines() if line.startswith(("| HEAD", "| today"))]
    assert sorted(r[0].strip() for r in rows) == ["HEAD", "HEAD", "today", "today"]
    assert all(float(r[2]) > float(r[4]) > 0 for r in rows)  # the whole process outlasts its in-process part
