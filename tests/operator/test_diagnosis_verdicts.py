"""The Diagnosis's verdicts never hide a failure (issue 41 §1), as the CLI's: the other failures a
run's termination message carries make a cure `fixed-but`, in the candidate's row, status
(fixedWithOtherFailures, a printer column), the Complete condition and the Events; the baseline
runs first and a baseline that reproduces on no seed starts no candidate; a candidate is judged
on its own steps; a change that changes nothing is `no-change`."""

from __future__ import annotations

from moe_proxy.metrics.detect import FailureDetector, Onset, Signature
from moe_proxy.metrics.verdict import verdict_report
from moe_proxy.reports import encode, parse_termination_log
from proxymodel_operator.diagnosis_matrix import decide
from proxymodel_operator.diagnosis_rows import recorded_running
from proxymodel_operator.diagnosis_status import DIAGNOSED
from proxymodel_operator.outcome import SUCCEEDED, Outcome

from ..checkpoints.crd_schema import load_crd
from .test_diagnosis_decisions import SETTINGS, _done, apply, built, diagnosis

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
