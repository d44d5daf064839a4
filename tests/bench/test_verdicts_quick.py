"""bench/verdicts.py --quick --bisect: `moe-proxy diagnose` (super-fp16, stale-rollout, stale-drift,
high-lr and kl-drift, 2 candidates each) on a tiny original with a super expert
planted past fp16's range (and on it again with the next seed: the floor), its default 50% proxy
and two random 50% draws (the control: their cells pooled), one pinning the super experts as the default does, one not (`--no-keep-super`);
the verdicts compared cell by cell; one candidate's run made again as a plain `moe-proxy repro`
that fails at the same step with the same curves; and `moe-proxy bisect` over 3 checkpoints whose
super expert grows, on the original itself (`--keep-ratio 1`). A smoke run: its agreement figures
mean nothing, but the planted expert must overflow fp16 where bf16 cures it, on every model that
keeps it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .conftest import BENCH


@pytest.mark.timeout(1200)  # 516 s of wall time at load 5-7 beside two lab runs; over 600 s at load 8
def test_quick_verdict_lab_compares_proxies_with_the_original(tmp_path):
    out = subprocess.run([sys.executable, str(BENCH / "verdicts.py"), "--quick", "--bisect", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=1100)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "| seq-recon-0.5 |" in out.stdout and "| random-0.5 |" in out.stdout
    result = json.loads((tmp_path / "qwen3" / "verdicts" / "verdicts.json").read_text())
    assert set(result["models"]) == {"super-L1"}
    assert set(result["models"]["super-L1"]) == {"original", "original-other-seeds", "seq-recon-0.5", "random-0.5",
                                                 "random-nosuper-0.5"}
    assert result["models"]["super-L1"]["original-other-seeds"] == result["models"]["super-L1"]["original"]
    assert set(result["diagnoses"]) == {"super-fp16", "stale-rollout", "stale-drift", "high-lr", "kl-drift"}
    for name, diagnosed in result["diagnoses"].items():
        for model in result["models"]["super-L1"]:
            assert diagnosed[model]["runs"] == 3, (name, model)  # baseline and 2 candidates, 1 seed
    assert set(result["diagnoses"]["stale-rollout"]["original"]["verdicts"]) == {"sync", "lower-lr"}
    assert set(result["diagnoses"]["stale-drift"]["original"]["verdicts"]) == {"sync", "rollout-is-token"}
    assert set(result["diagnoses"]["high-lr"]["original"]["verdicts"]) == {"aux-loss", "aux-1e-2"}
    assert set(result["diagnoses"]["kl-drift"]["original"]["verdicts"]) == {"lower-lr", "kl-penalty"}
    stale = json.loads((tmp_path / "qwen3" / "verdicts" / "stale-rollout" / "original" / "runs" / "baseline" / "seed-0"
                        / "diagnose-run.json").read_text())["argv"]
    assert stale[stale.index("--rollout-staleness") + 1] == "2"
    # the floor: the original diagnosed again on seed 1, its runs paired with the original's seed 0
    again = json.loads((tmp_path / "qwen3" / "verdicts" / "stale-rollout" / "original-other-seeds" / "runs" / "baseline"
                        / "seed-1" / "diagnose-run.json").read_text())["argv"]
    assert again[again.index("--seed") + 1] == "1" and again[again.index("--rollout-staleness") + 1] == "2"
    floor = result["diagnoses"]["super-fp16"]["original-other-seeds"]
    assert set(floor["baseline"]) == {"0"} and floor["baseline"]["0"]["reproduced"] is True  # other samples overflow too
    assert result["agreement"]["original-other-seeds"]["all"]["cells"] == 10  # 5 scenarios x 2 candidates
    scenario, by_model = "super-fp16", result["diagnoses"]["super-fp16"]
    # fp16 overflows on the planted original at step 0; bf16 (fp32's range) cures it, a lower lr does not
    assert by_model["original"]["baseline"]["0"] == {**by_model["original"]["baseline"]["0"], "reproduced": True,
                                                      "step": 0}
    assert by_model["original"]["verdicts"] == {"bf16": "fixed", "lower-lr": "reproduced"}
    assert result["keeps_planted"]["seq-recon-0.5"] is True  # the super-expert rule keeps it
    assert result["keeps_planted"]["random-0.5"] is True  # pinned by the same rule, whatever it draws
    assert set(result["keeps_planted"]) == {"seq-recon-0.5", "random-0.5", "random-nosuper-0.5"}
    draws = [result["agreement"][p]["all"] for p in ("random-0.5", "random-nosuper-0.5")]
    pooled = result["agreement"]["random-0.5, all draws"]["all"]  # the control: both draws' cells
    assert pooled == {k: draws[0][k] + draws[1][k] for k in pooled} and pooled["cells"] == 20  # 2 draws x 5 scenarios x 2
    for proxy in ("seq-recon-0.5", "random-0.5", "random-nosuper-0.5", "original-other-seeds"):
        figures = result["agreement"][proxy]["all"]
        # one seed: a variant's failure rate is 0 or 1, so its gap is 1 exactly where the runs differ
        assert figures["variants"] == figures["runs"] == 15  # 5 scenarios x 3 variants
        assert figures["rate_gap"] == figures["runs"] - figures["runs_equal"]
    for proxy in ("seq-recon-0.5", "random-0.5", "random-nosuper-0.5"):
        figures = result["agreement"][proxy]
        assert "super-fp16" in figures["splitting"]["scenarios"]
        assert figures["scenarios"][scenario]["onset_cells"] == 2  # the baseline's and lower-lr's overflow
    # verdict agreement is the diagnoses' own: per scenario, the candidates whose verdict is the original's
    for name, diagnosed in result["diagnoses"].items():
        original = diagnosed["original"]["verdicts"]
        for proxy in ("seq-recon-0.5", "random-0.5", "random-nosuper-0.5", "original-other-seeds"):
            mine, row = diagnosed[proxy]["verdicts"], result["agreement"][proxy]["scenarios"][name]
            assert set(mine) == set(original) and row["cells"] == 2, (name, proxy)
            assert row["verdicts_equal"] == sum(mine[c] == original[c] for c in original), (name, proxy, mine, original)
    checks = {c["scenario"]: c for c in result["one_by_one"]}
    assert set(checks) == set(result["diagnoses"])
    for check in checks.values():
        assert check["returncode"] == 0 and check["same_step"] and check["max_relative_difference"] < 1e-4, check
    bisection = result["bisection"]
    assert bisection["checkpoints"] == [1, 4, 8] and bisection["first_bad_direct"] is not None
    original = bisection["original"]
    assert original["returncode"] == 0, original["error"]
    assert original["first_bad"] == bisection["first_bad_direct"]
    assert bisection["identity"]["probes_checked"] >= 1 and bisection["identity"]["max_abs_difference"] == 0.0
