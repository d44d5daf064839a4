"""bench/mismatch.py --quick: the rollout/training mismatch lab runs end to end on a tiny
original and its 50% proxy, and its tables carry the gap of a bf16 rollout above the matched
floor (a smoke run: its figures mean nothing beyond that order)."""

from __future__ import annotations

import json
import subprocess
import sys

from .conftest import BENCH


def test_quick_mismatch_lab_runs_and_a_bf16_rollout_has_a_gap(tmp_path):
    out = subprocess.run([sys.executable, str(BENCH / "mismatch.py"), "--quick", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=540)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "| original | bf16 rollout |" in out.stdout and "| seq-recon-0.5 | baseline" not in out.stdout
    result = json.loads(next((tmp_path / "qwen3" / "mismatch").glob("mismatch-lr*.json")).read_text())
    gap = {(r["model"], r["rollout"]): r for r in result["gap"]}
    for model in ("original", "seq-recon-0.5"):
        matched, bf16 = gap[(model, "matched")], gap[(model, "bf16 rollout")]
        assert bf16["training/rollout_probs_diff_max"] > 10 * matched["training/rollout_probs_diff_max"]
    assert {r["fix"] for r in result["fixes"]} == {"baseline", "R3", "TIS (token, 2)", "no gap", "no gap, R3"}
