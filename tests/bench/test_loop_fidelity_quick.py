"""bench/loop_fidelity.py --quick: triage on a tiny original whose checkpoints carry a planted fp16
overflow from step 20, with the original as every probe's model, its default 50% proxy and a
random one. A smoke run, so the lab cannot rot; what it checks is real: the original's loop finds
checkpoint 20 and the cures, and the default proxy (calibrated: it keeps the planted expert) gives
the same answer."""

from __future__ import annotations

import json
import subprocess
import sys

from .conftest import BENCH


def test_quick_loop_fidelity_gives_the_originals_answer_on_the_default_proxy(tmp_path):
    text = tmp_path / "calibration.txt"
    text.write_text(" ".join(["the model routes each token to a few experts of its layer"] * 400))
    out = subprocess.run([sys.executable, str(BENCH / "loop_fidelity.py"), "--quick", "--dataset", str(text),
                          "--out", str(tmp_path / "lab")], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    cells = json.loads((tmp_path / "lab" / "loop-fidelity.json").read_text())["super-fp16"]
    original = cells["original"]["report"]
    assert (original["failing_step"], original["first_bad"]["step"]) == (25, 20)
    assert set(original["fixed_by"]) == {"bf16", "fp32"}
    default = cells["default-0.5"]["agreement"]
    assert default["first_bad_equal"] and default["fixed_by_equal"], default
    assert default["verdicts_equal"] == default["verdicts"] == 3
    assert "| super-fp16 | default-0.5 | diagnosed | 20 (20) |" in out.stdout
