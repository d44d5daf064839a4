"""The watched run's incidents, as pure functions (issue 43): when a failure of the run's metrics
opens an incident, the one Diagnosis that answers it (bisect the run's complete checkpoints up to
the failing step, then the candidates on the first bad one's proxy) within a budget, what its
status means for the incident, and the answer as report.json / report.md / a webhook body.
The kopf timer (watched_run.py) does the I/O around them.

Status is the single source of truth: `status.incident` of the CheckpointWatch is the current
incident (`status.incidents`: the earlier ones, newest last), and its Diagnosis has a name made
from the watch and the failing step, so an operator restart, a re-poll or a second signature of
the same incident finds the Diagnosis it made and never makes another.

Rules (docs/checkpointwatch.md, "The watched run"):
- An incident opens on the earliest watched failure past the last incident's step (a resumed
  run's new failure comes after it), once confirmed: at once with confirmSteps 0, else when one of
  the confirmSteps steps logged after its detection shows it again, or the run ends first.
- Recovered: the run logged confirmSteps steps after the detection and none shows the failure
  (each passes the detector's own per-step test for that signature). No Diagnosis.
- NoCheckpoint: no complete checkpoint at or before the failing step; TooFewCheckpoints: one
  (a bisection needs two). No Diagnosis.
- BudgetSpent: the bisection alone needs more runs (or device-hours) than the budget holds (no
  Diagnosis), or candidates were left out for the budget and none of those tried cures it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moe_proxy.metrics.detect import SIGNATURES, Signature

from .diagnosis_bisect import BUILDING
from .diagnosis_rows import RUN_NOT_RUN, RUN_PENDING, RUN_RUNNING
from .loop_spec import BudgetSpec, OnFailureSpec
from .resources import DIAGNOSES, GROUP, LABEL_ROLE
from .watch_decisions import LABEL_WATCH, short_name, watch_label

LABEL_INCIDENT = f"{GROUP}/incident"  # on the Diagnosis: the failing step of its incident
ANNOTATION_PREVIOUS = f"{GROUP}/previous-incident"  # the incident before it (a resumed run's)
ANNOTATION_SIGNATURE = f"{GROUP}/signature"
INCIDENT_ROLE = "incident"
# incident states: open ones, then the answers
S_CONFIRMING, S_DIAGNOSING = "Confirming", "Diagnosing"
S_RECOVERED, S_NO_CHECKPOINT, S_TOO_FEW = "Recovered", "NoCheckpoint", "TooFewCheckpoints"
S_FIXED, S_NO_FIX, S_NONE_BAD, S_NOT_REPRODUCED = "Fixed", "NoFix", "NoneBad", "NotReproduced"
S_BUDGET_SPENT, S_DIAGNOSIS_FAILED = "BudgetSpent", "DiagnosisFailed"
S_FIXED_BUT = "FixedWithOtherFailures"  # only cures that trade the failure for another (the matrix's fixed-but)
OPEN_STATES = (S_CONFIRMING, S_DIAGNOSING)
MAX_HISTORY = 10  # status.incidents kept


def incident_name(watch: str, step: int) -> str:
    """The incident's Diagnosis: `<watch>-incident-<step>` (cut with a hash to 63 characters)."""
    return short_name(watch, f"-incident-{step}")


def is_open(incident: dict | None) -> bool:
    return bool(incident) and incident.get("state") in OPEN_STATES


def after_step(incident: dict | None) -> int | None:
    """The steps a run's watcher skips: up to the last closed incident's failing step."""
    if not incident:
        return None
    return incident.get("after") if is_open(incident) else incident.get("step")


def confirmation(incident: dict | None, failure, hits_after: list[bool], finished: bool, confirm_steps: int) -> str:
    """What a failure means now: "none" (no failure, or the current incident's), "wait" (not
    confirmed yet), "recovered" or "open"."""
    if failure is None:
        return "none"
    if incident and incident.get("state") != S_CONFIRMING and (is_open(incident) or failure.step <= incident["step"]):
        return "none"
    if incident and incident.get("state") == S_CONFIRMING and failure.step != incident["step"]:
        return "none"  # a watcher that re-read from another point: the recorded one stands
    if confirm_steps == 0 or any(hits_after[:confirm_steps]):
        return "open"
    if len(hits_after) >= confirm_steps:
        return "recovered"
    return "open" if finished else "wait"


def fail_on_of(signature: str) -> dict:
    """A --fail-on string as a Diagnosis's spec.failOn."""
    if signature in SIGNATURES:
        return {"signature": signature}
    s = Signature.parse(signature)
    return {"signature": "threshold", "metric": s.metric, "operator": s.op, "value": repr(s.value),
            "steps": s.patience}


def bisect_probes(n: int) -> int:
    """The most probes a bisection of n checkpoints makes (the CLI's: log2(n) + 3, at most n)."""
    return min(n, math.ceil(math.log2(n)) + 3) if n > 1 else n


@dataclass(frozen=True)
class Plan:
    """What an incident's Diagnosis may run within its budget."""

    bisect: int  # probes of the bisection, at most
    candidates: tuple[str, ...]  # the candidates tried, in order
    left_out: tuple[str, ...]  # those the budget left out
    runs: int  # runs at most: the bisection's, then (baseline + candidates) x seeds
    device_hours: float | None  # at most, as the plan prices a run (None: not priced)
    refused: str | None = None  # why nothing fits (BudgetSpent)


def plan(n: int, candidates: list[str], budget: BudgetSpec, seeds: int, run_hours: float | None) -> Plan:
    """The bisection first, then the candidates that fit, in order (each with the baseline's
    seeds: the matrix reruns the failing run as its baseline)."""
    probes = bisect_probes(n)

    def fits(runs: int) -> bool:
        hours_ok = budget.hours is None or run_hours is None or runs * run_hours <= budget.hours
        return runs <= budget.probes and hours_ok

    if not fits(probes):
        need = f"{probes} runs" + (f" ({probes * run_hours:.3g} device-hours)" if run_hours else "")
        return Plan(probes, (), tuple(candidates), probes, None, f"the bisection of {n} checkpoints needs up to "
                    f"{need}; the budget is {budget.probes} runs" + (f", {budget.device_hours} device-hours"
                                                                       if budget.hours is not None else ""))
    kept: list[str] = []
    for c in candidates:  # in order: stop at the first that does not fit
        if not fits(probes + (len(kept) + 2) * seeds):
            break
        kept.append(c)
    runs = probes + ((len(kept) + 1) * seeds if kept else 0)
    return Plan(probes, tuple(kept), tuple(candidates[len(kept):]), runs,
                runs * run_hours if run_hours is not None else None)


def diagnosis_for(watch_body: dict, on_failure: OnFailureSpec, failure, bad_step: int, p: Plan,
                  previous: str | None) -> dict:
    """The incident's Diagnosis: a bisection over the watch's checkpoints up to `bad_step` (the
    newest complete one at or before the failing step), then the plan's candidates on the first
    bad probe's ProxyModel; owned by the watch, labelled with the incident."""
    watch = watch_body["metadata"]["name"]
    spec = {"checkpoints": {"watch": watch, "bad": bad_step}, "failOn": fail_on_of(failure.signature),
            "seeds": SEEDS, "parallelism": on_failure.budget.parallelism}
    if p.candidates:
        spec["candidates"] = list(p.candidates)
    annotations = {ANNOTATION_SIGNATURE: failure.signature[:256]}
    if previous:
        annotations[ANNOTATION_PREVIOUS] = previous
    return {"apiVersion": DIAGNOSES.api_version, "kind": DIAGNOSES.kind,
            "metadata": {"name": incident_name(watch, failure.step), "namespace": watch_body["metadata"]["namespace"],
                         "labels": {LABEL_WATCH: watch_label(watch), LABEL_INCIDENT: str(failure.step),
                                    LABEL_ROLE: INCIDENT_ROLE},
                         "annotations": annotations},
            "spec": spec}


SEEDS = 1  # seeds per candidate (and of the matrix's baseline) in an incident's Diagnosis


def spent(diagnosis_status: dict) -> int:
    """Runs the Diagnosis started: its probes, and its matrix's runs past Pending."""
    probes = len(diagnosis_status.get("probes") or [])
    return probes + sum(1 for run in _matrix_runs(diagnosis_status)
                        if run.get("phase") not in (None, RUN_PENDING, RUN_NOT_RUN))


def _matrix_runs(diagnosis_status: dict) -> list[dict]:
    rows = [diagnosis_status.get("baseline") or {}, *(diagnosis_status.get("candidates") or [])]
    return [run for r in rows for run in r.get("runs") or []]


@dataclass(frozen=True)
class Cost:
    """What a Diagnosis's runs have cost, and what is still to run."""

    hours: float | None  # the finished runs, by sizing.RUN_COST_RULE (None: one cannot be priced)
    to_run: int  # runs building, running or pending: priced as planned until they finish


def cost(diagnosis_status: dict, run_hours: float | None) -> Cost:
    """The finished runs by the one run-cost rule (sizing.run_device_hours): each at the
    deviceHours its Diagnosis recorded (a probe's or a matrix run's: its plan's device-hours per
    step x the steps it completed, so one stopped at its failure costs less than planned). One
    finished without it (failed to run, a candidate at a precision its plan did not price, an
    older operator's) at
    the planned `run_hours`: what it may have cost."""
    hours, unpriced, to_run = 0.0, 0, 0
    for run in [*(diagnosis_status.get("probes") or []), *_matrix_runs(diagnosis_status)]:
        phase = run.get("phase")
        if phase in (None, RUN_PENDING, RUN_RUNNING, BUILDING):
            to_run += 1
        elif phase != RUN_NOT_RUN:
            try:
                hours += float(run["deviceHours"])
            except (KeyError, TypeError, ValueError):
                unpriced += 1
    if unpriced and run_hours is None:
        return Cost(None, to_run)
    return Cost(hours + unpriced * (run_hours or 0.0), to_run)


def over_budget(budget: BudgetSpec, runs: int, spent_hours: float | None, to_run: int,
                run_hours: float | None) -> str | None:
    """Why a running Diagnosis must stop: it started more runs than the budget holds (a bisection
    stepping around inconclusive probes, or a non-monotone run, probes past log2(n) + 3), or what
    its runs cost (`spent_hours`, cost's) and the planned hours of those still to run pass
    deviceHours. None: within the budget."""
    if runs > budget.probes:
        return f"stopped: {runs} runs started, the budget is {budget.probes}"
    if budget.hours is None or spent_hours is None:
        return None
    ahead = to_run * run_hours if run_hours is not None else 0.0
    if float(f"{spent_hours + ahead:.4g}") > budget.hours:  # at the figures' own precision (each is .4g)
        return (f"stopped: {spent_hours:.4g} device-hours spent and {ahead:.4g} planned for the {to_run} run(s) "
                f"still to run, the budget is {budget.device_hours}")
    return None


def budget_status(budget: BudgetSpec, runs: int, spent_hours: float | None) -> dict:
    """status.incident.budget: spent (runs started; device-hours of those finished, cost's) and left."""
    left = None if budget.hours is None or spent_hours is None else f"{max(0.0, budget.hours - spent_hours):.4g}"
    return {"spent": {"runs": runs, "deviceHours": None if spent_hours is None else f"{spent_hours:.4g}"},
            "left": {"runs": max(0, budget.probes - runs), "deviceHours": left}}


# --- what the Diagnosis says, for the incident ---------------------------------------------------------


def _condition(status: dict, kind: str) -> dict:
    return next((c for c in status.get("conditions") or [] if c.get("type") == kind), {})


def answer(incident: dict, diagnosis: dict | None) -> dict:
    """The incident as its Diagnosis has it now: state, firstBad, fixedBy (the fields that change)."""
    if diagnosis is None:  # deleted (by hand: the watch made it): no answer will come
        return {"state": S_DIAGNOSIS_FAILED, "message": f"Diagnosis {incident.get('diagnosis')} is gone"}
    st = diagnosis.get("status") or {}
    first = (st.get("firstBad") or {}).get("step")
    out = {"firstBad": first, "firstBadCheckpoint": (st.get("firstBad") or {}).get("checkpoint"),
           "fixedBy": st.get("fixedBy") or None, "fixedWithOtherFailures": st.get("fixedWithOtherFailures") or None,
           "spentRuns": spent(st), "spentDeviceHours": cost(st, incident.get("runHours")).hours,
           # the CheckpointWatch's own ProxyModels its probes used (proxy_key), not built again
           "reusedProxyModels": sorted({p["reused"] for p in st.get("probes") or [] if p.get("reused")}) or None}
    if st.get("phase") == "Failed":
        return out | {"state": S_DIAGNOSIS_FAILED, "message": (st.get("message") or "")[:512]}
    if st.get("phase") != "Complete":
        return out | {"state": S_DIAGNOSING}
    reason = _condition(st, "Complete").get("reason")
    left_out = incident.get("leftOut") or []
    if st.get("fixedBy"):
        state = S_FIXED
    elif st.get("fixedWithOtherFailures"):
        state = S_FIXED_BUT
    elif reason == "NoneBad":
        state = S_NONE_BAD
    elif reason == "BaselineNotReproduced":
        state = S_NOT_REPRODUCED
    elif left_out:
        state = S_BUDGET_SPENT
    else:
        state = S_NO_FIX
    return out | {"state": state, "message": (st.get("message") or "")[:512]}


def said(incident: dict) -> str:
    """One line: what the team reads first (status message, Event, webhook text)."""
    step, sig, state = incident.get("step"), incident.get("signature"), incident.get("state")
    head = f"{sig} at step {step}"
    first = incident.get("firstBad")
    where = f"; fails from checkpoint {first}" if first is not None else ""
    if state == S_FIXED:
        return f"{head}{where}; fixed by {incident['fixedBy']}" + (
            f" (not tried for the budget: {', '.join(incident['leftOut'])})" if incident.get("leftOut") else "")
    texts = {
        S_CONFIRMING: f"{head}: waiting for {incident.get('confirmSteps')} more step(s) to confirm it",
        S_DIAGNOSING: f"{head}{where}: Diagnosis {incident.get('diagnosis')} running",
        S_RECOVERED: f"{head}: the run recovered by itself (the next {incident.get('confirmSteps')} step(s) are clean)",
        S_NO_CHECKPOINT: f"{head}: no complete checkpoint at or before it: nothing to bisect",
        S_TOO_FEW: f"{head}: one complete checkpoint at or before it ({incident.get('checkpoints')}): a bisection "
                 "needs two",
        S_NO_FIX: f"{head}{where}; nothing cures it (tried: {', '.join(incident.get('candidates') or []) or 'none'})",
        S_NONE_BAD: f"{head}: no checkpoint's proxy reproduces it",
        S_FIXED_BUT: f"{head}{where}; cured only with other failures by {incident.get('fixedWithOtherFailures')}",
        S_NOT_REPRODUCED: f"{head}{where}; the first bad checkpoint's failing run did not reproduce it again: no "
                        "candidate was judged",
        S_BUDGET_SPENT: f"{head}{where}: budget spent" + (f" ({incident['budgetRefused']})"
                                                        if incident.get("budgetRefused") else
                                                        f"; not tried: {', '.join(incident.get('leftOut') or [])}"),
        S_DIAGNOSIS_FAILED: f"{head}{where}: Diagnosis {incident.get('diagnosis')} failed: {incident.get('message')}",
    }
    return texts.get(state, f"{head}: {state}")


STAGE_EVENTS = {  # incident state -> (Event type, reason) said when the incident reaches it
    S_DIAGNOSING: ("Normal", "IncidentDiagnosisStarted"), S_RECOVERED: ("Normal", "RunRecovered"),
    S_NO_CHECKPOINT: ("Warning", "NoCompleteCheckpoint"), S_TOO_FEW: ("Warning", "TooFewCheckpoints"),
    S_FIXED: ("Normal", "FixedBy"), S_NO_FIX: ("Warning", "NothingCures"),
    S_FIXED_BUT: ("Warning", "FixedWithOtherFailures"), S_NONE_BAD: ("Warning", "NoneBad"),
    S_NOT_REPRODUCED: ("Warning", "NotReproduced"), S_BUDGET_SPENT: ("Warning", "BudgetSpent"),
    S_DIAGNOSIS_FAILED: ("Warning", "DiagnosisFailed"),
}


def events(before: dict | None, after: dict) -> list[tuple[str, str, str]]:
    """The Events of the stages an incident reached between two polls (status is the truth)."""
    out = []
    new = not before or before.get("step") != after.get("step")
    if new:
        out.append(("Warning", "FailureSeen", f"{after['signature']} at step {after['step']}: {after.get('reason')}"
                    [:1024]))
    if after.get("firstBad") is not None and (new or before.get("firstBad") is None):
        out.append(("Normal", "FirstBadFound", f"incident at step {after['step']}: first bad checkpoint "
                    f"{after['firstBad']} ({after.get('firstBadCheckpoint')})"))
    if (new or before.get("state") != after.get("state")) and after.get("state") in STAGE_EVENTS:
        kind, reason = STAGE_EVENTS[after["state"]]
        out.append((kind, reason, said(after)[:1024]))
    return out


# --- the answer, where the team looks --------------------------------------------------------------------


def names(listed: str | None) -> list[str]:
    """A Diagnosis's comma-separated candidate names (fixedBy), as a list."""
    return [c.strip() for c in (listed or "").split(",") if c.strip()]


def report(watch: str, namespace: str, incident: dict) -> dict:
    """report.json: at least failing_step, signature, first_bad, fixed_by, cost."""
    return {"watch": watch, "namespace": namespace, "incident": incident.get("diagnosis"),
            "state": incident.get("state"), "summary": said(incident),
            "failing_step": incident.get("step"), "signature": incident.get("signature"),
            "reason": incident.get("reason"), "first_bad": incident.get("firstBad"),
            "first_bad_checkpoint": incident.get("firstBadCheckpoint"),
            "fixed_by": names(incident.get("fixedBy")),
            "fixed_with_other_failures": names(incident.get("fixedWithOtherFailures")),
            "candidates": incident.get("candidates") or [], "left_out_for_budget": incident.get("leftOut") or [],
            "previous_incident": incident.get("previous"),
            "reused_proxy_models": incident.get("reusedProxyModels") or [],
            "cost": {"runs": (incident.get("budget") or {}).get("spent", {}).get("runs"),
                     "device_hours": (incident.get("budget") or {}).get("spent", {}).get("deviceHours"),
                     "left": (incident.get("budget") or {}).get("left")}}


def report_md(r: dict) -> str:
    rows = [("failing step", r["failing_step"]), ("signature", r["signature"]), ("state", r["state"]),
            ("first bad checkpoint", r["first_bad"] if r["first_bad"] is not None else "-"),
            ("fixed by", ", ".join(r["fixed_by"]) or "-"),
            ("fixed, but with other failures", ", ".join(r["fixed_with_other_failures"]) or "-"),
            ("candidates tried", ", ".join(r["candidates"]) or "-"),
            ("not tried (budget)", ", ".join(r["left_out_for_budget"]) or "-"),
            ("cost", f"{r['cost']['runs']} run(s), {r['cost']['device_hours'] or 'unpriced'} device-hours"),
            ("proxies reused from the watch", ", ".join(r["reused_proxy_models"]) or "-"),
            ("Diagnosis", r["incident"] or "-"), ("previous incident", r["previous_incident"] or "-")]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    return (f"# {r['watch']}: {r['signature']} at step {r['failing_step']}\n\n{r['summary']}\n\n"
            f"| | |\n|---|---|\n{table}\n\nWhat the detector saw: {r['reason']}\n")


def webhook_body(r: dict) -> dict:
    """Slack's incoming webhooks read `text`; Alertmanager-style receivers read `alerts`."""
    resolved = r["state"] in (S_FIXED, S_RECOVERED)
    return {"text": f"moe-proxy {r['namespace']}/{r['watch']}: {r['summary']}",
            "version": "4", "status": "resolved" if resolved else "firing",
            "alerts": [{"status": "resolved" if resolved else "firing",
                        "labels": {"alertname": "MoeProxyIncident", "namespace": r["namespace"], "watch": r["watch"],
                                   "signature": r["signature"], "state": r["state"]},
                        "annotations": {"summary": r["summary"], "failing_step": str(r["failing_step"]),
                                        "first_bad": str(r["first_bad"]), "fixed_by": ",".join(r["fixed_by"])}}],
            "report": r}
