"""diagnose (#26 items 1-2): the verdict rules, the catalogue as repro flags, and a real
diagnosis on a tiny proxy whose verdicts and onsets equal the same runs made one by one with
`moe-proxy repro`; resumed reruns; bad input is one line and runs nothing."""

from __future__ import annotations

import json

import pytest

from moe_proxy.cli import main
from moe_proxy.investigate.catalogue import CATALOGUE, custom, from_file
from moe_proxy.investigate.diagnose import BASELINE, SeedRun, repro_config, verdict


def _o(step=None, steps=6, error=None, **others):
    if error:
        return SeedRun(None, error=error)
    return SeedRun(step is not None, "divergence" if step is not None else None, step, step + 1 if step else steps,
                   "completed" if step is None else "divergence", others)


@pytest.mark.parametrize("baseline, candidate, expected, note", [
    ({0: _o(3), 1: _o(3)}, {0: _o(), 1: _o()}, "fixed", "ran all 6 steps on seeds 0, 1"),
    ({0: _o(3), 1: _o(3)}, {0: _o(), 1: _o(4)}, "reproduced", "delayed: seed 1 step 4"),
    ({0: _o(3), 1: _o(3)}, {0: _o(5), 1: _o(4)}, "reproduced", "delayed: seed 0 step 5, seed 1 step 4"),
    ({0: _o(3), 1: _o(3)}, {0: _o(3), 1: _o(4)}, "reproduced", "seed 0 step 3, seed 1 step 4"),
    ({0: _o(), 1: _o()}, {0: _o(), 1: _o()}, "inconclusive",
     "the baseline did not reproduce on any seed: nothing to cure"),
    # judged only where the baseline reproduced: seed 1's clean baseline does not matter
    ({0: _o(3), 1: _o()}, {0: _o(), 1: _o()}, "fixed", "ran all 6 steps on seed 0"),
    ({0: _o(3)}, {0: SeedRun(False, None, None, 2, "nan", {"nan": 1})}, "inconclusive",
     "seed 0 did not get past the baseline's onset at step 3; nan at step 1 on seed 0; "
     "seed 0 stopped after 2 of 6 steps"),
    ({0: _o(3)}, {0: _o(error="moe-proxy repro: error: boom")}, "error", "seed 0: moe-proxy repro: error: boom"),
])
def test_verdict_rules(baseline, candidate, expected, note):
    got, text = verdict(baseline, candidate, steps=6)
    assert (got, text) == (expected, note)


def test_every_catalogue_entry_is_repro_flags_repro_accepts(tmp_path):
    from moe_proxy.demo.tiny import make_tiny

    make_tiny("qwen3_moe", tmp_path / "m")
    base = repro_config(["--steps", "8", "--lr", "1e-4"])
    configs = {}
    for c in CATALOGUE.values():
        configs[c.name] = repro_config(["--steps", "8", "--lr", "1e-4", *c.changes(base)])
        assert c.what and c.knobs
    # entries whose settings are known: a renamed or dropped entry fails here, not silently
    assert configs["lower-lr"].lr == pytest.approx(1e-5)
    assert configs["warmup"].warmup_steps == 2
    assert custom("slow=--lr 1e-6,--warmup-steps 5").changes(base) == ["--lr", "1e-6", "--warmup-steps", "5"]
    assert [c.name for c in from_file({"a": ["--lr", "1e-6"], "b": "--grad-clip 0.5"}, "f")] == ["a", "b"]


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    from moe_proxy.pruning import build_proxy
    from moe_proxy.demo.tiny import make_tiny

    root = tmp_path_factory.mktemp("diagnose")
    make_tiny("qwen3_moe", root / "original")
    build_proxy(str(root / "original"), str(root / "proxy"), experts=4)
    return root / "proxy"


BASE = ["--steps", "4", "--lr", "0.1"]  # diverges at step 1 on this proxy; lr / 10 does not


def test_a_diagnosis_equals_its_runs_made_one_by_one(proxy, tmp_path, capsys):
    out = tmp_path / "d"
    code = main(["diagnose", str(proxy), "--out", str(out), "--fail-on", "divergence", *BASE,
                 "--candidates", "lower-lr", "--candidate", "again=--lr 0.1", "--seeds", "1", "--parallel", "2"])
    assert code == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    base = report["baseline"]["seeds"]["0"]
    assert base["reproduced"] and base["signature"] == "divergence"
    lower, again = report["candidates"]["lower-lr"], report["candidates"]["again"]
    assert lower["verdict"] == "fixed" and lower["changes"] == {"lr": pytest.approx(0.01)}
    # the baseline under another name: no-change, its run failing at the baseline's step
    assert again["verdict"] == "no-change" and again["seeds"]["0"]["step"] == base["step"]
    assert again["changes"] == {} and again["note"].startswith("changes none of the baseline's settings; its runs end")
    assert report["fixed_by"] == ["lower-lr"] and "fixed by: lower-lr" in printed
    for name in ("report.md", "matrix.png", "curves.png"):
        assert (out / name).stat().st_size > 0

    # The same runs by hand: the same verdicts and onsets.
    for variant, flags in (("baseline", []), ("lower-lr", ["--lr", "0.01"])):
        by_hand = tmp_path / variant
        assert main(["repro", str(proxy), "--out", str(by_hand), *BASE, *flags, "--seed", "0",
                     "--fail-on", "divergence"]) in (0,)
        summary = json.loads((by_hand / "summary.json").read_text())
        ran = report["baseline"] if variant == BASELINE else report["candidates"][variant]
        assert summary["reproduced"] == ran["seeds"]["0"]["reproduced"]
        assert (summary["first_failure"] or {}).get("step") == ran["seeds"]["0"]["step"]
        assert summary["steps_completed"] == ran["seeds"]["0"]["steps_completed"]

    # A rerun with the same settings reuses every run (nothing runs again).
    stamps = {p: p.stat().st_mtime_ns for p in (out / "runs").rglob("summary.json")}
    assert main(["diagnose", str(proxy), "--out", str(out), "--fail-on", "divergence", *BASE,
                 "--candidates", "lower-lr", "--candidate", "again=--lr 0.1", "--seeds", "1"]) == 0
    assert {p: p.stat().st_mtime_ns for p in (out / "runs").rglob("summary.json")} == stamps
    assert json.loads((out / "report.json").read_text())["candidates"]["lower-lr"]["verdict"] == "fixed"


@pytest.mark.parametrize("args, message", [
    (["--candidates", "fp64"], "unknown candidate 'fp64': the catalogue has fp32, bf16"),
    (["--candidate", "bad=--lr -1"], "candidate 'bad' (--lr -1): repro refuses it"),
    (["--candidate", "oops"], "expected NAME=--flag value"),
    (["--candidates", "fp32", "--seeds", "0"], "--seeds 0: at least 1"),
    ([], "no candidates"),
    (["--candidates", "fp32", "--lr", "-2"], "the baseline's repro options"),
])
def test_bad_input_is_one_line_and_runs_nothing(proxy, tmp_path, capsys, args, message):
    out = tmp_path / "d"
    assert main(["diagnose", str(proxy), "--out", str(out), "--fail-on", "divergence", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moe-proxy diagnose: error:") and message in err and "\n" not in err, err
    assert not (out / "runs").exists()


def test_a_path_that_is_no_checkpoint_is_refused(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["diagnose", str(tmp_path / "empty"), "--out", str(tmp_path / "d"), "--fail-on", "nan",
                 "--candidates", "fp32"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moe-proxy diagnose: error:") and "\n" not in err


def test_a_run_that_cannot_show_the_failure_asked_for_is_no_verdict(tmp_path):
    """A proxy keeping <= top-k experts: its clean run is no cure and a raw-share threshold that
    fired is no reproduction; the run reads as one that could not judge (as a failed run does)."""
    from moe_proxy.investigate.diagnose import seed_outcome

    why = "experts <= top-k (moe/load_uniform_share 1): every token uses every expert"
    for reproduced in (False, True):
        (tmp_path / "summary.json").write_text(json.dumps({
            "fail_on": "collapse", "reproduced": reproduced, "steps_completed": 4,
            "first_failure": {"signature": "collapse", "step": 3} if reproduced else None,
            "cannot_show": {"collapse": why}}))
        outcome = seed_outcome(tmp_path, 0, None, 1.0)
        assert outcome.reproduced is None and outcome.error == f"collapse cannot show in this run: {why}"
    (tmp_path / "summary.json").write_text(json.dumps({"fail_on": "divergence", "reproduced": False,
                                                       "steps_completed": 4, "cannot_show": {"collapse": why}}))
    assert seed_outcome(tmp_path, 0, None, 1.0).reproduced is False  # another failure: judged as before
