"""The rows of a Diagnosis's status: one per variant (`status.baseline`, `status.candidates[]`),
each with one row per run (`runs`: seed, phase, workload name, and once finished what it
found), then the variant's phase, verdict and cost. Pure functions over those dicts.

A run's row says Running, with its deterministic workload name, before its workload is
created: a restarted operator finds every workload it made, and one recorded but missing is
created again under the same name (diagnosis_matrix), so there is never a second workload for
a run. Verdicts and costs are the CLI's (`moe_proxy.investigate.diagnose`: `verdict`, `cost_of`,
`against`), so the cluster judges exactly as `moe-proxy diagnose` does.
"""

from __future__ import annotations

from moe_proxy.investigate.diagnose import (NOT_RUN, SeedRun, against, cost_of, cost_window, findings, left_out_note,
                                            verdict)
from moe_proxy.errors import InvalidOptions
from moe_proxy.metrics.verdict import series_rows
from moe_proxy.sizing import run_device_hours

from .outcome import COULD_NOT_JUDGE, FAILED as OUTCOME_FAILED, Outcome, cannot_show

# A run's phase.
RUN_PENDING, RUN_RUNNING, RUN_DONE, RUN_ERROR = "Pending", "Running", "Succeeded", "Failed"
RUN_NOT_RUN = "NotRun"  # a candidate's run left out: the baseline reproduced on no seed, or (stop_early) the
# candidate reproduced on another seed
FINISHED = (RUN_DONE, RUN_ERROR, RUN_NOT_RUN)


# --- the rows in status -----------------------------------------------------------------------------


def run_rows(status: dict) -> list[dict]:
    """Every run row of status: the baseline's, then each candidate's."""
    out = list((status.get("baseline") or {}).get("runs") or [])
    for c in status.get("candidates") or []:
        out += c.get("runs") or []
    return out


def recorded_running(status: dict) -> list[str]:
    """The workloads status records as running (a matrix's runs, a bisection's probe): what the
    handler looks at."""
    return [r["workload"] for r in run_rows(status) + list(status.get("probes") or []) if r.get("phase") == RUN_RUNNING]


def refused_create(status: dict, workload: str, message: str) -> dict:
    """The status patch of a run whose workload the API server refused: the run errored."""
    out = {}
    base = dict(status.get("baseline") or {})
    cands = [dict(c) for c in status.get("candidates") or []]
    for row in [base, *cands]:
        row["runs"] = [{**r, "phase": RUN_ERROR, "reproduced": None, "message": f"not created: {message}"[:512]}
                       if r.get("workload") == workload else r for r in row.get("runs") or []]
    out.update(baseline=base, candidates=cands)
    return out


# --- a run's outcome ------------------------------------------------------------------------------------


def seed_run(row: dict) -> SeedRun:
    """A finished run's row as the CLI's SeedRun (reproduced None: it failed to run)."""
    return SeedRun(row.get("reproduced"), row.get("signature"), row.get("step"), int(row.get("stepsCompleted") or 0),
                   row.get("stopped") or "", dict(row.get("otherFailures") or {}), error=row.get("message"))


def finished_row(row: dict, seen: Outcome, steps: int, fail_on: str | None = None) -> dict:
    """A run's row once its workload has an outcome. The termination message carries the
    verdict (reproduced, signature, step) and the other failures seen (`also_seen`, kept as
    otherFailures: the verdict reports them); a run that did not reproduce counts as having run
    all `steps` unless the message says how many it completed (`steps_completed`). A run whose
    metrics cannot show `fail_on` is judged as the CLI judges it: as one that failed (`could not
    judge: ...`), neither clean nor cured nor reproduced; its steps completed price it."""
    report = seen.report
    if seen.state == OUTCOME_FAILED or "reproduced" not in report:
        message = (f"{seen.reason}: {seen.message}" if seen.state == OUTCOME_FAILED
                   else "finished without a termination message; see its logs")
        return {**row, "phase": RUN_ERROR, "reproduced": None, "signature": None, "step": None,
                "message": message.strip(": ")[:512]}
    reproduced = bool(report.get("reproduced"))
    completed = report.get("steps_completed")
    if not isinstance(completed, int):
        completed = (report.get("step") or 0) + 1 if reproduced else steps
    if why := cannot_show(report, fail_on):
        return {**row, "phase": RUN_ERROR, "reproduced": None, "signature": None, "step": None,
                "stepsCompleted": completed, "message": f"{COULD_NOT_JUDGE}: {why}"[:512]}
    return {**row, "phase": RUN_DONE, "reproduced": reproduced, "signature": report.get("signature") if reproduced
            else None, "step": report.get("step") if reproduced else None, "stepsCompleted": completed,
            **({"stopped": str(report["stopped"])} if report.get("stopped") else {}), "message": None,
            **({"otherFailures": others} if (others := _other_failures(report)) else {}),
            # its metrics step by step, kept until its variant's cost is worked out
            **({"series": report["series"]} if isinstance(report.get("series"), dict) else {})}


def could_not_judge(row: dict) -> bool:
    """A finished run's row is one whose metrics could not show the failure asked for."""
    return row.get("phase") == RUN_ERROR and str(row.get("message")).startswith(COULD_NOT_JUDGE)


def _other_failures(report: dict) -> dict[str, int]:
    """A termination message's also_seen (failure -> onset step), what is well-formed of it."""
    seen = report.get("also_seen")
    return {str(k): v for k, v in seen.items() if isinstance(v, int)} if isinstance(seen, dict) else {}


def said(row: dict) -> str:
    """A finished run's row in words (its RunFinished event)."""
    if row["phase"] == RUN_ERROR:
        return row["message"] if could_not_judge(row) else f"error: {row.get('message')}"
    others = "".join(f"; {name} at step {step}" for name, step in (row.get("otherFailures") or {}).items())
    if row.get("reproduced"):
        return f"{row['signature']} at step {row['step']}{others}"
    return f"not reproduced in {row.get('stepsCompleted')} steps{others}"


# --- what a run cost (sizing.RUN_COST_RULE) ------------------------------------------------------------


def plan_price(proxymodel: dict) -> dict:
    """What a run on this ProxyModel is priced by: its plan's device-hours per RL step
    (status.plan.deviceHoursPerStep.total.proxy: the proxy's devices x its step's time), the
    precision the plan priced it at, and the per step at each precision a run could take
    (status.plan.proxyDeviceHoursPerStep, when an operator wrote it); {} without a plan."""
    plan = (proxymodel.get("status") or {}).get("plan") or {}
    per_step = ((plan.get("deviceHoursPerStep") or {}).get("total") or {}).get("proxy")
    if per_step is None:
        return {}
    by_precision = plan.get("proxyDeviceHoursPerStep")
    return {"deviceHoursPerStep": per_step, "precision": plan.get("precision"),
            **({"byPrecision": dict(by_precision)} if isinstance(by_precision, dict) and by_precision else {})}


def run_hours(price: dict, steps_completed: int, precision: str | None = None) -> str | None:
    """A finished run's device-hours by sizing.run_device_hours: `price`'s per step (plan_price) at
    the precision it ran at x the steps it completed. A run at another `precision` than the plan's
    (a candidate that changes it) is priced by the plan's figure for that precision
    (`byPrecision`); None: no price, or none for that precision (an older operator's plan)."""
    per_step = price.get("deviceHoursPerStep")
    if precision is not None and precision != price.get("precision"):
        per_step = (price.get("byPrecision") or {}).get(precision)
    try:
        return f"{run_device_hours(float(per_step), steps_completed):.4g}"
    except (TypeError, ValueError, InvalidOptions):
        return None


# --- a variant's phase, verdict and cost ----------------------------------------------------------------


def row_phase(row: dict) -> str:
    """A variant's phase from its runs'."""
    phases = [r["phase"] for r in row["runs"]]
    if all(p == RUN_NOT_RUN for p in phases):
        return RUN_NOT_RUN
    if all(p in FINISHED for p in phases):
        return RUN_DONE
    return RUN_RUNNING if any(p != RUN_PENDING for p in phases) else RUN_PENDING


def any_reproduced(row: dict) -> bool:
    """The variant reproduced the failure on some seed."""
    return any(r.get("reproduced") for r in row["runs"])


def seed_runs(row: dict) -> dict[int, SeedRun]:
    """A variant's runs as the CLI's verdict reads them, by seed (not those left out)."""
    return {r["seed"]: seed_run(r) for r in row["runs"] if r["phase"] != RUN_NOT_RUN}


def stop_early(cands: list[dict]) -> list[tuple[str, dict, bool]]:
    """A candidate that changes something and reproduced on one seed is reproduced whatever its
    other seeds do (the CLI's diagnose without --all-seeds): its pending runs are left out (`not
    run: reproduced on seed N`) and its running ones stopped (`stopped: ...`), in place. Returns
    each run left out now as (candidate, its row, whether it was running: its workload goes).
    Never the baseline's runs (its onsets decide what is judged), nor a no-change candidate's
    (the method's own check)."""
    out = []
    for row in cands:
        hit = next((r["seed"] for r in row["runs"] if r["phase"] == RUN_DONE and r.get("reproduced")), None)
        if hit is None or not (row.get("changes") or row.get("env")):
            continue
        runs = []
        for r in row["runs"]:
            if r["phase"] in (RUN_PENDING, RUN_RUNNING):
                running = r["phase"] == RUN_RUNNING
                r = {**r, "phase": RUN_NOT_RUN, "reproduced": None,
                     "message": f"{'stopped' if running else 'not run'}: reproduced on seed {hit}"}
                out.append((row["name"], r, running))
            runs.append(r)
        row["runs"] = runs
    return out


def variant_cost(row: dict, window: tuple[int, int], baseline: dict | None = None) -> dict:
    """`moe-proxy diagnose`'s cost of a variant (diagnose.cost_of, diagnose.against) from its
    runs' series; the row's runs lose their series (status keeps the figures only). Each run is
    a workload of its own: time per step is kept."""
    c = cost_of([series_rows(r.get("series")) for r in row["runs"]], window)
    row["runs"] = [{k: v for k, v in r.items() if k != "series"} for r in row["runs"]]
    return against(c, baseline) if baseline is not None else c


def judge_baseline(base: dict, fail_on: str | None, steps: int) -> None:
    """The baseline's verdict once every run finished: error (on every seed), or reproduced or not
    with where (and the CLI's findings); its cost, once, up to its first onset (as diagnose.judge)."""
    runs = seed_runs(base)
    if all(r["phase"] == RUN_ERROR for r in base["runs"]):
        base["verdict"] = "error"
        base["note"] = "; ".join(f"seed {r['seed']}: {r.get('message')}" for r in base["runs"])[:1024]
    else:
        hits = [f"seed {r['seed']} step {r['step']}" for r in base["runs"] if r.get("reproduced")]
        base["verdict"] = "reproduced" if hits else "not reproduced"
        # a seed that failed or could not judge is said: "no X" holds for the others only
        unjudged = [f"seed {r['seed']}: {r.get('message')}" for r in base["runs"] if r["phase"] == RUN_ERROR]
        base["note"] = "; ".join([", ".join(hits) if hits else f"no {fail_on} in {steps} steps",
                                  *findings(runs, steps), *unjudged])[:1024]
    if base.get("cost") is None:
        base["cost"] = variant_cost(base, cost_window(runs, steps))


def judge_candidate(row: dict, base: dict, steps: int) -> None:
    """A finished candidate's verdict against the judged baseline (the CLI's rule), and its cost
    over the baseline's window, relative to the baseline's."""
    own_steps = (row.get("changes") or {}).get("steps") or steps  # a candidate changing them: judged on its own
    changed = bool(row.get("changes") or row.get("env"))
    row["verdict"], row["note"] = verdict(seed_runs(base), seed_runs(row), own_steps, changed)
    row["note"] += left_out_note({r["seed"]: r["message"] for r in row["runs"] if r["phase"] == RUN_NOT_RUN})
    window = (base["cost"]["window_first"], base["cost"]["window_last"])
    row["cost"] = variant_cost(row, window, base["cost"])


def not_run(cands: list[dict], why: str) -> None:
    """The baseline reproduced on no seed: the candidates' runs are left out, said in their rows."""
    for row in cands:
        row["runs"] = [{**r, "phase": RUN_NOT_RUN} if r["phase"] == RUN_PENDING else r for r in row["runs"]]
        if not row.get("verdict"):
            row["verdict"], row["note"] = NOT_RUN, f"the baseline did not reproduce ({why})"[:1024]
