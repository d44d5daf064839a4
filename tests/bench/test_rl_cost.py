"""bench/rl_cost.py (the RL step's cost model against measured repro steps) and bench/rl_step.py
(repro against TRL's GRPOTrainer): their --quick modes run to the end and report every figure.
The figures of a quick run mean nothing; that each phase is predicted and measured, does."""

from __future__ import annotations

import json

import pytest

from .test_bench_quick import run_bench

MEASURED = ("timing_s/gen", "timing_s/old_log_prob", "timing_s/ref", "timing_s/update_actor")


def test_quick_rl_cost_predicts_and_measures_every_phase(tmp_path):
    text = run_bench("rl_cost.py", "--out", str(tmp_path))
    for model in ("DeepSeek-V3", "Qwen3-235B-A22B", "Qwen3-30B-A3B"):  # the published models' plan table
        assert sum(line.startswith(f"| {model} |") for line in text.splitlines()) == 2 * 3, model
    result = json.loads((tmp_path / "rl_cost.json").read_text())
    assert result["quick"] and result["cpu"]["gflops"] > 0 and result["cpu"]["gbps"] > 0
    rows = {r["model"]: r for r in result["rows"]}
    assert {name: r["experts"] for name, r in rows.items()} == {"original": 64, "proxy 0.5": 32, "proxy 0.125": 8}
    for r in rows.values():
        assert all(r["predicted"][k] > 0 and r["measured"][k] > 0 for k in MEASURED), r
    # fewer experts: fewer bytes for the optimizer to touch, the same active compute
    update = [rows[n]["predicted"]["timing_s/update_actor"] for n in ("original", "proxy 0.5", "proxy 0.125")]
    assert update == sorted(update, reverse=True) and update[0] > update[-1]
    assert "predicted / measured" in text and sum(line.startswith("| 64 | proxy") for line in text.splitlines()) == 4


def test_quick_rl_step_times_repro_and_trl_side_by_side(tmp_path):
    text = run_bench("rl_step.py", "--out", str(tmp_path))
    result = json.loads((tmp_path / "rl_step.json").read_text())
    loops = result["loops"]
    assert set(loops) == {"moe-proxy repro", "TRL GRPOTrainer"}  # both step with the fused AdamW
    ours, trl = loops["moe-proxy repro"], loops["TRL GRPOTrainer"]
    assert result["repeats"] == 1
    assert result["ratio"] == pytest.approx(ours["cpu_s_per_token"] / trl["cpu_s_per_token"])
    for loop in (ours, trl):
        assert loop["step_s"] > 0 and loop["tokens_per_step"] > 0 and loop["s_per_token"] > 0
        assert 0 < loop["cpu_s"] <= loop["step_s"] * 1.1  # one thread: CPU time within the wall time
        assert all(v > 0 for v in loop["cpu_phases"].values()) and len(loop["cpu_phases"]) == 3
        assert sum(loop["cpu_phases"].values()) <= loop["cpu_s"] * 1.001  # parts of the step
        assert all(loop["phases"][p] > 0 for p in ("gen", "ref", "update")), loop
        parts = sum(v for p, v in loop["phases"].items() if p not in ("grad_stats", "metrics"))  # inside the phases
        assert parts <= loop["step_s"] * 1.01
    assert sum(ours["cpu_phases"].values()) == pytest.approx(ours["cpu_s"])  # repro's three phases: its whole step
    # one update per step: the old log-probs are the update's own (no pass, as TRL)
    assert ours["phases"]["old_log_prob"] == 0 and 0 < ours["phases"]["grad_stats"] < ours["phases"]["update"]
    assert ours["phases"]["grad_stats"] < ours["phases"]["metrics"] < ours["step_s"]
    assert not {"old_log_prob", "grad_stats", "metrics"} & set(trl["phases"])
    assert "| moe-proxy repro |" in text and "| TRL GRPOTrainer |" in text and "ours / TRL, CPU s per generated token" in text
