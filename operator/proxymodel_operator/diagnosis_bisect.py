"""A Diagnosis's bisection mode (spec.checkpoints), as pure functions: `moe-proxy bisect` on the
cluster. The kopf timer (diagnosis.py) lists the run's checkpoints once and reads the probe in
flight; these functions say what to write and create.

A probe is the CLI's: the proxy of one checkpoint (a ProxyModel child `<diagnosis>-step-<N>`
made from the template as a CheckpointWatch makes its own, its reproduction off) and one
reproduction run from it (`diagnosis_runs.run_manifest`, the workload a candidate run is,
judged by the same `finished_row`). Which checkpoint comes next, and what the probes say in the
end, are `moe_proxy.investigate.bisect.next_round` and `findings`: the CLI's search rule itself, and
a probe's run is judged by its `judge_probe` (a run stopped early by another failure, NaN say, is
inconclusive, never clean: the search steps around it and status.inconclusive names it). One
seed per probe (the CLI's --seeds is not yet the Diagnosis's). spec.parallelism probes a round
(the CLI's --parallel): the range left is cut in parallelism + 1 parts, the round's ProxyModels
and runs go side by side, and the next round waits for all of them (each depends on the last's
results); 1 is one at a time, the CLI's order. status.rounds, searchRounds and deviceHours say
what it took: each probe's run priced as the CLI's bisect and triage price theirs
(sizing.run_device_hours: its ProxyModel's plan, at the reproduction's precision, per RL step x
the steps the run completed; a run stopped at its failure costs the steps it ran).

A CheckpointWatch's ProxyModel of the same content key (proxy_key: the same checkpoint, rewritten or
not, and the same build) serves as the probe's, when it is built or building: the row says
`reused: <name>`, an Event ProbeReused says so, and nothing is created (nor owned: the watch's
retention keeps a ProxyModel an unfinished Diagnosis names, watch_decisions.decide). One that
fails before its proxy is built, or goes, is replaced by the probe's own.

Status is the single source of truth, as for the matrix: the listed checkpoints and the spec
they were listed with (`status.bisection`) are fixed once recorded, and a probe's row says
Building (with its ProxyModel's name) before the ProxyModel is created, Running (with its
workload's name) before the run is. A restarted operator finds both; one recorded but missing
is created again under the same name.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

from moe_proxy.investigate.bisect import PROBE_STATES, Probe, findings, judge_probe, next_round

from .diagnosis_rows import (RUN_DONE, RUN_ERROR, RUN_RUNNING, could_not_judge, finished_row, plan_price, run_hours,
                             seed_run)
from .diagnosis_runs import LABEL_DIAGNOSIS, NotYet, RunVariant, baseline_of, proxy_built, run_manifest
from .proxy_key import key_of
from .diagnosis_status import (COMPLETE_CONDITION, DIAGNOSED, DIAGNOSING, DIAGNOSIS_FAILED, DIAGNOSIS_PENDING,
                               FAILED_CONDITION, RUNNING_CONDITION, DiagnosisDecision, condition_changed, refused,
                               set_condition)
from .diagnosis_spec import BisectSpec, DiagnosisSpec, InvalidDiagnosis, parse_bisection  # (parse_bisection: diagnosis.py reads it here)
from .outcome import RUNNING as OUTCOME_RUNNING, Outcome
from .resources import LABEL_ROLE, PROXYMODELS, SERVICES
from .settings import Settings
from .status import ACCEPTED
from .watch_decisions import ACTIVE_PHASES, LABEL_WATCH, proxymodel_for
from .watch_spec import InvalidWatch, WatchSpec, parse_watch

BUILDING = "Building"  # a probe's phase while its ProxyModel builds the proxy
PROBE_ROLE = "bisection-probe"  # the probe ProxyModels' moeproxy.io/role


def is_bisection(spec: dict) -> bool:
    return spec.get("checkpoints") is not None


def watch_spec(raw: dict, where: str, settings: Settings) -> WatchSpec:
    """The checkpoints' source, pattern and ProxyModel template, read as a CheckpointWatch's
    spec is (its own checks: an s3:// prefix, a template that makes a valid ProxyModel)."""
    try:
        return parse_watch(raw, settings)
    except InvalidWatch as exc:
        raise InvalidDiagnosis("InvalidSpec", f"{where}: {exc}") from None


# --- the decisions ------------------------------------------------------------------------------


def start(status: dict, b: BisectSpec, raw: dict, checkpoints: list[dict], generation: int) -> DiagnosisDecision:
    """The listing is in (`checkpoints`: [{step, uri}] in step order, within good..bad): record
    it with the spec it was made from; the first probe comes on the next tick."""
    n = len(checkpoints)
    runtime = (((raw.get("template") or {}).get("spec") or {}).get("reproduction") or {}).get("runtime") or "Job"
    started = {"observedGeneration": generation, "phase": DIAGNOSING, "message": None,
               "proxyModel": {"runtime": runtime},  # where the runs' workloads are (diagnosis.observe)
               "bisection": {"watch": b.watch, "spec": raw, "good": b.good, "bad": b.bad, "failOn": b.fail_on,
                             "steps": b.steps, "checkpoints": checkpoints, "parallelism": b.parallelism},
               "probes": [], "firstBad": None, "monotone": None, "progress": f"0 probed of {n}", "done": 0,
               "total": n}
    # one at a time: the last, the halves, both boundary neighbours; P a round: the range cut in P + 1 parts
    said = (f"{n} checkpoints, steps {checkpoints[0]['step']}..{checkpoints[-1]['step']}: " + (
        f"at most {math.ceil(math.log2(n)) + 3} probes, one at a time" if b.parallelism == 1 else
        f"{b.parallelism} probes a round, about {math.ceil(math.log(n, b.parallelism + 1))} search rounds"))
    set_condition(status, started, ACCEPTED, True, "SpecValid", said, generation)
    set_condition(status, started, RUNNING_CONDITION, True, "Bisecting", said, generation)
    return DiagnosisDecision(started, [], [("Normal", "BisectionStarted", said)])


def probe_proxymodel(body: dict, raw: dict, checkpoint: dict, settings: Settings) -> dict:
    """The ProxyModel of a probe: the template's, as a CheckpointWatch makes it (name
    `<diagnosis>-step-<N>`, the source with the checkpoint's URI, the content key), owned by the
    Diagnosis, labelled as its probe, its own reproduction off (the Diagnosis runs it), dead
    experts filling a count a collapsed router leaves short (spec.pruning.fillDead)."""
    manifest = proxymodel_for(body, watch_spec(raw, "spec.checkpoints", settings), checkpoint["step"],
                              checkpoint["uri"], checkpoint.get("fingerprint"), settings)
    labels = manifest["metadata"]["labels"]
    labels.pop(LABEL_WATCH, None)
    labels.update({LABEL_DIAGNOSIS: body["metadata"]["name"], LABEL_ROLE: PROBE_ROLE})
    spec = manifest["spec"]
    spec["reproduction"] = {**(spec.get("reproduction") or {}), "enabled": False}
    # as the CLI's probes: a collapsed checkpoint (fewer alive experts than the count) still builds
    spec["pruning"] = {**(spec.get("pruning") or {}), "fillDead": True}
    queue = (body.get("spec") or {}).get("queueName")
    if queue:  # the Diagnosis's Kueue queue over the template's, for the probe's build
        spec["queueName"] = queue
    return manifest


def reusable(proxymodels: list[dict]) -> dict[str, dict]:
    """The ProxyModels a probe uses instead of building its own, by content key (proxy_key): a
    CheckpointWatch's, not being deleted, its proxy built or still building (waiting for it costs
    less than a second build of the same proxy). A failed one is not: the probe builds its own."""
    out: dict[str, dict] = {}
    for pm in proxymodels:
        meta = pm.get("metadata") or {}
        phase, key, built = (pm.get("status") or {}).get("phase"), key_of(pm), proxy_built(pm)
        if (LABEL_WATCH in (meta.get("labels") or {}) and key and not meta.get("deletionTimestamp")
                and (built or phase in ACTIVE_PHASES)):
            if key not in out or built:  # a built one before one still building
                out[key] = pm
    return out


def in_flight(status: dict) -> dict | None:
    """The first probe being built or run, if any (flying: all of them)."""
    return next(iter(flying(status)), None)


def flying(status: dict) -> list[dict]:
    """The probes being built or run: a round's, side by side."""
    return [p for p in status.get("probes") or [] if p.get("phase") in (BUILDING, RUN_RUNNING)]


def progress(body: dict, child: dict | None, seen: dict[str, Outcome], settings: Settings,
             children: dict[str, dict | None] | None = None, found: dict[str, dict] | None = None
             ) -> DiagnosisDecision:
    """From the Diagnosis, the ProxyModels of the probes in flight (`children`, by name, None:
    absent; or `child`, the one probe's when one is in flight) and the outcomes of their runs
    (`seen`, by workload name): what to write and create now. A round's probes (next_round, the
    spec's parallelism of them) are made together; the next round comes when all have finished.
    `found`: the ProxyModels to reuse by content key (`reusable`), read before a round."""
    meta, status = body["metadata"], dict(body.get("status") or {})
    generation = meta.get("generation") or 1
    rec = status["bisection"]
    checkpoints, out = rec["checkpoints"], DiagnosisDecision()
    probes = [dict(p) for p in status.get("probes") or []]
    current = flying({"probes": probes})
    if children is None:
        children = {current[0]["proxyModel"]: child} if current else {}
    for p in current:
        if failed := _advance_probe(p, body, rec, children.get(p["proxyModel"]), seen, settings, out):
            return _failed(status, probes, p, failed, generation, out)
    if not flying({"probes": probes}):
        done = {p["index"]: p["reproduced"] for p in probes}  # None: inconclusive, stepped around
        nxt = next_round(len(checkpoints), done, rec.get("good") is not None, rec.get("parallelism") or 1)
        if not nxt.probes:
            complete = _complete(status, probes, checkpoints, nxt.first_bad, generation, out,
                                 bool((body.get("spec") or {}).get("candidates")))
            complete.status.update(round_figures(probes))
            return complete
        number = max((p.get("round") or 0 for p in probes), default=0) + 1
        for index in nxt.probes:
            _make_probe(body, rec, checkpoints[index], index, number, nxt.kind, probes, settings, out, found or {})
    done = sum(p["phase"] == RUN_DONE for p in probes)
    out.status.update(probes=probes, done=done, progress=f"{done} probed of {len(checkpoints)}", phase=DIAGNOSING,
                      **round_figures(probes))
    current = flying({"probes": probes})
    said = (f"round {current[0].get('round') or len(probes)}: " + ", ".join(
        f"step {p['step']} {p['phase'].lower()}" for p in current)) if current else "between probes"
    set_condition(status, out.status, RUNNING_CONDITION, True, "Bisecting", said, generation)
    return out


def _make_probe(body: dict, rec: dict, c: dict, index: int, number: int, kind: str, probes: list[dict],
                settings: Settings, out: DiagnosisDecision, found: dict[str, dict]) -> None:
    """A probe of round `number`: its row (Building, its ProxyModel's name) and its ProxyModel, or
    the row of a CheckpointWatch's ProxyModel of the same content key (`found`), used as it is."""
    row = {"index": index, "checkpoint": c["uri"], "step": c["step"], "phase": BUILDING, "proxyModel": None,
           "workload": None, "reproduced": None, "signature": None, "onset": None, "round": number, "roundKind": kind}
    manifest = probe_proxymodel(body, rec["spec"], c, settings)
    same = found.get(key_of(manifest)) if c.get("fingerprint") else None  # unknown identity: never reused
    if same is not None:
        row["proxyModel"] = row["reused"] = same["metadata"]["name"]
        probes.append(row)
        watch = same["metadata"]["labels"][LABEL_WATCH]
        out.events.append(("Normal", "ProbeReused", f"probe {len(probes)} (round {number}): step {c['step']} "
                           f"({c['uri']}): reuses ProxyModel {row['proxyModel']} of CheckpointWatch {watch} "
                           f"(the same checkpoint and build: content key {key_of(manifest)})"))
        return
    row["proxyModel"] = manifest["metadata"]["name"]
    probes.append(row)
    out.create.append((PROXYMODELS, manifest))
    out.events.append(("Normal", "ProbeCreated", f"probe {len(probes)} (round {number}): step {c['step']} "
                       f"({c['uri']}): ProxyModel {row['proxyModel']}"))


def round_figures(probes: list[dict]) -> dict:
    """status's rounds (of probes side by side), searchRounds (those cutting the range) and
    deviceHours (every finished probe's run by sizing.RUN_COST_RULE, _device_hours; None until
    one is known)."""
    rounds = {p.get("round") or n for n, p in enumerate(probes, 1)}
    search = {p.get("round") for p in probes if p.get("roundKind") == "search"}
    hours = [float(p["deviceHours"]) for p in probes if p.get("deviceHours") is not None]
    return {"rounds": len(rounds), "searchRounds": len(search), "deviceHours": f"{sum(hours):.4g}" if hours else None}


def _device_hours(child: dict, steps_completed: int) -> str | None:
    """A finished probe's run by sizing.RUN_COST_RULE: its ProxyModel's plan
    (deviceHoursPerStep.total.proxy: the proxy's devices x its RL step's time, at the
    reproduction's precision) x the steps the run completed. None without a plan."""
    return run_hours(plan_price(child), steps_completed)


def _advance_probe(p: dict, body: dict, rec: dict, child: dict | None, seen: dict[str, Outcome],
                   settings: Settings, out: DiagnosisDecision) -> str | None:
    """Move the probe in flight on (in place); the message of a probe that cannot finish."""
    meta = body["metadata"]
    name, namespace, generation = meta["name"], meta["namespace"], meta.get("generation") or 1
    checkpoint = {"step": p["step"], "uri": p["checkpoint"], "fingerprint": _fingerprint(rec, p["step"])}
    if child is None:  # recorded, not there: the operator stopped before creating it (or it was deleted)
        if p["phase"] == RUN_RUNNING:
            return f"ProxyModel {p['proxyModel']} of probe step {p['step']} is gone"
        if p.get("reused"):
            return _build_own(p, body, rec, checkpoint, settings, out, "is gone")
        out.create.append((PROXYMODELS, probe_proxymodel(body, rec["spec"], checkpoint, settings)))
        return None
    d = DiagnosisSpec(p["proxyModel"], (), rec.get("failOn"), steps=rec.get("steps"))
    if p["phase"] == BUILDING:
        if not proxy_built(child):
            state = child.get("status") or {}
            if state.get("phase") == "Failed" and p.get("reused"):
                return _build_own(p, body, rec, checkpoint, settings, out, "failed")
            if state.get("phase") == "Failed":
                return f"ProxyModel {p['proxyModel']} failed: {state.get('message') or 'see its conditions'}"
            return None
    try:
        baseline = baseline_of(d, child, namespace, settings)
    except (NotYet, InvalidDiagnosis) as exc:
        return f"probe step {p['step']}: {exc}"
    variant = RunVariant(f"step-{p['step']}", ())
    if p["phase"] == BUILDING:
        resource, manifest, service = run_manifest(name, namespace, generation, baseline, variant,
                                                   baseline.seeds_from, p["proxyModel"])
        p.update(phase=RUN_RUNNING, workload=manifest["metadata"]["name"], seed=baseline.seeds_from)
        out.create += ([(SERVICES, service)] if service else []) + [(resource, manifest)]
        out.events.append(("Normal", "RunCreated", f"{manifest['kind']} {p['workload']}: probe step {p['step']}"))
        return None
    outcome = seen.get(p["workload"])
    if outcome is None:  # recorded, not there: created again under its name
        resource, manifest, service = run_manifest(name, namespace, generation, baseline, variant, p["seed"],
                                                   p["proxyModel"])
        out.create += ([(SERVICES, service)] if service else []) + [(resource, manifest)]
        return None
    if outcome.state == OUTCOME_RUNNING:
        return None
    row = finished_row({}, outcome, baseline.steps, baseline.spec.reproduction.fail_on.cli())
    return _judge(p, row, child, out)


def _judge(p: dict, row: dict, child: dict, out: DiagnosisDecision) -> str | None:
    """A probe whose run finished (its row): judged in place; the message of one that cannot say."""
    if could_not_judge(row):
        # its metrics cannot show the failure asked for: never a clean checkpoint. Its one seed judged
        # nothing, so the probe failed (the CLI's bisect stops so too), and every probe's proxy keeps the
        # template's experts: the next would say the same
        p.update(reproduced=None, state=PROBE_STATES[None], note=row["message"], stepsCompleted=row["stepsCompleted"],
                 deviceHours=_device_hours(child, row["stepsCompleted"]))
        return f"probe step {p['step']}: {row['message']}"
    if row["phase"] == RUN_ERROR:
        return f"the run of probe step {p['step']} failed: {row['message']}"
    # the CLI's rule for a probe: a run stopped early by another failure (NaN) cannot say clean
    reproduced, note = judge_probe({p["seed"]: seed_run(row)})
    p.update(phase=RUN_DONE, reproduced=reproduced, state=PROBE_STATES[reproduced], note=note or None,
             signature=row["signature"], onset=row["step"], stepsCompleted=row["stepsCompleted"],
             deviceHours=_device_hours(child, row["stepsCompleted"]))
    said = f"{row['signature']} at step {row['step']}" if reproduced else PROBE_STATES[reproduced]
    out.events.append(("Normal" if reproduced is not None else "Warning", "ProbeFinished",
                       f"step {p['step']}: {said}" + (f" ({note})" if note else "")))
    return None


def _fingerprint(rec: dict, step: int) -> str | None:
    return next((c.get("fingerprint") for c in rec["checkpoints"] if c["step"] == step), None)


def _build_own(p: dict, body: dict, rec: dict, checkpoint: dict, settings: Settings, out: DiagnosisDecision,
               what: str) -> None:
    """The CheckpointWatch's ProxyModel a probe reused is gone or failed before its proxy was
    built: the probe builds its own after all (a failed one is never waited for again)."""
    manifest = probe_proxymodel(body, rec["spec"], checkpoint, settings)
    out.events.append(("Warning", "ReusedProxyModelLost", f"probe step {p['step']}: ProxyModel {p['reused']} {what} "
                       f"before its proxy was built; building {manifest['metadata']['name']}"))
    p.update(proxyModel=manifest["metadata"]["name"], reused=None)
    out.create.append((PROXYMODELS, manifest))
    return None


def _failed(status: dict, probes: list[dict], p: dict, message: str, generation: int,
            out: DiagnosisDecision) -> DiagnosisDecision:
    """A probe that cannot finish ends the bisection (as the CLI's, which stops with exit 1)."""
    p.update(phase=RUN_ERROR, message=message[:512])
    s = out.status
    s.update(probes=probes, phase=DIAGNOSIS_FAILED, message=message[:1024])
    set_condition(status, s, RUNNING_CONDITION, False, "ProbeFailed", message, generation)
    set_condition(status, s, FAILED_CONDITION, True, "ProbeFailed", message, generation)
    out.create.clear()
    out.events.append(("Warning", "ProbeFailed", message))
    return out


def _complete(status: dict, probes: list[dict], checkpoints: list[dict], first: int | None, generation: int,
              out: DiagnosisDecision, candidates: bool = False) -> DiagnosisDecision:
    as_probes = [(p["index"], Probe(p["checkpoint"], p["step"], p["reproduced"], p.get("signature"), p.get("onset"),
                                    p.get("note") or "")) for p in probes]
    found = findings(first, as_probes, [SimpleNamespace(**c) for c in checkpoints])
    s = out.status
    said = (f"first bad checkpoint: step {found['first_bad']['step']} ({found['first_bad']['checkpoint']}); "
            if found["first_bad"] else "no checkpoint reproduces; ") + found["boundary"]
    if not found["monotone"]:
        said += "; not monotone: " + "; ".join(found["not_monotone"])
    if found["inconclusive"]:
        said += "; could not judge step " + ", ".join(str(i["step"]) for i in found["inconclusive"])
    s.update(probes=probes, firstBad=found["first_bad"], boundary=found["boundary"], monotone=found["monotone"],
             notMonotone=found.get("not_monotone"), inconclusive=found["inconclusive"] or None,
             builds=found["builds"] - sum(1 for p in probes if p.get("reused")), phase=DIAGNOSED, message=said[:1024],
             done=len(probes), progress=f"{len(probes)} probed of {len(checkpoints)}")
    out.events.append(("Normal" if found["monotone"] and not found["inconclusive"] else "Warning",
                       "BisectionComplete", said))
    if found["first_bad"] and candidates:  # issue 45 item 3: on to the candidates, on the first bad probe's proxy
        probe = next(p for p in probes if p["step"] == found["first_bad"]["step"] and p.get("reproduced"))
        s.update(phase=DIAGNOSING, candidatesOn={"proxyModel": probe["proxyModel"], "step": probe["step"]})
        said = f"{said}; now the candidates on {probe['proxyModel']}"
        set_condition(status, s, RUNNING_CONDITION, True, "TryingCandidates", said, generation)
        out.events.append(("Normal", "CandidatesStarted", said))
        return out
    set_condition(status, s, RUNNING_CONDITION, False, "Finished", "every probe finished", generation)
    set_condition(status, s, COMPLETE_CONDITION, True, "FirstBadFound" if found["first_bad"] else "NoneBad", said,
         generation)
    return out


def listing_refused(status: dict, generation: int, exc: InvalidDiagnosis | NotYet) -> DiagnosisDecision:
    """The checkpoints cannot be listed (yet): a refusal, permanent for bad input (fewer than 2
    complete checkpoints, a step of good/bad that is none), else said once and tried again."""
    temporary = isinstance(exc, NotYet) and not exc.failed
    if temporary and not condition_changed(status, ACCEPTED, False, exc.reason):
        return DiagnosisDecision()
    out = refused(status, generation, exc.reason, str(exc), temporary=temporary)
    if temporary:
        out.status["phase"] = DIAGNOSIS_PENDING
    return out
