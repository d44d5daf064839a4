"""bench/learning.py --quick: the learning task's runs on a tiny original, its 50% proxies and the
reseeded original, compared seed by seed. A smoke run (the tiny original learns nothing in 3 steps):
the runs are made with the task, the original tracks itself exactly and every model has a figure
per seed; an extra build (--builds) with a smaller top-k routes its tokens to that many experts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moe_proxy.metrics.metrics_io import read_jsonl

from .conftest import BENCH


def test_quick_learning_lab_tracks_proxies_against_the_reseeded_floor(tmp_path):
    out = subprocess.run([sys.executable, str(BENCH / "learning.py"), "--quick", "--out", str(tmp_path),
                          "--builds", "seq-recon-top1-0.5"],
                         capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "| original-reseeded |" in out.stdout and "(the floor)" in out.stdout
    root = tmp_path / "qwen3" / "learning"
    result = json.loads((root / "learning.json").read_text())
    assert result["task"]["task"] == "small-sums" and result["seeds"] == 2 and result["steps"] == 3
    figures = result["figures"]
    assert set(figures) == {"original", "seq-recon-0.5", "random-0.5", "seq-recon-top1-0.5", "original-reseeded"}
    proxies = tmp_path / "qwen3" / "proxies"
    top_k = {name: json.loads((proxies / name / "config.json").read_text())["num_experts_per_tok"]
             for name in ("seq-recon-0.5", "seq-recon-top1-0.5")}
    assert top_k == {"seq-recon-0.5": 2, "seq-recon-top1-0.5": 1}  # the tiny original's top-2, and the build's
    assert figures["original"]["median"] == [1.0, 1.0]
    for name, f in figures.items():
        assert len(f["median"]) == len(f["first"]) == len(f["last"]) == 2, name
    for seed in (0, 1):
        run = root / f"seed-{seed}" / "learning" / "seq-recon-0.5"
        assert json.loads((run / "lab-key.json").read_text())["config"]["task"] == "small-sums"
        assert len((run / "metrics.jsonl").read_text().splitlines()) == 3
        # the reward table's figures are the runs' own: the mean reward of the first and the last
        # 4 steps (of 3 here: all of them), each model's run of this seed. The tiny models earn no
        # reward in 3 steps (0.0 everywhere): what this catches is a figure from another metric
        # or another run, not a wrong average.
        for name, f in figures.items():
            rows = read_jsonl(root / f"seed-{seed}" / "learning" / name / "metrics.jsonl")
            rewards = [row["critic/rewards/mean"] for _, row in sorted(rows.items())]
            assert f["first"][seed] == f["last"][seed] == pytest.approx(sum(rewards) / 3), (name, seed)
    assert (root / "learning-seed0.png").stat().st_size > 0
