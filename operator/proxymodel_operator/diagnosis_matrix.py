"""What a matrix Diagnosis does next, as pure functions (`decide`): which runs start now, what a
finished run says, each candidate's verdict, and the status that records it all. The kopf timer
(diagnosis.py) does the I/O around them, as checkpoint_watch.py does for watch_decisions.py.

A Diagnosis is `moe-proxy diagnose` on the cluster: the failing run of a Ready ProxyModel (the
baseline: its reproduction, as its spec and plan say) and the same run with each candidate fix,
on every seed (diagnosis_runs). Candidates come from the CLI's catalogue
(`moe_proxy.investigate.catalogue`) and verdicts from its rule (diagnosis_rows), so the cluster
judges exactly as the CLI does.

Status is the single source of truth: every run has a row with its deterministic workload name,
and a run's row says Running *before* its workload is created (`DiagnosisDecision.create` comes
after its `status` is written). A restarted operator therefore finds every workload it made; one
recorded but missing (the operator stopped between the two writes) is created again under the
same name, so there is never a second workload for a run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from moe_proxy.investigate.diagnose import FIXED, FIXED_BUT

from .diagnosis_baseline import changes as baseline_changes
from .diagnosis_spec import DiagnosisSpec, InvalidDiagnosis, parse_diagnosis
from .diagnosis_rows import (COULD_NOT_JUDGE, FINISHED, RUN_DONE, RUN_ERROR, RUN_PENDING, RUN_RUNNING, any_reproduced,
                             could_not_judge, finished_row, judge_baseline, judge_candidate, not_run, recorded_running,
                             row_phase, run_hours, run_rows, said, stop_early)
from .diagnosis_runs import (Baseline, NotYet, RunVariant, baseline_of, changes, run_manifest, run_name,
                             variants)
from .diagnosis_status import (COMPLETE_CONDITION, DIAGNOSED, DIAGNOSING, DIAGNOSIS_FAILED, FAILED_CONDITION,
                               RUNNING_CONDITION, WAITING_FOR_PROXY, DiagnosisDecision, condition_changed, refused,
                               set_condition)
from .outcome import RUNNING as OUTCOME_RUNNING, Outcome
from .reproduction import name_reserve
from .resources import SERVICES
from .runtimes import RUNTIMES
from .settings import Settings
from .status import ACCEPTED


def decide(body: dict, proxymodel: dict | None, seen: dict[str, Outcome], settings: Settings) -> DiagnosisDecision:
    """From the Diagnosis as read, its ProxyModel (None: absent) and the outcomes of the recorded
    running workloads that exist (`seen`, by name), what to write and create now."""
    meta, status = body["metadata"], dict(body.get("status") or {})
    name, namespace, generation = meta["name"], meta["namespace"], meta.get("generation") or 1
    started = bool((status.get("baseline") or {}).get("runs"))
    if started and status.get("observedGeneration") != generation:
        # The matrix is fixed once its runs are recorded: a later spec is not run (said once).
        message = (f"spec changed (generation {generation}) after the runs started: this Diagnosis goes on with the "
                   "matrix in status; create another Diagnosis for the new spec")
        return DiagnosisDecision({"observedGeneration": generation}, [], [("Warning", "SpecChangeIgnored", message)])
    if status.get("phase") in (DIAGNOSED, DIAGNOSIS_FAILED) and status.get("observedGeneration") == generation:
        return DiagnosisDecision()
    try:
        d = parse_diagnosis(dict(body.get("spec") or {}))
    except InvalidDiagnosis as exc:
        return refused(status, generation, exc.reason, str(exc), temporary=False)
    if not started:  # the ProxyModel decides when
        try:
            baseline = baseline_of(d, proxymodel, namespace, settings)
        except InvalidDiagnosis as exc:
            return refused(status, generation, exc.reason, str(exc), temporary=False)
        except NotYet as exc:
            if exc.failed:
                return refused(status, generation, exc.reason, str(exc), temporary=False)
            out = refused(status, generation, exc.reason, str(exc), temporary=True) \
                if exc.reason == "ProxyModelNotFound" else _waiting(status, generation, str(exc))
            return out
        return _start(status, d, baseline, name, namespace, generation, meta)
    return _progress(status, d, proxymodel, seen, name, namespace, generation, settings)


def _waiting(status: dict, generation: int, message: str) -> DiagnosisDecision:
    out = DiagnosisDecision()
    s = out.status
    s.update(observedGeneration=generation, phase=WAITING_FOR_PROXY, message=message)
    set_condition(status, s, ACCEPTED, True, "SpecValid", "the candidates and the ProxyModel can be diagnosed",
                  generation)
    set_condition(status, s, RUNNING_CONDITION, False, "WaitingForProxy", message, generation)
    if condition_changed(status, RUNNING_CONDITION, False, "WaitingForProxy"):
        out.events.append(("Normal", "WaitingForProxy", message))
    return out


def _start(status: dict, d: DiagnosisSpec, baseline: Baseline, name: str, namespace: str, generation: int,
           meta: dict) -> DiagnosisDecision:
    """The matrix, every run Pending, then the first `parallelism` runs."""
    seeds = list(range(baseline.seeds_from, baseline.seeds_from + d.seeds))
    rows = []
    try:
        changed = {v.name: changes(baseline, v) for v in variants(d, baseline)}
    except InvalidDiagnosis as exc:
        return refused(status, generation, exc.reason, str(exc), temporary=False)
    for v in variants(d, baseline):
        runs = [{"seed": s, "phase": RUN_PENDING,
                 "workload": run_name(name, v.name, s, name_reserve(baseline.spec, baseline.devices))} for s in seeds]
        rows.append({"name": v.name, "args": list(v.args), **({"env": list(v.env)} if v.env else {}), "what": v.what,
                     "changes": changed[v.name], "phase": RUN_PENDING, "verdict": None, "note": None, "runs": runs})
    r = baseline.spec.reproduction
    started = {
        "observedGeneration": generation, "message": None,
        # the pinned baseline: what every run is made from (a later change starts no run: _wind_down)
        "proxyModel": {"name": d.proxy_model, **baseline.pinned, "uri": baseline.proxy_uri, "runtime": r.runtime,
                       "devices": baseline.devices, "failOn": d.fail_on,
                       # each finished run priced by it, as a bisection's probes (diagnosis_rows.run_hours)
                       **({"price": baseline.price} if baseline.price else {})},
        "failOn": r.fail_on.cli(), "steps": baseline.steps, "seeds": seeds, "parallelism": d.parallelism,
        "allSeeds": d.all_seeds,
        "baseline": rows[0], "candidates": rows[1:], "fixedBy": None,
    }
    set_condition(status, started, ACCEPTED, True, "SpecValid", f"{len(rows) - 1} candidate(s) x {len(seeds)} seed(s) "
                  f"on ProxyModel {d.proxy_model}'s proxy", generation)
    out = DiagnosisDecision(events=[("Normal", "DiagnosisStarted",
                            f"{len(rows) * len(seeds)} runs of {baseline.steps} steps ({r.fail_on.cli()}) on "
                            f"{baseline.devices} x {r.accelerator.resource} each, {d.parallelism} at a time")])
    return _advance({**status, **started}, started, d, baseline, name, namespace, generation, {}, out)


def _progress(status: dict, d: DiagnosisSpec, proxymodel: dict | None, seen: dict[str, Outcome], name: str,
              namespace: str, generation: int, settings: Settings) -> DiagnosisDecision:
    """Record the runs that finished, start the next ones, judge what can be judged."""
    out = DiagnosisDecision()
    recorded = status.get("proxyModel") or {}
    # the settings the matrix was made with (a later spec is not run)
    d = replace(d, proxy_model=recorded.get("name") or d.proxy_model, fail_on=recorded.get("failOn"),
                steps=status.get("steps") or d.steps, parallelism=status.get("parallelism") or d.parallelism)
    baseline = None
    to_create = any(r.get("phase") == RUN_PENDING for r in run_rows(status)) or \
        any(w not in seen for w in recorded_running(status))
    changed = status.get("baselineChanged") or (
        to_create and proxymodel is not None and "; ".join(baseline_changes(recorded, proxymodel)))
    if changed:
        return _wind_down(status, d, name, namespace, generation, seen, changed)
    if to_create:
        try:  # runs are still to be created: the ProxyModel gives their manifests
            baseline = baseline_of(d, proxymodel, namespace, settings)
        except (NotYet, InvalidDiagnosis) as exc:
            message = f"runs are left to start, but {exc}"
            s = out.status
            s.update(phase=DIAGNOSIS_FAILED, message=message[:1024])
            set_condition(status, s, FAILED_CONDITION, True, "ProxyModelLost", message, generation)
            set_condition(status, s, RUNNING_CONDITION, False, "ProxyModelLost", message, generation)
            out.events.append(("Warning", "ProxyModelLost", message))
            return out
    return _advance(status, {}, d, baseline, name, namespace, generation, seen, out)


def _wind_down(status: dict, d: DiagnosisSpec, name: str, namespace: str, generation: int, seen: dict[str, Outcome],
               changed: str) -> DiagnosisDecision:
    """The ProxyModel is no longer the pinned baseline: no new run starts (a run recorded but never
    created goes back to Pending), the running ones are followed to their end and judged as
    usual, then the Diagnosis fails with BaselineChanged. Said once, when first seen."""
    out = DiagnosisDecision()
    message = f"ProxyModel {d.proxy_model} changed after the runs started: {changed}. No new run starts"
    if not status.get("baselineChanged"):
        out.events.append(("Warning", "BaselineChanged", message))
    held = {**status, **_unstarted(status, seen)}
    out = _advance(held, {}, d, None, name, namespace, generation, seen, out)
    s = out.status
    s["baselineChanged"] = changed
    if s.get("phase") != DIAGNOSING:
        return out  # nothing was left to run after all (the verdicts say why)
    if s["running"]:
        s["message"] = f"{message}; waiting for the {s['running']} running to finish"[:1024]
        set_condition(status, s, RUNNING_CONDITION, True, "BaselineChanged", s["message"], generation)
    else:
        s["phase"] = DIAGNOSIS_FAILED
        s["message"] = (f"{message}; the runs that finished are in status: create another Diagnosis for the new "
                        "baseline")[:1024]
        set_condition(status, s, RUNNING_CONDITION, False, "BaselineChanged", s["message"], generation)
        set_condition(status, s, FAILED_CONDITION, True, "BaselineChanged", s["message"], generation)
    return out


def _unstarted(status: dict, seen: dict[str, Outcome]) -> dict:
    """The rows with each run recorded as running but without a workload set back to Pending."""
    def row(r: dict) -> dict:
        runs = [{**run, "phase": RUN_PENDING} if run["phase"] == RUN_RUNNING and run["workload"] not in seen else run
                for run in r["runs"]]
        return {**r, "runs": runs}
    return {"baseline": row(status["baseline"]), "candidates": [row(c) for c in status.get("candidates") or []]}


@dataclass(frozen=True)
class RunMaker:
    """What this tick makes a run's workload from: the Diagnosis, its ProxyModel and baseline
    (None: no run can be made now), and each variant as status recorded it."""

    diagnosis: str
    namespace: str
    generation: int
    proxy_model: str
    baseline: Baseline | None
    variants: dict[str, RunVariant]

    def make(self, out: DiagnosisDecision, variant: str, seed: int) -> dict:
        """Queue the run's workload (after its headless Service, if it has one) in `out.create`;
        the workload's manifest."""
        resource, manifest, service = run_manifest(self.diagnosis, self.namespace, self.generation, self.baseline,
                                                   self.variants[variant], seed, self.proxy_model)
        out.create += ([(SERVICES, service)] if service else []) + [(resource, manifest)]
        return manifest


def _advance(status: dict, patch: dict, d: DiagnosisSpec, baseline: Baseline | None, name: str, namespace: str,
             generation: int, seen: dict[str, Outcome], out: DiagnosisDecision) -> DiagnosisDecision:
    """One step of the matrix: follow the running runs, start the next ones, judge what can be
    judged, and say where the Diagnosis stands. `patch` is what this tick writes already (over
    `status`); it ends up in `out.status`."""
    base = dict(patch.get("baseline") or status["baseline"])
    cands = [dict(c) for c in patch.get("candidates") or status.get("candidates") or []]
    steps = int(status.get("steps") or (baseline.steps if baseline else 0))
    # what each variant's runs add: as recorded when the matrix was made
    variants_by_name = {row["name"]: RunVariant(row["name"], tuple(row.get("args") or ()), tuple(row.get("env") or ()))
                        for row in [base, *cands]}
    maker = RunMaker(name, namespace, generation, d.proxy_model, baseline, variants_by_name)
    price = (status.get("proxyModel") or {}).get("price") or {}
    running = _follow([base, *cands], seen, steps, maker, price, out, status.get("failOn"))
    if not status.get("allSeeds", d.all_seeds):
        running -= _stop_early(status, cands, out)
    running = _start_next(base, cands, running, d.parallelism, maker, out)
    _judge(base, cands, status.get("failOn"), steps, out)
    _conclude(status, patch, base, cands, running, steps, generation, out)
    out.status.update(patch)
    return out


def _follow(variant_rows: list[dict], seen: dict[str, Outcome], steps: int, maker: RunMaker, price: dict,
            out: DiagnosisDecision, fail_on: str | None = None) -> int:
    """Record the runs that finished, each with its deviceHours (by sizing.RUN_COST_RULE, as a
    probe's: `price`, the pinned plan's, at the run's precision x its steps completed; a candidate
    at another precision is priced by the plan's figure for it, unpriced only where an older
    operator's plan has none); a run that cannot show `fail_on` (status.failOn, the --fail-on its runs were
    given) could not judge (finished_row). Create again a run recorded as running whose workload
    is not there (the operator stopped before creating it). How many run now."""
    running = 0
    for row in variant_rows:
        runs = [dict(r) for r in row["runs"]]
        for i, run in enumerate(runs):
            if run["phase"] != RUN_RUNNING:
                continue
            outcome = seen.get(run["workload"])
            if outcome is None:  # recorded, not there: the operator stopped before creating it
                maker.make(out, row["name"], run["seed"])
                running += 1
            elif outcome.state == OUTCOME_RUNNING:
                running += 1
            else:
                runs[i] = finished_row(run, outcome, steps, fail_on)
                if "stepsCompleted" in runs[i]:  # it ran (one that could not judge too): priced
                    runs[i]["deviceHours"] = run_hours(price, runs[i]["stepsCompleted"],
                                                       (row.get("changes") or {}).get("precision"))
                out.events.append(("Normal" if runs[i]["phase"] == RUN_DONE else "Warning", "RunFinished",
                                   f"{row['name']} seed {run['seed']}: {said(runs[i])}"))
        row["runs"] = runs
    return running


def _stop_early(status: dict, cands: list[dict], out: DiagnosisDecision) -> int:
    """stop_early's runs, each said once: the running ones' workloads deleted (after status says
    NotRun, so a restarted operator never makes them again). How many of them were running."""
    left_out = stop_early(cands)
    resource = RUNTIMES[(status.get("proxyModel") or {}).get("runtime") or "Job"].resource
    for name, run, running in left_out:
        if running:
            out.delete.append((resource, run["workload"]))
        out.events.append(("Normal", "RunStopped" if running else "RunSkipped",
                           f"{name} seed {run['seed']}: {run['message']}"))
    return sum(running for _, _, running in left_out)


def _start_next(base: dict, cands: list[dict], running: int, parallelism: int, maker: RunMaker,
                out: DiagnosisDecision) -> int:
    """Start the next runs, the baseline's first, at most `parallelism` running; a candidate's only
    once the baseline reproduced on some seed (nothing to cure otherwise, as the CLI). How many
    run now."""
    base_reproduced = any_reproduced(base)
    for row in [base, *cands]:
        for run in row["runs"]:
            if run["phase"] == RUN_PENDING and running < parallelism and maker.baseline is not None \
                    and (row is base or base_reproduced):
                manifest = maker.make(out, row["name"], run["seed"])
                run["phase"] = RUN_RUNNING
                run["workload"] = manifest["metadata"]["name"]
                out.events.append(("Normal", "RunCreated", f"{manifest['kind']} {run['workload']}: {row['name']} "
                                   f"seed {run['seed']}"))
                running += 1
    return running


def _judge(base: dict, cands: list[dict], fail_on: str | None, steps: int, out: DiagnosisDecision) -> None:
    """Each variant's phase, and its verdict once it can have one: the baseline's when its runs
    are done; then each candidate's when its own are (none run if the baseline never reproduced)."""
    base_done = all(r["phase"] in (RUN_DONE, RUN_ERROR) for r in base["runs"])
    base["phase"] = row_phase(base)
    if base_done:
        judge_baseline(base, fail_on, steps)
        if not any_reproduced(base):
            not_run(cands, base["note"])
    for row in cands:
        row["phase"] = row_phase(row)
        if base_done and row["phase"] == RUN_DONE and not row.get("verdict"):
            judge_candidate(row, base, steps)
            out.events.append(("Warning" if row["verdict"] == FIXED_BUT else "Normal", "CandidateJudged",
                               f"{row['name']}: {row['verdict']} ({row['note']})"[:1024]))


def _conclude(status: dict, s: dict, base: dict, cands: list[dict], running: int, steps: int, generation: int,
              out: DiagnosisDecision) -> None:
    """Into `s`: the rows, the tally, and the Diagnosis's phase and conditions (Complete or Failed
    once every run finished, with why)."""
    all_runs = [r for row in [base, *cands] for r in row["runs"]]
    done = sum(r["phase"] in FINISHED for r in all_runs)
    fixed = [c["name"] for c in cands if c.get("verdict") == FIXED]
    fixed_but = [c["name"] for c in cands if c.get("verdict") == FIXED_BUT]
    s.update(baseline=base, candidates=cands, progress=f"{done}/{len(all_runs)}", done=done, total=len(all_runs),
             fixedBy=", ".join(fixed) or None, fixedWithOtherFailures=", ".join(fixed_but) or None, running=running)
    if done < len(all_runs):
        s["phase"] = DIAGNOSING
        message = f"{done}/{len(all_runs)} runs done, {running} running"
        set_condition(status, s, RUNNING_CONDITION, True, "RunsInProgress", message, generation)
    elif base.get("verdict") == "error":
        # every seed failed, or could not show the failure asked for (the CLI's BaselineFailed either way)
        what = COULD_NOT_JUDGE if all(map(could_not_judge, base["runs"])) else "failed to run"
        s["phase"], s["message"] = DIAGNOSIS_FAILED, f"the baseline {what} on every seed: {base['note']}"[:1024]
        set_condition(status, s, RUNNING_CONDITION, False, "Finished", "every run finished", generation)
        set_condition(status, s, FAILED_CONDITION, True, "BaselineFailed", s["message"], generation)
        out.events.append(("Warning", "BaselineFailed", s["message"]))
    elif not any_reproduced(base):
        s["phase"] = DIAGNOSED
        s["message"] = (f"the baseline did not reproduce {status.get('failOn')} on any seed in {steps} steps "
                        f"({base['note']}): nothing to cure, no candidate was run")[:1024]
        set_condition(status, s, RUNNING_CONDITION, False, "Finished", "the baseline's runs finished", generation)
        set_condition(status, s, COMPLETE_CONDITION, True, "BaselineNotReproduced", s["message"], generation)
        out.events.append(("Warning", "BaselineNotReproduced", s["message"]))
    else:
        s["phase"] = DIAGNOSED
        summary = "; ".join([f"fixed by: {', '.join(fixed)}" if fixed else "no candidate fixed it",
                           *([f"fixed, but with other failures: {', '.join(fixed_but)}"] if fixed_but else [])])
        s["message"] = summary
        reason = "FixFound" if fixed else "FixWithOtherFailures" if fixed_but else "NoFix"
        set_condition(status, s, RUNNING_CONDITION, False, "Finished", "every run finished", generation)
        set_condition(status, s, COMPLETE_CONDITION, True, reason, summary, generation)
        out.events.append(("Warning" if reason == "FixWithOtherFailures" else "Normal", "DiagnosisComplete", summary))
