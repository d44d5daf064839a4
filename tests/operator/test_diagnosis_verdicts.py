"""The Diagnosis's verdicts never hide a failure (issue 41 §1), as the CLI's: the other failures a
run's termination message carries make a cure `fixed-but`, in the candidate's row, status
(fixedWithOtherFailures, a printer column), the Complete condition and the Events; the baseline
runs first and a baseline that reproduces on no seed starts no candidate; a candidate is judged
on its own steps; a change that changes nothing is `no-change`."""

from __future__ import annotations

from moe_proxy.metrics.detect import FailureDetector, Onset, Signature
from moe_proxy.metrics.verdict import HEADLINE, SERIES_BYTES, verdict_report
from moe_proxy.reports import TERMINATION_LOG_LIMIT, encode, parse_termination_log
from proxymodel_operator.diagnosis_matrix import decide
from proxymodel_operator.diagnosis_rows import finished_row, recorded_running
from proxymodel_operator.diagnosis_status import DIAGNOSED, DIAGNOSIS_FAILED
from proxymodel_operator.outcome import SUCCEEDED, Outcome

from ..checkpoints.crd_schema import load_crd
from .test_diagnosis_decisions import SETTINGS, _done, _finish_all, apply, built, diagnosis

STEPS = 4  # built()'s maxSteps


def finished(asked: int | None = None, steps: int = STEPS, **others: int) -> Outcome:
    """A run's outcome from the termination message `moe-proxy repro` writes: divergence at step
    `asked` (None: not reproduced in `steps` steps), the other failures at their onsets."""
    detector = FailureDetector()
    detector.onsets = {name: Onset(step, "seen") for name, step in others.items()}
    if asked is not None:
        detector.onsets["divergence"] = Onset(asked, "seen")
    rows = {s: {"actor/pg_loss": 0.1} for s in range(asked + 1 if asked is not None else steps)}
    report = verdict_report(detector, Signature.parse("divergence"), rows, "completed")
    return Outcome(SUCCEEDED, report=parse_termination_log(encode(report)))


def run_to_end(body: dict, outcomes: dict[tuple[str, int], Outcome]) -> tuple[dict, list, list[str]]:
    """Decide until nothing runs, each run ending with outcomes[(variant, seed)]: the last body,
    every Event and every workload created, in order."""
    events, created, pm = [], [], built()
    for _ in range(20):
        running = recorded_running(body["status"])
        if not running and body["status"].get("phase") == DIAGNOSED:
            return body, events, created
        seen = {w: outcomes[(v, int(s))] for w in running for v, s in [w.removeprefix("dx-").rsplit("-s", 1)]}
        decision = decide(body, pm, seen, SETTINGS)
        events += decision.events
        created += [m["metadata"]["name"] for _, m in decision.create]
        body = apply(body, decision)
    raise AssertionError("never finished")


def test_a_cure_that_collapses_is_fixed_but_in_status_condition_and_events():
    body = diagnosis({"candidates": ["lower-lr", "fp32"], "parallelism": 3})
    body, events, _ = run_to_end(body, {
        ("baseline", 0): finished(1), ("baseline", 1): finished(3),
        ("lower-lr", 0): finished(collapse=3), ("lower-lr", 1): finished(collapse=3),
        ("fp32", 0): finished(2), ("fp32", 1): finished(3)})
    s = body["status"]
    lower = s["candidates"][0]
    assert (lower["verdict"], lower["note"]) == ("fixed-but", "collapse at step 3 on seeds 0, 1 (no divergence on "
                                                              "seeds 0, 1)")
    assert [r["otherFailures"] for r in lower["runs"]] == [{"collapse": 3}, {"collapse": 3}]
    assert (s["fixedBy"], s["fixedWithOtherFailures"]) == (None, "lower-lr")
    complete = next(c for c in s["conditions"] if c["type"] == "Complete")
    assert (complete["reason"], complete["message"]) == \
        ("FixWithOtherFailures", "no candidate fixed it; fixed, but with other failures: lower-lr")
    assert ("Warning", "CandidateJudged", f"lower-lr: fixed-but ({lower['note']})") in events
    assert ("Normal", "RunFinished", "lower-lr seed 0: not reproduced in 4 steps; collapse at step 3") in events
    assert ("Warning", "DiagnosisComplete", complete["message"]) in events
    (version,) = load_crd("diagnoses.moeproxy.io")["spec"]["versions"]
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Fixed, but"] == ".status.fixedWithOtherFailures"


def test_a_baseline_that_reproduces_on_no_seed_starts_no_candidate():
    body = diagnosis({"candidates": ["lower-lr", "fp32"], "parallelism": 3})
    body, events, created = run_to_end(body, {("baseline", 0): finished(), ("baseline", 1): finished(nan=2, steps=3)})
    assert created == ["dx-baseline-s0", "dx-baseline-s1"]
    s = body["status"]
    assert {c["verdict"] for c in s["candidates"]} == {"not-run"}
    assert {r["phase"] for c in s["candidates"] for r in c["runs"]} == {"NotRun"}
    assert s["baseline"]["note"] == ("no divergence in 4 steps; nan at step 2 on seed 1; seed 1 stopped after 3 of 4 "
                                     "steps")
    complete = next(c for c in s["conditions"] if c["type"] == "Complete")
    assert complete["reason"] == "BaselineNotReproduced" and complete["message"].endswith("no candidate was run")
    assert ("Warning", "BaselineNotReproduced", complete["message"]) in events


def test_a_candidate_is_judged_on_its_own_steps_and_a_change_that_changes_nothing_is_no_change():
    body = diagnosis({"candidates": [{"name": "short", "args": ["--steps", "2"]}, "warmup",
                                     {"name": "warm-1", "args": ["--warmup-steps", "1"]}], "seeds": 1,
                      "parallelism": 2})
    body, _, _ = run_to_end(body, {("baseline", 0): finished(1), ("short", 0): finished(steps=2),
                                   ("warmup", 0): _done(), ("warm-1", 0): finished(1)})
    rows = {c["name"]: c for c in body["status"]["candidates"]}
    assert (rows["short"]["verdict"], rows["short"]["note"]) == ("fixed", "ran all 2 steps on seed 0")
    assert rows["warmup"]["args"] == ["--warmup-steps", "2"]  # 1 of 4 steps would run step 0 at the full rate
    assert rows["warm-1"]["changes"] == {} and rows["warm-1"]["verdict"] == "no-change"


# --- a run whose metrics cannot show the failure asked for (FailureDetector.cannot_show) -------------


def showing(fail_on: str, asked: int | None = None, uniform: float = 0.5, steps: int = STEPS) -> Outcome:
    """A run's outcome from `moe-proxy repro`'s termination message, its detector fed each step's
    moe/load_uniform_share (1: a proxy keeping <= top-k experts, where collapse cannot show);
    `fail_on` at step `asked` (None: not seen)."""
    detector = FailureDetector()
    rows = {s: {"actor/pg_loss": 0.1, "moe/load_uniform_share": uniform} for s in range(steps)}
    for step, metrics in rows.items():
        detector.update(step, metrics)
    if asked is not None:
        detector.onsets[fail_on] = Onset(asked, "seen")
        rows = {s: m for s, m in rows.items() if s <= asked}
    report = verdict_report(detector, Signature.parse(fail_on), rows, "completed")
    return Outcome(SUCCEEDED, report=parse_termination_log(encode(report)))


def test_a_candidate_that_cannot_show_the_failure_asked_for_is_no_cure():
    """A candidate's clean run on a proxy where collapse cannot show says nothing of a cure: its
    runs could not judge, its verdict is the CLI's for such a run (error, with why), never fixed."""
    body = diagnosis({"candidates": ["lower-lr"], "failOn": {"signature": "collapse"}, "parallelism": 2})
    body, events, _ = run_to_end(body, {
        ("baseline", 0): showing("collapse", 1), ("baseline", 1): showing("collapse", 2),
        ("lower-lr", 0): showing("collapse", uniform=1.0), ("lower-lr", 1): showing("collapse", uniform=1.0)})
    s = body["status"]
    lower = s["candidates"][0]
    why = "collapse cannot show in this run: experts <= top-k (moe/load_uniform_share 1)"
    assert lower["verdict"] == "error" and lower["note"].startswith(f"seed 0: could not judge: {why}")
    assert [(r["phase"], r["reproduced"], r["stepsCompleted"]) for r in lower["runs"]] == [("Failed", None, 4)] * 2
    assert s["fixedBy"] is None and s["fixedWithOtherFailures"] is None
    said = next(e for e in events if e[1] == "RunFinished" and e[2].startswith("lower-lr seed 0"))
    assert said[0] == "Warning" and said[2].startswith(f"lower-lr seed 0: could not judge: {why}")
    assert ("Normal", "CandidateJudged", f"lower-lr: error ({lower['note']})"[:1024]) in events


def test_cannot_show_another_failure_than_the_one_asked_for_changes_nothing():
    """The same proxy (collapse cannot show) asked for divergence: its clean candidate is a cure."""
    body = diagnosis({"candidates": ["lower-lr"], "seeds": 1})
    body, _, _ = run_to_end(body, {("baseline", 0): showing("divergence", 1, uniform=1.0),
                                   ("lower-lr", 0): showing("divergence", uniform=1.0)})
    s = body["status"]
    assert s["baseline"]["verdict"] == "reproduced"
    assert (s["candidates"][0]["verdict"], s["fixedBy"]) == ("fixed", "lower-lr")
    assert s["candidates"][0]["runs"][0]["reproduced"] is False


def test_a_baseline_that_cannot_show_the_failure_on_any_seed_fails_the_diagnosis_and_says_why():
    """Not `did not reproduce, nothing to cure` (a clean read): the CLI's BaselineFailed, with why."""
    body = diagnosis({"candidates": ["lower-lr"], "failOn": {"signature": "collapse"}, "parallelism": 2})
    body = _finish_all(apply(body, decide(body, built(), {}, SETTINGS)), built(), {
        ("baseline", s): showing("collapse", uniform=1.0) for s in (0, 1)})
    s = body["status"]
    assert s["phase"] == DIAGNOSIS_FAILED and s["baseline"]["verdict"] == "error"
    assert s["message"].startswith("the baseline could not judge on every seed: seed 0: could not judge: collapse "
                                   "cannot show in this run: experts <= top-k")
    failed = next(c for c in s["conditions"] if c["type"] == "Failed")
    assert (failed["reason"], failed["message"]) == ("BaselineFailed", s["message"])
    assert {r["phase"] for r in s["candidates"][0]["runs"]} == {"NotRun"}


def test_cannot_show_fits_the_termination_message_and_picks_the_asked_failures_entry():
    """The longest message a run writes (the cost series at its budget, the stop reason, other
    failures, collapse and a load threshold that cannot show) stays within the kubelet's 4096
    bytes; the operator reads the entry of the failure its runs were asked for, and only that."""
    threshold = Signature.parse("moe/load_max_excess>0.5:3")
    detector = FailureDetector(extra=[threshold, Signature.parse("moe/load_max_share>0.95:2")])
    rows = {s: {**{k: -1.234567e-13 for k in HEADLINE}, "perf/time_per_step": -1.234567e-13,
                "moe/load_uniform_share": 1.0} for s in range(1000)}
    for step, metrics in rows.items():
        detector.update(step, metrics)
    detector.onsets.update({"nan": Onset(998, "seen"), "overflow": Onset(997, "seen"), "mismatch": Onset(3, "seen")})
    report = verdict_report(detector, threshold, rows, "x" * 300)
    assert len(report["cannot_show"]) == 3 and len(str(report["series"])) > SERIES_BYTES / 2
    text = encode(report)
    assert len(text.encode()) <= TERMINATION_LOG_LIMIT
    seen = Outcome(SUCCEEDED, report=parse_termination_log(text))
    row = finished_row({"seed": 0}, seen, 1000, threshold.name)
    assert (row["phase"], row["reproduced"], row["stepsCompleted"]) == ("Failed", None, 1000)
    assert row["message"].startswith(f"could not judge: {threshold.name} cannot show in this run: experts <= top-k")
    assert finished_row({"seed": 0}, seen, 1000, "divergence")["phase"] == "Succeeded"
