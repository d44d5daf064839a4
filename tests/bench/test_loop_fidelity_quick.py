"""bench/loop_fidelity.py --quick: triage on a tiny original whose checkpoints carry a planted fp16
overflow from step 20, with the original as every probe's model, its default 50% proxy and a
random one. A smoke run, so the lab cannot rot; what it checks is real: the original's loop finds
checkpoint 20 and the cures, and the default proxy (calibrated on the docs' CAL.txt: it keeps the
planted expert) gives the same answer."""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
import sys

from .conftest import BENCH


# docs/fidelity.md's CAL.txt: 20,000 words drawn with a fixed seed from 100 common English words.
# The probes' calibration reads it as bytes (the tiny original ships no tokenizer); a narrow text
# (one sentence repeated) never routes to the planted expert, and the default build drops it.
WORDS = """the be to of and a in that have I it for not on with he as you do at this
but his by from they we say her she or an will my one all would there their what so up out if about who get
which go me when make can like time no just him know take people into year your good some could them see
other than then now look only come its over think also back after use two how our work first well way even
new want because any these give day most us""".split()
CAL_SHA256 = "44c28c17f7ab92c8cee81a9408c995b78bd82876b7c7736d5753fc3bea0bfc47"


def test_quick_loop_fidelity_gives_the_originals_answer_on_the_default_proxy(tmp_path):
    text = tmp_path / "CAL.txt"
    text.write_text(" ".join(random.Random(0).choices(WORDS, k=20000)) + "\n")  # as the docs' `print`
    assert hashlib.sha256(text.read_bytes()).hexdigest() == CAL_SHA256
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
