"""bisect says when it cannot tell (#41 section 4): a probe stopped by another failure is
inconclusive, named in the result, and the search steps around it; a run that is not monotone
just before the boundary is found; a probe that fails or is interrupted leaves a partial report;
bad input is refused before anything is written. The planted runs are tests/repro/test_bisect.py's
(tiny Qwen3-MoE checkpoints, one repro step each)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_proxy.cli import main
from moe_proxy.demo.run import checkpoint_dir
from moe_proxy.investigate import bisect as bisect_module
from moe_proxy.investigate.bisect import Probe, findings, search
from moe_proxy.investigate.diagnose import SeedRun

from .test_bisect import _Ckpt, planted_run

ARGS = ["--fail-on", "overflow", "--experts", "4", "--steps", "1", "--precision", "fp16"]


def _probing(bad_from: int, flips=(), unjudged=()):
    def test(i):
        reproduced = None if i in unjudged else (i >= bad_from) != (i in flips)
        probe = Probe(f"ckpt-{i}", i, reproduced, None, None)
        probe.note = "stopped by nan" if reproduced is None else ""
        return probe
    return test


# --- the search around what it cannot judge (pure) ---------------------------------------------


def test_an_inconclusive_probe_is_stepped_around_and_named():
    """Checkpoint 4 cannot be judged: the search does not take it for clean (which would make 5
    'confirmed'), probes its neighbours, and the result says the boundary is not confirmed."""
    ckpts = [_Ckpt(i) for i in range(8)]
    first, probes = search(ckpts, _probing(5, unjudged={4}), good_given=False)
    found = findings(first, probes, ckpts)
    assert first == 5 and [i for i, _ in probes] == [7, 3, 5, 4, 6, 2]
    assert found["inconclusive"] == [{"step": 4, "checkpoint": "ckpt-4", "why": "stopped by nan"}]
    assert found["boundary"] == ("not confirmed: step 4 before it could not be judged; the failure began "
                                 "after step 3, at or before step 5")
    assert [p["state"] for p in found["probes"]] == ["reproduced", "clean", "reproduced", "inconclusive",
                                                     "reproduced", "clean"]


def test_a_last_checkpoint_that_cannot_be_judged_finds_nothing_and_says_why():
    ckpts = [_Ckpt(i) for i in range(8)]
    first, probes = search(ckpts, _probing(5, unjudged={7}), good_given=False)
    assert first is None and [i for i, _ in probes] == [7]
    assert findings(first, probes, ckpts)["boundary"] == \
        "the last checkpoint (step 7) could not be judged (stopped by nan): nothing found"


def test_a_bad_probe_just_before_the_boundary_is_found():
    """16 checkpoints failing from 10, and 8 reproducing too (a flaky or transient failure): the
    search that only looked past the boundary (11) reported 10, monotone. Looking before the
    last clean one (9) too finds 8, and the report says the run is not monotone."""
    ckpts = [_Ckpt(i) for i in range(16)]
    first, probes = search(ckpts, _probing(10, flips={8}), good_given=False)
    found = findings(first, probes, ckpts)
    assert first == 8 and 8 in [i for i, _ in probes]
    assert not found["monotone"] and found["not_monotone"] == ["step 9 clean after step 8 reproduced"]
    assert len(probes) <= math.ceil(math.log2(16)) + 3


def _seed(reproduced, step=None, stopped="completed", others=None, error=None):
    return SeedRun(reproduced, "overflow" if reproduced else None, step, 1, stopped, others or {}, error)


@pytest.mark.parametrize("runs, verdict, note", [
    ({0: _seed(True, 0), 1: _seed(True, 0)}, True, ""),
    ({0: _seed(False), 1: _seed(True, 0)}, True, "on seed 1 of 2; the others ran clean"),
    ({0: _seed(False), 1: _seed(False, stopped="loss or weights are NaN", others={"nan": 0})}, None,
     "seed 1: stopped after 1 step by nan at step 0"),
    ({0: _seed(False), 1: _seed(None, error="boom")}, None, "seed 1: error: boom"),
    ({0: _seed(False, others={"collapse": 0}), 1: _seed(False)}, False, "seed 0: also collapse at step 0"),
])
def test_a_probe_is_judged_over_its_seeds(runs, verdict, note):
    """Bad on any seed (as diagnose judges a baseline); clean only when every seed ran its steps."""
    assert bisect_module.judge_probe(runs) == (verdict, note)


# --- real bisections ----------------------------------------------------------------------------


def _nan_head(checkpoint: Path) -> None:
    """The LM head NaN in one place: the loss is NaN at step 0, the hidden states stay finite (no overflow)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(checkpoint / "model.safetensors")
    tensors["lm_head.weight"][0, 0] = float("nan")
    save_file(tensors, checkpoint / "model.safetensors", metadata={"format": "pt"})


def test_a_checkpoint_whose_run_stops_on_nan_is_not_clean(tmp_path, capsys):
    """Steps 10, 20, 30; 30 overflows fp16, 20's run stops on NaN at its first step. Today 20 read
    clean and 30 came out 'confirmed'; now 20 is inconclusive, named in stdout and the report."""
    run = planted_run(tmp_path, (10, 20, 30), (30,))
    _nan_head(checkpoint_dir(run, 20))
    out = tmp_path / "b"
    assert main(["bisect", str(run), "--out", str(out), *ARGS]) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert {p["step"]: p["reproduced"] for p in report["probes"]} == {30: True, 10: False, 20: None}
    assert {p["step"]: p["state"] for p in report["probes"]} == {30: "reproduced", 10: "clean", 20: "inconclusive"}
    assert report["first_bad"]["step"] == 30 and report["status"] == "complete"
    why = "seed 0: stopped after 1 step by nan at step 0"
    assert report["inconclusive"] == [{"step": 20, "checkpoint": str(checkpoint_dir(run, 20)), "why": why}]
    assert report["boundary"].startswith("not confirmed: step 20 before it could not be judged")
    assert f"could not judge: step 20 ({why})" in printed
    assert "**Could not judge**" in (out / "report.md").read_text()


def _bad_config(checkpoint: Path) -> None:
    """config.json says 16 experts where the tensors have 8: listed as complete, the build refuses it."""
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "num_experts": 16}))


def test_a_probe_that_fails_leaves_a_partial_report(tmp_path, capsys):
    """Steps 10, 20, 30 (30 overflows), 10's build fails: exit 1 naming it, and a report with the
    probe so far (30, on both seeds) and the failing probe's log."""
    run = planted_run(tmp_path, (10, 20, 30), (30,))
    _bad_config(checkpoint_dir(run, 10))
    out = tmp_path / "b"
    capsys.readouterr()  # the planted run's save messages
    assert main(["bisect", str(run), "--out", str(out), *ARGS, "--seeds", "2"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("moe-proxy bisect: error: step 10") and "build failed" in err and "\n" not in err, err
    assert f"partial report: {out}/report.md" in err
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "failed" and report["first_bad"] is None
    assert [(p["step"], p["state"], sorted(p["seeds"])) for p in report["probes"]] == [(30, "reproduced", ["0", "1"])]
    failed = report["failed_probe"]
    assert failed["step"] == 10 and failed["what"] == "build" and failed["log"].endswith("step-10/build.log")
    assert any("has no axis of config.json's expert count 16" in line for line in failed["log_tail"])
    assert "## The probe that failed: step 10, build" in (out / "report.md").read_text()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_stops_within_seconds_with_a_partial_report(tmp_path, sig):
    """Ctrl-C or SIGTERM while the second probe runs: exit 128 + the signal within seconds, the
    first probe kept in the report, the interrupted one named; its child is stopped, and the same
    command resumes from the first probe's records."""
    run = planted_run(tmp_path, (10, 20, 30), (30,))
    out = tmp_path / "b"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, "-m", "moe_proxy", "bisect", str(run), "--out", str(out), *ARGS],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 120
    while not (out / "probes" / "step-10" / "build.log").exists():
        assert child.poll() is None and time.monotonic() < deadline, child.communicate()
        time.sleep(0.2)
    sent = time.monotonic()
    child.send_signal(sig)
    _, err = child.communicate(timeout=30)
    assert child.returncode == 128 + sig and time.monotonic() - sent < 10, err
    assert f"interrupted by {sig.name} during probe 2 (step 10)" in err and "partial report" in err, err
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "interrupted" and [p["step"] for p in report["probes"]] == [30]
    assert not (out / "probes" / "step-10" / "build.bisect-run.json").exists()  # stopped: no record


def test_a_rerun_reuses_only_what_the_same_content_made_and_refuses_another_bisection(tmp_path, capsys):
    """Steps 10 (clean) and 20 (overflows): a rerun reuses both probes and says so. Step 10
    rewritten in place (another training run's weights, overflowing): its probe builds and runs
    again and reproduces, where a record keyed by arguments kept 'clean'; step 20's is reused.
    Another bisection (--experts 2) into the same --out is refused, exit 2, its report untouched."""
    from moe_proxy.demo.run import OVERFLOWS, write_run
    from moe_proxy.demo.tiny import make_tiny

    run = planted_run(tmp_path, (10, 20), (20,))
    out = tmp_path / "b"
    command = ["bisect", str(run), "--out", str(out), *ARGS]
    assert main(command) == 0 and main(command) == 0
    said = "reused (same checkpoint content, moe-proxy version and flags): the probes of step(s) 20, 10"
    assert said in capsys.readouterr().out and said.capitalize() in (out / "report.md").read_text()
    make_tiny("qwen3_moe", tmp_path / "restarted", seed=1)
    write_run(tmp_path / "restarted", run, {10: OVERFLOWS})
    assert main(command) == 0
    report = json.loads((out / "report.json").read_text())
    assert {p["step"]: (p["reproduced"], p["reused"]) for p in report["probes"]} == {20: (True, True),
                                                                                     10: (True, False)}
    assert report["first_bad"]["step"] == 10
    before = (out / "report.json").read_text()
    capsys.readouterr()
    assert main([*command, "--experts", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"moe-proxy bisect: error: --out {out} holds another moe-proxy bisect") and \
        "--replace" in err and "\n" not in err, err
    assert (out / "report.json").read_text() == before


def test_a_long_error_is_cut_between_words(tmp_path):
    """A failed probe's error line (kept in its record and printed) is cut at 500 characters
    between words: it was cut mid-word ('... representati; partial report')."""
    from moe_proxy.investigate.processes import last_error

    log = tmp_path / "build.log"
    words = " ".join(f"representation{i}" for i in range(60))
    log.write_text(f"Writing model shards: 100%\nmoe-proxy build: error: already holds a different proxy ({words})\n")
    said = last_error(log)
    assert len(said) <= 500 and said.endswith(" ...")
    assert said.removesuffix(" ...").split()[-1] in f"({words})".split()
