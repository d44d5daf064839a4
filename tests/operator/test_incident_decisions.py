"""The watched run's decisions without a cluster (issue 43, incident.py, loop_spec.py): when a
failure opens an incident, what its Diagnosis is, the budget, what the Diagnosis's status means for
the incident, and the answer (report, webhook body, Events). And a bisection with candidates
handing over to them on its first bad probe's ProxyModel (issue 45 item 3)."""

from __future__ import annotations

import json

import pytest

from moe_proxy.metrics.incident import RunFailure
from proxymodel_operator import incident as inc
from proxymodel_operator.diagnosis_matrix import decide as matrix_decide
from proxymodel_operator.diagnosis_bisect import in_flight, parse_bisection, progress, start
from proxymodel_operator.diagnosis_spec import candidates_spec
from proxymodel_operator.diagnosis_status import DIAGNOSED, DIAGNOSING
from proxymodel_operator.loop_spec import BudgetSpec, parse_on_failure
from proxymodel_operator.outcome import SUCCEEDED, Outcome
from proxymodel_operator.settings import Settings
from proxymodel_operator.watch_spec import InvalidWatch, parse_watch
from proxymodel_operator.resources import PROXYMODELS

from .test_diagnosis_bisect import BUCKET, HF, _apply, _body, _built, checkpoints_spec

WATCH = {"apiVersion": "moeproxy.io/v1alpha1", "kind": "CheckpointWatch",
         "metadata": {"name": "run", "namespace": "team", "uid": "w-1"}}
NAN = RunFailure(650, "nan", "step 650: nan detected (not finite: actor/pg_loss)")


# --- when an incident opens --------------------------------------------------------------------------


def test_a_failure_opens_an_incident_at_once_without_confirm_steps():
    assert inc.confirmation(None, NAN, [], False, 0) == "open"
    assert inc.confirmation(None, None, [], False, 0) == "none"


def test_the_same_incident_never_opens_twice_whatever_the_signature():
    open_ = {"step": 650, "state": inc.S_DIAGNOSING, "after": None}
    assert inc.confirmation(open_, NAN, [], False, 0) == "none"  # a re-poll, a restart re-reading it
    assert inc.confirmation(open_, RunFailure(652, "overflow", "x"), [], False, 0) == "none"  # its 2nd signature
    closed = {**open_, "state": inc.S_FIXED}
    assert inc.confirmation(closed, NAN, [], False, 0) == "none"  # not past it
    assert inc.confirmation(closed, RunFailure(900, "nan", "x"), [], False, 0) == "open"  # a resumed run's next one
    assert inc.after_step(closed) == 650 and inc.after_step(open_) is None


def test_recovery_is_confirm_steps_clean_steps_after_the_detection():
    assert inc.confirmation(None, NAN, [False], False, 2) == "wait"
    assert inc.confirmation(None, NAN, [False, False], False, 2) == "recovered"
    assert inc.confirmation(None, NAN, [False, True], False, 2) == "open"
    assert inc.confirmation(None, NAN, [False], True, 2) == "open"  # the run ended before: it did not recover
    confirming = {"step": 650, "state": inc.S_CONFIRMING}
    assert inc.confirmation(confirming, NAN, [True], False, 2) == "open"
    assert inc.confirmation(confirming, RunFailure(700, "nan", "x"), [True], False, 2) == "none"


# --- the Diagnosis and its budget ------------------------------------------------------------------------


def test_the_plan_bisects_first_then_the_candidates_that_fit_in_order():
    p = inc.plan(8, ["bf16", "fp32", "lower-lr"], BudgetSpec(probes=9), 1, None)
    # 8 checkpoints: up to 6 probes; then baseline + bf16 (2 runs), + fp32 (3) -> 9; lower-lr would be 10
    assert (p.bisect, p.candidates, p.left_out, p.runs, p.refused) == (6, ("bf16", "fp32"), ("lower-lr",), 9, None)
    p = inc.plan(8, ["bf16"], BudgetSpec(probes=100, device_hours="4"), 1, 0.5)
    assert (p.candidates, p.device_hours) == (("bf16",), 4.0)  # 6 probes + 2 runs, 0.5 each
    assert inc.plan(8, ["bf16"], BudgetSpec(probes=100, device_hours="3.9"), 1, 0.5).left_out == ("bf16",)
    refused = inc.plan(64, ["bf16"], BudgetSpec(probes=5), 1, None)
    assert refused.refused and "needs up to 9 runs" in refused.refused and refused.candidates == ()


def test_a_diagnosis_past_its_budget_is_stopped():
    """Spent (what the finished runs cost) plus the planned hours of those still to run."""
    budget = BudgetSpec(probes=8, device_hours="4")
    assert inc.over_budget(budget, 8, 3.0, 2, 0.5) is None  # 3 + 2 x 0.5: the budget, not past it
    assert inc.over_budget(budget, 9, None, 0, None) == "stopped: 9 runs started, the budget is 8"
    assert inc.over_budget(BudgetSpec(probes=20, device_hours="4"), 9, 3.5, 2, 0.5) == (
        "stopped: 3.5 device-hours spent and 1 planned for the 2 run(s) still to run, the budget is 4")
    assert inc.over_budget(budget, 8, None, 2, 0.5) is None  # a run that cannot be priced: runs only


def _ran(phase: str, hours: str | None = None, **row) -> dict:
    return {"phase": phase, **({"deviceHours": hours} if hours is not None else {}), **row}


def test_spent_is_what_the_diagnosis_runs_cost_by_their_completed_steps():
    """Each finished run at the deviceHours its Diagnosis recorded (a probe stopped at its
    failure: its 1 step of 4, 0.25 of the 1 planned); one finished without a figure (a candidate
    at another precision) as planned; runs building, running or pending are still to run; one left
    out (NotRun) cost nothing."""
    st = {"phase": "Running",
          "probes": [_ran("Succeeded", "1", stepsCompleted=4), _ran("Succeeded", "0.25", stepsCompleted=1),
                     _ran("Running"), _ran("Building")],
          "baseline": {"runs": [_ran("Succeeded", "0.25", stepsCompleted=1)]},
          "candidates": [{"runs": [_ran("Succeeded", stepsCompleted=4)]}, {"runs": [_ran("Pending")]},
                         {"runs": [_ran("NotRun")]}]}
    assert inc.cost(st, 1.0) == inc.Cost(2.5, 3)  # 1 + 0.25 + 0.25 + 1 (unpriced: as planned); 3 to run
    assert inc.cost(st, None).hours is None  # the unpriced one, and no plan to price it by
    answer = inc.answer({"runHours": 1.0}, {"status": st})
    assert (answer["spentRuns"], answer["spentDeviceHours"]) == (6, 2.5)  # 6 started; 2.5, not 6 x 1 planned
    b = inc.budget_status(BudgetSpec(probes=20, device_hours="10"), answer["spentRuns"], answer["spentDeviceHours"])
    assert b == {"spent": {"runs": 6, "deviceHours": "2.5"}, "left": {"runs": 14, "deviceHours": "7.5"}}
    assert inc.over_budget(BudgetSpec(probes=20, device_hours="5"), 6, 2.5, 3, 1.0) == (
        "stopped: 2.5 device-hours spent and 3 planned for the 3 run(s) still to run, the budget is 5")


def test_a_bisections_probes_that_stopped_at_their_failure_cost_less_than_planned():
    """The incident's spent is the Diagnosis's own deviceHours (sizing.run_device_hours per probe),
    not the probes x the planned hours a run: the probes that reproduced ran 1 step of 4."""
    from .test_diagnosis_bisect import _bisect_in_rounds

    body, _, _ = _bisect_in_rounds(8, 5, 3, per_step="0.25", steps=4)
    st = body["status"]
    spent = inc.answer({"runHours": 1.0}, body)["spentDeviceHours"]
    assert spent == pytest.approx(float(st["deviceHours"])) and spent < 1.0 * len(st["probes"])
    assert inc.cost(st, 1.0).to_run == 0


def test_the_diagnosis_is_named_by_the_incident_owned_by_the_watch_and_linked_to_the_previous():
    f = parse_on_failure({"failOn": ["nan"], "budget": {"parallelism": 3}})
    p = inc.plan(4, f.candidates_for("nan"), f.budget, inc.SEEDS, None)
    d = inc.diagnosis_for(WATCH, f, NAN, 600, p, "run-incident-300")
    assert d["metadata"]["name"] == "run-incident-650" == inc.incident_name("run", 650)
    assert d["metadata"]["labels"][inc.LABEL_INCIDENT] == "650"
    assert d["metadata"]["annotations"][inc.ANNOTATION_PREVIOUS] == "run-incident-300"
    assert d["spec"]["checkpoints"] == {"watch": "run", "bad": 600}
    assert d["spec"]["failOn"] == {"signature": "nan"} and d["spec"]["parallelism"] == 3
    assert d["spec"]["candidates"] == [s for s in f.candidates_for("nan")][:len(p.candidates)]
    assert len(inc.incident_name("w" * 60, 123456)) <= 63
    assert inc.fail_on_of("actor/grad_norm>100:3") == {"signature": "threshold", "metric": "actor/grad_norm",
                                                      "operator": ">", "value": "100.0", "steps": 3}


def _diag(phase: str | None, reason: str | None = None, **status) -> dict:
    conditions = [{"type": "Complete", "status": "True", "reason": reason}] if reason else []
    return {"status": {"phase": phase, "conditions": conditions, **status}}


def test_what_the_diagnosis_says_is_the_incident_state():
    first = {"firstBad": {"step": 600, "checkpoint": "s3://ckpt/run/global_step_600"}}
    running = inc.answer({}, _diag("Running", probes=[{}, {}], **first))
    assert (running["state"], running["firstBad"], running["spentRuns"]) == (inc.S_DIAGNOSING, 600, 2)
    assert inc.answer({}, _diag("Complete", "FixFound", fixedBy="bf16,fp32", **first))["state"] == inc.S_FIXED
    assert inc.answer({}, _diag("Complete", "NoFix", **first))["state"] == inc.S_NO_FIX
    assert inc.answer({}, _diag("Complete", "FixWithOtherFailures", fixedWithOtherFailures="lower-lr", **first))[
        "state"] == inc.S_FIXED_BUT
    assert inc.answer({"leftOut": ["gspo"]}, _diag("Complete", "NoFix", **first))["state"] == inc.S_BUDGET_SPENT
    assert inc.answer({}, _diag("Complete", "NoneBad"))["state"] == inc.S_NONE_BAD
    assert inc.answer({}, _diag("Failed", message="probe failed"))["state"] == inc.S_DIAGNOSIS_FAILED
    assert inc.answer({"diagnosis": "run-incident-650"}, None) == {
        "state": inc.S_DIAGNOSIS_FAILED, "message": "Diagnosis run-incident-650 is gone"}


def test_events_follow_the_stages_once_each():
    seen = {"step": 650, "signature": "nan", "reason": "r", "state": inc.S_DIAGNOSING, "diagnosis": "run-incident-650"}
    assert [e[1] for e in inc.events(None, seen)] == ["FailureSeen", "IncidentDiagnosisStarted"]
    assert inc.events(seen, dict(seen)) == []  # a re-poll says nothing again
    found = {**seen, "firstBad": 600}
    assert [e[1] for e in inc.events(seen, found)] == ["FirstBadFound"]
    fixed = {**found, "state": inc.S_FIXED, "fixedBy": "bf16,fp32"}
    assert [(e[1], e[2]) for e in inc.events(found, fixed)] == [
        ("FixedBy", "nan at step 650; fails from checkpoint 600; fixed by bf16,fp32")]


def test_the_report_and_the_webhook_body():
    incident = {"step": 650, "signature": "nan", "reason": "r", "state": inc.S_FIXED, "firstBad": 600,
                "fixedBy": "bf16,fp32", "candidates": ["bf16", "fp32", "lower-lr"], "diagnosis": "run-incident-650",
                "budget": inc.budget_status(BudgetSpec(probes=20, device_hours="10"), 7, 3.5)}
    r = inc.report("run", "team", incident)
    assert {k: r[k] for k in ("failing_step", "signature", "first_bad", "fixed_by")} == {
        "failing_step": 650, "signature": "nan", "first_bad": 600, "fixed_by": ["bf16", "fp32"]}
    assert r["cost"] == {"runs": 7, "device_hours": "3.5", "left": {"runs": 13, "deviceHours": "6.5"}}
    assert "| first bad checkpoint | 600 |" in inc.report_md(r)
    body = inc.webhook_body(r)
    assert body["text"].startswith("moe-proxy team/run: nan at step 650; fails from checkpoint 600; fixed by")
    assert body["alerts"][0]["labels"]["alertname"] == "MoeProxyIncident" and body["status"] == "resolved"
    json.dumps(body)  # a JSON body as it is posted


# --- the spec --------------------------------------------------------------------------------------------


WATCH_SPEC = {"source": {"uri": "s3://ckpt/run"}, "template": {"spec": {"pruning": {"experts": 4}}}}


@pytest.mark.parametrize("extra, text", [
    ({"metrics": {"uri": "s3://ckpt/run/metrics.jsonl"}}, "come together"),
    ({"metrics": {"uri": "/local/metrics.jsonl"}, "onFailure": {"failOn": ["nan"]}}, "spec.metrics.uri"),
    ({"metrics": {"uri": "s3://ckpt/m"}, "onFailure": {"failOn": ["boom"]}}, "spec.onFailure.failOn[0]"),
    ({"metrics": {"uri": "s3://ckpt/m"}, "onFailure": {"failOn": ["nan"], "candidates": ["cure-all"]}}, "cure-all"),
    ({"metrics": {"uri": "s3://ckpt/m"}, "onFailure": {"failOn": ["nan"], "webhook": {"secretRef": {"name": "h"}}}},
     "secretRef"),
    ({"metrics": {"uri": "s3://ckpt/m"}, "onFailure": {"failOn": ["nan"], "budget": {"probes": 0}}}, "probes"),
])
def test_bad_loop_specs_are_refused_with_the_field(extra, text):
    with pytest.raises(InvalidWatch) as caught:
        parse_watch({**WATCH_SPEC, **extra})
    assert text in str(caught.value)


def test_a_loop_spec_reads_with_its_defaults():
    w = parse_watch({**WATCH_SPEC, "metrics": {"uri": "s3://ckpt/run/metrics.jsonl", "lastStep": 1000},
                     "onFailure": {"failOn": ["nan", "actor/grad_norm>100:3"],
                                   "webhook": {"secretRef": {"name": "hook", "key": "url"}}}})
    assert (w.metrics.uri, w.metrics.last_step, w.on_failure.fail_on) == (
        "s3://ckpt/run/metrics.jsonl", 1000, ("nan", "actor/grad_norm>100:3"))
    assert (w.on_failure.budget.probes, w.on_failure.budget.parallelism, w.on_failure.confirm_steps) == (20, 1, 0)
    assert w.on_failure.webhook_secret == ("hook", "url")
    from moe_proxy.investigate.catalogue import suggested
    assert w.on_failure.candidates_for("nan") == [s.name for s in suggested("nan")]  # the catalogue's table


# --- a bisection with candidates: on to them, on the first bad probe's ProxyModel --------------------------


def _drive(body: dict, bad_from: int) -> tuple[dict, dict]:
    made: dict[str, dict] = {}
    for _ in range(40):
        probe = in_flight(body["status"])
        child = _built(made[probe["proxyModel"]]) if probe and probe["proxyModel"] in made else None
        seen = {}
        if probe and probe.get("workload") in made:
            bad = probe["index"] >= bad_from
            seen[probe["workload"]] = Outcome(SUCCEEDED, report={"reproduced": bad, "signature": "nan" if bad else None,
                                                                 "step": 0 if bad else None, "steps_completed": 1})
        decision = progress(body, child, seen, Settings())
        body = _apply(body, decision)
        made.update({m["metadata"]["name"]: m for _, m in decision.create})
        if body["status"].get("candidatesOn") or body["status"].get("phase") == DIAGNOSED:
            return body, made
    raise AssertionError("the bisection did not finish")


def test_a_bisection_with_candidates_goes_on_to_them_on_the_first_bad_probes_proxymodel():
    listed = [{"step": 10 * (i + 1), "uri": f"s3://{BUCKET}/run/global_step_{10 * (i + 1)}/{HF}"} for i in range(4)]
    body = _body(candidates=["fp32", "lower-lr"], failOn={"signature": "nan"}, seeds=1)
    body = _apply(body, start({}, parse_bisection(body["spec"]), checkpoints_spec(f"s3://{BUCKET}/run"), listed, 1))
    body, made = _drive(body, bad_from=2)
    status = body["status"]
    assert status["phase"] == DIAGNOSING and status["firstBad"]["step"] == 30
    assert status["candidatesOn"] == {"proxyModel": "bx-step-30", "step": 30}
    running = next(c for c in status["conditions"] if c["type"] == "Running")
    assert running["reason"] == "TryingCandidates"
    # the matrix on that ProxyModel: no ProxyModel made again; the runs use its proxy
    matrix = {**body, "spec": candidates_spec(body["spec"], "bx-step-30")}
    decision = matrix_decide(matrix, _built(made["bx-step-30"]), {}, Settings())
    assert not any(r is PROXYMODELS for r, _ in decision.create)
    names = [m["metadata"]["name"] for _, m in decision.create]
    assert names and all(n.startswith("bx-") and "-step-" not in n for n in names)
    assert [r["name"] for r in decision.status["candidates"]] == ["fp32", "lower-lr"]
    args = decision.create[-1][1]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "s3://proxies/bx-step-30/" in args


def test_a_bisection_with_candidates_and_no_bad_checkpoint_ends_as_before():
    listed = [{"step": 10 * (i + 1), "uri": f"s3://{BUCKET}/run/global_step_{10 * (i + 1)}/{HF}"} for i in range(3)]
    body = _body(candidates=["fp32"], failOn={"signature": "nan"})
    body = _apply(body, start({}, parse_bisection(body["spec"]), checkpoints_spec(f"s3://{BUCKET}/run"), listed, 1))
    body, _ = _drive(body, bad_from=99)
    assert body["status"]["phase"] == DIAGNOSED and not body["status"].get("candidatesOn")


def _priced_matrix(plan: dict) -> dict:
    """The status of a matrix (baseline, fp32, lower-lr; one seed) on the first bad probe's
    ProxyModel whose status.plan is `plan`, once every run finished."""
    listed = [{"step": 10 * (i + 1), "uri": f"s3://{BUCKET}/run/global_step_{10 * (i + 1)}/{HF}"} for i in range(4)]
    body = _body(candidates=["fp32", "lower-lr"], failOn={"signature": "nan"}, seeds=1, steps=4)
    body = _apply(body, start({}, parse_bisection(body["spec"]), checkpoints_spec(f"s3://{BUCKET}/run"), listed, 1))
    body, made = _drive(body, bad_from=2)
    child = _built(made["bx-step-30"])
    child["status"]["plan"] = plan
    matrix = {**body, "spec": candidates_spec(body["spec"], "bx-step-30")}
    completed = {"baseline": 2, "fp32": 4, "lower-lr": 3}  # the baseline and lower-lr stop at their NaN
    for _ in range(6):
        seen = {r["workload"]: Outcome(SUCCEEDED, report={
                    "reproduced": row["name"] != "fp32", "signature": "nan", "step": completed[row["name"]] - 1,
                    "steps_completed": completed[row["name"]]})
                for row in [matrix["status"].get("baseline") or {"runs": []}, *matrix["status"].get("candidates", [])]
                for r in row["runs"] if r["phase"] == "Running"}
        matrix = _apply(matrix, matrix_decide(matrix, child, seen, Settings()))
    assert matrix["status"]["phase"] == DIAGNOSED
    return matrix["status"]


FP16_PLAN = {"precision": "fp16", "deviceHoursPerStep": {"total": {"original": "9", "proxy": "0.25"}}}


def test_the_candidates_runs_are_priced_as_the_probes_and_the_incident_spends_them():
    """A matrix run records deviceHours as a probe does (its ProxyModel's plan per step x the steps
    it completed); a candidate that changes the precision is priced by the plan's figure for that
    precision (status.plan.proxyDeviceHoursPerStep), and the incident spends it."""
    st = _priced_matrix({**FP16_PLAN, "proxyDeviceHoursPerStep": {"bf16": "0.25", "fp16": "0.25", "fp32": "0.4"}})
    assert st["proxyModel"]["price"] == {"deviceHoursPerStep": "0.25", "precision": "fp16",
                                         "byPrecision": {"bf16": "0.25", "fp16": "0.25", "fp32": "0.4"}}
    hours = {row["name"]: row["runs"][0]["deviceHours"] for row in [st["baseline"], *st["candidates"]]}
    assert hours == {"baseline": "0.5", "fp32": "1.6", "lower-lr": "0.75"}  # fp32: 4 steps x 0.4
    probes = sum(1 for p in st["probes"])  # the probes' ProxyModels had no plan: each as planned
    assert inc.cost(st, 1.0) == inc.Cost(probes * 1.0 + 0.5 + 1.6 + 0.75, 0)


def test_an_older_plan_leaves_a_candidate_at_another_precision_unpriced():
    """An older operator's plan has no price by precision: the fp32 candidate's run is not priced
    by the fp16 plan (null), and the incident counts it as planned."""
    st = _priced_matrix(FP16_PLAN)
    assert st["proxyModel"]["price"] == {"deviceHoursPerStep": "0.25", "precision": "fp16"}
    hours = {row["name"]: row["runs"][0]["deviceHours"] for row in [st["baseline"], *st["candidates"]]}
    assert hours == {"baseline": "0.5", "fp32": None, "lower-lr": "0.75"}
    probes = sum(1 for p in st["probes"])  # the probes' ProxyModels had no plan: each as planned
    assert inc.cost(st, 1.0) == inc.Cost(probes * 1.0 + 0.5 + 1.0 + 0.75, 0)
