"""bench/verdicts.py --quick: `moe-proxy diagnose` on a tiny original, its default 50% proxy and a
random 50% proxy, the verdicts compared cell by cell, and one candidate's run made again as a plain
`moe-proxy repro` that fails at the same step with the same curves (a smoke run: its agreement
figures mean nothing)."""

from __future__ import annotations

import json
import subprocess
import sys

from .conftest import BENCH


def test_quick_verdict_lab_compares_proxies_with_the_original(tmp_path):
    out = subprocess.run([sys.executable, str(BENCH / "verdicts.py"), "--quick", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=540)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "| seq-recon-0.5 |" in out.stdout and "| random-0.5 |" in out.stdout
    result = json.loads((tmp_path / "qwen3" / "verdicts" / "verdicts.json").read_text())
    assert set(result["models"]) == {"original", "seq-recon-0.5", "random-0.5"}
    (scenario, by_model), = result["diagnoses"].items()
    for model in result["models"]:
        verdicts = by_model[model]["verdicts"]
        assert len(verdicts) == 2 and set(verdicts.values()) <= {"fixed", "reproduced", "inconclusive", "error"}
        assert by_model[model]["runs"] == 3  # baseline and 2 candidates, 1 seed
    for proxy in ("seq-recon-0.5", "random-0.5"):
        figures = result["agreement"][proxy]["scenarios"][scenario]
        assert figures["cells"] == 2 and 0 <= figures["verdicts_equal"] <= 2
        assert figures["onset_cells"] == sum(o["reproduced"] for o in by_model["original"]["baseline"].values()) + sum(
            s["0"]["reproduced"] for s in by_model["original"]["seeds"].values())
    check, = result["one_by_one"]
    assert check["returncode"] == 0 and check["same_step"] and check["max_relative_difference"] < 1e-4, check
