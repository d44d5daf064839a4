"""What a Diagnosis does next, as pure functions: which runs start now, what a finished run
says, each candidate's verdict, and the status that records it all. The kopf timer
(diagnosis.py) does the I/O around them, as checkpoint_watch.py does for watch_decisions.py.

A Diagnosis is `moe-proxy diagnose` on the cluster: the failing run of a Ready ProxyModel (the
baseline: its reproduction, as its spec and plan say) and the same run with each candidate fix
(the baseline's container arguments plus the candidate's repro flags), on every seed, each
run one reproduction workload of the planned size (`reproduction.reproduction_workload`, the
builder the ProxyModel's own reproduction uses). Candidates come from the CLI's catalogue
(`moe_proxy.investigate.catalogue`) and verdicts from its rule (`moe_proxy.investigate.diagnose.verdict`),
so the cluster judges exactly as the CLI does.

Status is the single source of truth: every run has a row (`status.baseline.runs`,
`status.candidates[].runs`) with its deterministic workload name, and a run's row says
Running *before* its workload is created (`DiagnosisDecision.create` comes after its `status`
is written). A restarted operator therefore finds every workload it made; one recorded but missing
(the operator stopped between the two writes) is created again under the same name, so there is
never a second workload for a run.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace

from moe_proxy.errors import MoeProxyError
from moe_proxy.investigate.catalogue import CATALOGUE
from moe_proxy.investigate.diagnose import (BASELINE, FIXED, FIXED_BUT, NOT_RUN, OWN_FLAGS, SeedRun, against,
                                      changed_settings, cost_of, cost_window, findings, repro_config, verdict)
from moe_proxy.metrics.verdict import series_rows

from .children import MAX_NAME
from .diagnosis_baseline import changes as baseline_changes, pin
from .diagnosis_spec import DiagnosisSpec, InvalidDiagnosis, parse_diagnosis
from .outcome import FAILED as OUTCOME_FAILED, RUNNING as OUTCOME_RUNNING, Outcome
from .reproduction import (ArgsIgnored, Naming, appended, first_container, headless_service, name_reserve,
                           repro_flags, reproduction_workload)
from .resources import GROUP, LABEL_CHILD, LABEL_ROLE, SERVICES, Resource
from .runtimes import RUNTIMES
from .settings import Settings
from .spec import InvalidSpec, ProxyModelSpec, parse, parse_fail_on
from .status import (ACCEPTED, NOT_REPRODUCED, PROXY_READY, PROXY_READY_CONDITION, REPRODUCED, REPRODUCING,
                     condition, with_condition)

LABEL_DIAGNOSIS = f"{GROUP}/diagnosis"  # the Diagnosis a run belongs to (on the workload and its pods)
LABEL_VARIANT = f"{GROUP}/variant"  # baseline or the candidate's name
LABEL_SEED = f"{GROUP}/seed"
DIAGNOSIS_ROLE = "diagnosis"  # the runs' moeproxy.io/role
SEED_ENV = "MOEPROXY_SEED"  # every run's seed, in its first container's env

# Diagnosis phases.
WAITING_FOR_PROXY = "WaitingForProxy"  # the ProxyModel's proxy is not built yet (or it is missing)
DIAGNOSING = "Running"
DIAGNOSED = "Complete"
DIAGNOSIS_FAILED = "Failed"
DIAGNOSIS_PENDING = "Pending"
# A run's phase.
RUN_PENDING, RUN_RUNNING, RUN_DONE, RUN_ERROR = "Pending", "Running", "Succeeded", "Failed"
RUN_NOT_RUN = "NotRun"  # a candidate's run left out: the baseline reproduced on no seed
FINISHED = (RUN_DONE, RUN_ERROR, RUN_NOT_RUN)
# Condition types besides Accepted.
RUNNING_CONDITION, COMPLETE_CONDITION, FAILED_CONDITION = "Running", "Complete", "Failed"
# A ProxyModel whose proxy is built.
PROXY_BUILT_PHASES = (PROXY_READY, REPRODUCING, REPRODUCED, NOT_REPRODUCED)


# --- the baseline: what the ProxyModel says ---------------------------------------------------------


@dataclass(frozen=True)
class RunVariant:
    """A row of the matrix: the baseline or a candidate, with what its runs add to the baseline's."""

    name: str
    args: tuple[str, ...]  # repro flags after the baseline's
    env: tuple[dict, ...] = ()
    what: str = ""


@dataclass(frozen=True)
class Baseline:
    """The ProxyModel's reproduction as the Diagnosis runs it (its steps and failOn in place)."""

    spec: ProxyModelSpec
    proxy_uri: str
    manifest_sha256: str
    devices: int
    experts_per_layer: int | None
    top_k: int | None
    pinned: dict = field(default_factory=dict)  # what status.proxyModel records of it (diagnosis_baseline.pin)

    @property
    def steps(self) -> int:
        return self.spec.reproduction.max_steps

    @property
    def seeds_from(self) -> int:
        return self.spec.reproduction.config.seed


class NotYet(Exception):
    """The ProxyModel cannot give a baseline yet (missing, or its proxy is not built): `reason`."""

    def __init__(self, reason: str, message: str, failed: bool = False):
        super().__init__(message)
        self.reason, self.failed = reason, failed


def proxy_built(proxymodel: dict) -> bool:
    """Its proxy is built for its current spec: status.proxy, and the ProxyReady condition True
    (also when its own reproduction failed afterwards) or a phase after the build."""
    status = proxymodel.get("status") or {}
    if not (status.get("proxy") or {}).get("uri"):
        return False
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == PROXY_READY_CONDITION), {})
    return ready.get("status") == "True" or status.get("phase") in PROXY_BUILT_PHASES


def baseline_of(d: DiagnosisSpec, proxymodel: dict | None, namespace: str, settings: Settings) -> Baseline:
    """The baseline from the ProxyModel; NotYet while it cannot be (failed=True: it never will be,
    for this spec), InvalidDiagnosis when the pair cannot run."""
    if proxymodel is None:
        raise NotYet("ProxyModelNotFound", f"ProxyModel {d.proxy_model} does not exist in {namespace}")
    status = proxymodel.get("status") or {}
    try:
        spec = parse(dict(proxymodel.get("spec") or {}), namespace, d.proxy_model, settings)
    except InvalidSpec as exc:
        raise NotYet("ProxyModelRefused", f"ProxyModel {d.proxy_model} is refused: {exc}", failed=True) from None
    r = spec.reproduction
    if r.template is not None and (catalogue := [c.name for c in d.candidates if c.args is None and not c.env]):
        knobs = "; ".join(f"{n}: {CATALOGUE[n].knobs}" for n in catalogue)
        raise InvalidDiagnosis("TemplateNeedsPatches", f"ProxyModel {d.proxy_model} runs its own framework "
                               f"(spec.reproduction.template): the catalogue's {', '.join(catalogue)} are moe-proxy "
                               "repro flags; give {name, env, args} patches of its first container instead "
                               f"(where frameworks set them: {knobs})")
    for v in (RunVariant(BASELINE, ()), *(RunVariant(c.name, c.args) for c in d.candidates if c.args)):
        args_reach(spec, v)  # a catalogue entry's flags go where the baseline's --seed goes
    if not proxy_built(proxymodel):
        if status.get("phase") == "Failed" and not status.get("proxy"):
            raise NotYet("ProxyModelFailed", f"ProxyModel {d.proxy_model} failed before its proxy was built: "
                         f"{status.get('message') or 'see its conditions'}", failed=True)
        raise NotYet("WaitingForProxy", f"ProxyModel {d.proxy_model} is {status.get('phase') or 'Pending'}: "
                     "waiting for its proxy to be built")
    fail_on = parse_fail_on(d.fail_on, "spec.failOn") if d.fail_on is not None else r.fail_on
    if fail_on is None:
        raise InvalidDiagnosis("InvalidSpec", f"no failure to judge: ProxyModel {d.proxy_model} has no "
                               "spec.reproduction.failOn, and spec.failOn is not set")
    config = replace(r.config, steps=d.steps) if d.steps else r.config
    spec = replace(spec, reproduction=replace(r, config=config, fail_on=fail_on))
    devices = r.accelerator.devices or ((status.get("plan") or {}).get("proxy") or {}).get("devices")
    if not devices:
        raise NotYet("ProxyModelRefused", f"ProxyModel {d.proxy_model} has no planned device count", failed=True)
    proxy = status["proxy"]
    experts = proxy.get("expertsPerLayer") or {}
    return Baseline(spec, proxy["uri"], proxy.get("manifestSha256") or "", int(devices), experts.get("after"),
                    experts.get("topK"), pin(proxymodel))


def variants(d: DiagnosisSpec, baseline: Baseline) -> list[RunVariant]:
    """The baseline first, then each candidate with its repro flags (a catalogue entry's may
    depend on the baseline's settings: lr / 10, a quarter of the steps)."""
    out = [RunVariant(BASELINE, (), (), "the failing run, as the ProxyModel's reproduction")]
    for c in d.candidates:
        if c.args is None and c.name in CATALOGUE and not c.env:
            fix = CATALOGUE[c.name]
            out.append(RunVariant(c.name, tuple(fix.changes(baseline.spec.reproduction.config)), (), fix.what))
        else:
            out.append(RunVariant(c.name, tuple(c.args or ()), c.env, "custom: " + " ".join(c.args or ())))
    return out


def changes(baseline: Baseline, v: RunVariant) -> dict:
    """The repro settings a variant changes from the baseline's, as `moe-proxy repro`'s own parser
    reads the runs' flags (as `moe-proxy diagnose` checks them, before anything runs). Flags repro
    refuses raise InvalidDiagnosis naming the candidate. A ProxyModel with a template (its own
    framework) or its own container args (spec.reproduction.workload.args) is not checked:
    {"unchecked": true}."""
    spec = baseline.spec
    if spec.reproduction.template is not None or spec.reproduction.workload.args:
        return {"unchecked": True}
    if v.args and not v.args[0].startswith("--"):
        raise InvalidDiagnosis("CandidateRefused", f"candidate {v.name!r}: args are repro flags, e.g. [--lr, 1e-6]")
    if own := [a for a in v.args if a.split("=")[0] in OWN_FLAGS]:
        raise InvalidDiagnosis("CandidateRefused", f"candidate {v.name!r}: {', '.join(own)} are the diagnosis's own "
                               "(it sets the seed, the failure and where runs write)")
    flags = repro_flags(spec)
    try:
        base = repro_config(flags)
        mine = repro_config([*flags, *v.args])
    except MoeProxyError as exc:
        raise InvalidDiagnosis("CandidateRefused", f"candidate {v.name!r} ({' '.join(v.args)}): repro refuses it: "
                               f"{exc}") from None
    return changed_settings(base, mine)  # as the CLI: a change that changes nothing in the run is none


# --- names and manifests ------------------------------------------------------------------------------


def run_name(diagnosis: str, variant: str, seed: int, reserve: int = 0) -> str:
    """`<diagnosis>-<variant>-s<seed>`, DNS-safe, cut to 63 characters (less `reserve`, for the
    pods' host names) with a hash of the whole to keep it unique."""
    base = "".join(ch if ch.isalnum() else "-" for ch in f"{diagnosis}-{variant}".lower()).strip("-")
    suffix, limit = f"-s{seed}", MAX_NAME - reserve
    if len(base) + len(suffix) <= limit and base == f"{diagnosis}-{variant}":
        return base + suffix
    digest = hashlib.sha256(f"{diagnosis}/{variant}".encode()).hexdigest()[:6]
    return f"{base[: limit - len(suffix) - 7].rstrip('-')}-{digest}{suffix}"


def run_args(spec: ProxyModelSpec, variant: RunVariant, seed: int) -> tuple[str, ...]:
    """What a run adds to its first container's args: the variant's, then `--seed S`. A user's
    framework gets the seed as MOEPROXY_SEED only (its command may pass $(MOEPROXY_SEED) on)."""
    return (*variant.args, *(("--seed", str(seed)) if spec.reproduction.template is None else ()))


def args_reach(spec: ProxyModelSpec, v: RunVariant) -> None:
    """Admission (before the proxy is built): what the variant's runs add to the first container's
    args reaches the command it runs (reproduction.appended); else InvalidDiagnosis,
    CandidateArgsIgnored, with the reason."""
    args = run_args(spec, v, spec.reproduction.config.seed)
    try:
        appended(first_container(spec), args)
    except ArgsIgnored as exc:
        who = f"candidate {v.name!r}" if v.name != BASELINE else "every run"
        raise InvalidDiagnosis("CandidateArgsIgnored", f"{who} adds {' '.join(args)} to the args of the first "
                               f"container of the ProxyModel's reproduction, but {exc}") from None


def run_manifest(diagnosis: str, namespace: str, generation: int, baseline: Baseline, variant: RunVariant,
                 seed: int, proxymodel: str) -> tuple[Resource, dict, dict | None]:
    """(resource, workload, headless Service or None) of one run: the ProxyModel's reproduction
    with the variant's flags and `--seed` after its own arguments (a template's first container:
    the variant's args after its own, its env over the operator's, MOEPROXY_SEED)."""
    spec = baseline.spec
    name = run_name(diagnosis, variant.name, seed, name_reserve(spec, baseline.devices))
    labels = {LABEL_DIAGNOSIS: diagnosis, LABEL_ROLE: DIAGNOSIS_ROLE, LABEL_CHILD: name,
              LABEL_VARIANT: variant.name[:63], LABEL_SEED: str(seed)}
    env = ({"name": SEED_ENV, "value": str(seed)}, *variant.env)
    naming = Naming(name, labels, run_args(spec, variant, seed), env)
    manifest = reproduction_workload(proxymodel, namespace, generation, spec, baseline.proxy_uri,
                                     baseline.manifest_sha256, baseline.devices, baseline.experts_per_layer,
                                     baseline.top_k, naming=naming)
    runtime = RUNTIMES[spec.reproduction.runtime]
    return runtime.resource, manifest, headless_service(runtime, manifest)


# --- a run's outcome ------------------------------------------------------------------------------------


def seed_run(row: dict) -> SeedRun:
    """A finished run's row as the CLI's SeedRun (reproduced None: it failed to run)."""
    return SeedRun(row.get("reproduced"), row.get("signature"), row.get("step"), int(row.get("stepsCompleted") or 0),
                   row.get("stopped") or "", dict(row.get("otherFailures") or {}), error=row.get("message"))


def finished_row(row: dict, seen: Outcome, steps: int) -> dict:
    """A run's row once its workload has an outcome. The termination message carries the
    verdict (reproduced, signature, step) and the other failures seen (`also_seen`, kept as
    otherFailures: the verdict reports them); a run that did not reproduce counts as having run
    all `steps` unless the message says how many it completed (`steps_completed`)."""
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
    return {**row, "phase": RUN_DONE, "reproduced": reproduced, "signature": report.get("signature") if reproduced
            else None, "step": report.get("step") if reproduced else None, "stepsCompleted": completed,
            **({"stopped": str(report["stopped"])} if report.get("stopped") else {}), "message": None,
            **({"otherFailures": others} if (others := _other_failures(report)) else {}),
            # its metrics step by step, kept until its variant's cost is worked out
            **({"series": report["series"]} if isinstance(report.get("series"), dict) else {})}


def _other_failures(report: dict) -> dict[str, int]:
    """A termination message's also_seen (failure -> onset step), what is well-formed of it."""
    seen = report.get("also_seen")
    return {str(k): v for k, v in seen.items() if isinstance(v, int)} if isinstance(seen, dict) else {}


def variant_cost(row: dict, window: tuple[int, int], baseline: dict | None = None) -> dict:
    """`moe-proxy diagnose`'s cost of a variant (diagnose.cost_of, diagnose.against) from its
    runs' series; the row's runs lose their series (status keeps the figures only). Each run is
    a workload of its own: time per step is kept."""
    c = cost_of([series_rows(r.get("series")) for r in row["runs"]], window)
    row["runs"] = [{k: v for k, v in r.items() if k != "series"} for r in row["runs"]]
    return against(c, baseline) if baseline is not None else c


# --- the decision ----------------------------------------------------------------------------------------


@dataclass
class DiagnosisDecision:
    status: dict = field(default_factory=dict)  # merged into status (written before anything is created)
    create: list[tuple[Resource, dict]] = field(default_factory=list)  # in order, after status
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)


def _rows(status: dict) -> list[dict]:
    """Every run row of status: the baseline's, then each candidate's."""
    out = list((status.get("baseline") or {}).get("runs") or [])
    for c in status.get("candidates") or []:
        out += c.get("runs") or []
    return out


def recorded_running(status: dict) -> list[str]:
    """The workloads status records as running (a matrix's runs, a bisection's probe): what the
    handler looks at."""
    return [r["workload"] for r in _rows(status) + list(status.get("probes") or []) if r.get("phase") == RUN_RUNNING]


def set_condition(status: dict, out: dict, kind: str, ok: bool | None, reason: str, message: str,
                  generation: int) -> None:
    out["conditions"] = with_condition(out.get("conditions", status.get("conditions")),
                                       condition(kind, ok, reason, message, generation))


def condition_changed(status: dict, kind: str, ok: bool, reason: str) -> bool:
    before = next((c for c in status.get("conditions") or [] if c.get("type") == kind), None)
    return before is None or (before.get("status"), before.get("reason")) != ("True" if ok else "False", reason)


def refused(status: dict, generation: int, reason: str, message: str, temporary: bool) -> DiagnosisDecision:
    """Accepted False: bad input (Failed), or a ProxyModel that may still come (Pending/waiting)."""
    out = DiagnosisDecision()
    s = out.status
    s["observedGeneration"] = generation
    s["phase"] = WAITING_FOR_PROXY if temporary else DIAGNOSIS_FAILED
    s["message"] = message[:1024]
    set_condition(status, s, ACCEPTED, False, reason, message, generation)
    if not temporary:
        set_condition(status, s, FAILED_CONDITION, True, reason, message, generation)
        set_condition(status, s, RUNNING_CONDITION, False, reason, "nothing runs: the spec is refused", generation)
    if condition_changed(status, ACCEPTED, False, reason):
        out.events.append(("Warning", reason, message))
    return out


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
                       "devices": baseline.devices, "failOn": d.fail_on},
        "failOn": r.fail_on.cli(), "steps": baseline.steps, "seeds": seeds, "parallelism": d.parallelism,
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
    to_create = any(r.get("phase") == RUN_PENDING for r in _rows(status)) or \
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


def _advance(status: dict, patch: dict, d: DiagnosisSpec, baseline: Baseline | None, name: str, namespace: str,
             generation: int, seen: dict[str, Outcome], out: DiagnosisDecision) -> DiagnosisDecision:
    base = dict(patch.get("baseline") or status["baseline"])
    cands = [dict(c) for c in patch.get("candidates") or status.get("candidates") or []]
    steps = int(status.get("steps") or (baseline.steps if baseline else 0))
    # what each variant's runs add: as recorded when the matrix was made
    variants_by_name = {row["name"]: RunVariant(row["name"], tuple(row.get("args") or ()), tuple(row.get("env") or ()))
                        for row in [base, *cands]}
    running = 0
    for row in [base, *cands]:
        runs = [dict(r) for r in row["runs"]]
        for i, run in enumerate(runs):
            if run["phase"] != RUN_RUNNING:
                continue
            outcome = seen.get(run["workload"])
            if outcome is None:  # recorded, not there: the operator stopped before creating it
                resource, manifest, service = run_manifest(name, namespace, generation, baseline,
                                                           variants_by_name[row["name"]], run["seed"], d.proxy_model)
                out.create += ([(SERVICES, service)] if service else []) + [(resource, manifest)]
                running += 1
            elif outcome.state == OUTCOME_RUNNING:
                running += 1
            else:
                runs[i] = finished_row(run, outcome, steps)
                said = _said(runs[i])
                out.events.append(("Normal" if runs[i]["phase"] == RUN_DONE else "Warning", "RunFinished",
                                   f"{row['name']} seed {run['seed']}: {said}"))
        row["runs"] = runs
    # start the next ones, the baseline's first, at most `parallelism` running; a candidate's only
    # once the baseline reproduced on some seed (nothing to cure otherwise, as the CLI)
    base_reproduced = any(r.get("reproduced") for r in base["runs"])
    for row in [base, *cands]:
        for run in row["runs"]:
            if run["phase"] == RUN_PENDING and running < d.parallelism and baseline is not None \
                    and (row is base or base_reproduced):
                resource, manifest, service = run_manifest(name, namespace, generation, baseline,
                                                           variants_by_name[row["name"]], run["seed"], d.proxy_model)
                run["phase"] = RUN_RUNNING
                run["workload"] = manifest["metadata"]["name"]
                out.create += ([(SERVICES, service)] if service else []) + [(resource, manifest)]
                out.events.append(("Normal", "RunCreated", f"{manifest['kind']} {run['workload']}: {row['name']} "
                                   f"seed {run['seed']}"))
                running += 1
    # judge
    base_done = all(r["phase"] in (RUN_DONE, RUN_ERROR) for r in base["runs"])
    base_runs = {r["seed"]: seed_run(r) for r in base["runs"]}
    base["phase"] = _row_phase(base)
    if base_done:
        if all(r["phase"] == RUN_ERROR for r in base["runs"]):
            base["verdict"] = "error"
            base["note"] = "; ".join(f"seed {r['seed']}: {r.get('message')}" for r in base["runs"])[:1024]
        else:
            hits = [f"seed {r['seed']} step {r['step']}" for r in base["runs"] if r.get("reproduced")]
            base["verdict"] = "reproduced" if hits else "not reproduced"
            base["note"] = "; ".join([", ".join(hits) if hits else f"no {status.get('failOn')} in {steps} steps",
                                      *findings(base_runs, steps)])[:1024]
        if base.get("cost") is None:  # as diagnose.judge: up to the baseline's first onset
            base["cost"] = variant_cost(base, cost_window(base_runs, steps))
    if base_done and not base_reproduced:
        _not_run(cands, base["note"])
    for row in cands:
        row["phase"] = _row_phase(row)
        if base_done and row["phase"] == RUN_DONE and not row.get("verdict"):
            own_steps = (row.get("changes") or {}).get("steps") or steps  # a candidate changing them: judged on its own
            changed = bool(row.get("changes") or row.get("env"))
            row["verdict"], row["note"] = verdict(base_runs, {r["seed"]: seed_run(r) for r in row["runs"]}, own_steps,
                                                  changed)
            window = (base["cost"]["window_first"], base["cost"]["window_last"])
            row["cost"] = variant_cost(row, window, base["cost"])
            out.events.append(("Warning" if row["verdict"] == FIXED_BUT else "Normal", "CandidateJudged",
                               f"{row['name']}: {row['verdict']} ({row['note']})"[:1024]))
    all_runs = [r for row in [base, *cands] for r in row["runs"]]
    done = sum(r["phase"] in FINISHED for r in all_runs)
    fixed = [c["name"] for c in cands if c.get("verdict") == FIXED]
    fixed_but = [c["name"] for c in cands if c.get("verdict") == FIXED_BUT]
    s = patch
    s.update(baseline=base, candidates=cands, progress=f"{done}/{len(all_runs)}", done=done, total=len(all_runs),
             fixedBy=", ".join(fixed) or None, fixedWithOtherFailures=", ".join(fixed_but) or None, running=running)
    if done < len(all_runs):
        s["phase"] = DIAGNOSING
        message = f"{done}/{len(all_runs)} runs done, {running} running"
        set_condition(status, s, RUNNING_CONDITION, True, "RunsInProgress", message, generation)
    elif base.get("verdict") == "error":
        s["phase"], s["message"] = DIAGNOSIS_FAILED, f"the baseline failed to run on every seed: {base['note']}"[:1024]
        set_condition(status, s, RUNNING_CONDITION, False, "Finished", "every run finished", generation)
        set_condition(status, s, FAILED_CONDITION, True, "BaselineFailed", s["message"], generation)
        out.events.append(("Warning", "BaselineFailed", s["message"]))
    elif not base_reproduced:
        s["phase"] = DIAGNOSED
        s["message"] = (f"the baseline did not reproduce {status.get('failOn')} on any seed in {steps} steps "
                        f"({base['note']}): nothing to cure, no candidate was run")[:1024]
        set_condition(status, s, RUNNING_CONDITION, False, "Finished", "the baseline's runs finished", generation)
        set_condition(status, s, COMPLETE_CONDITION, True, "BaselineNotReproduced", s["message"], generation)
        out.events.append(("Warning", "BaselineNotReproduced", s["message"]))
    else:
        s["phase"] = DIAGNOSED
        said = "; ".join([f"fixed by: {', '.join(fixed)}" if fixed else "no candidate fixed it",
                          *([f"fixed, but with other failures: {', '.join(fixed_but)}"] if fixed_but else [])])
        s["message"] = said
        reason = "FixFound" if fixed else "FixWithOtherFailures" if fixed_but else "NoFix"
        set_condition(status, s, RUNNING_CONDITION, False, "Finished", "every run finished", generation)
        set_condition(status, s, COMPLETE_CONDITION, True, reason, said, generation)
        out.events.append(("Warning" if reason == "FixWithOtherFailures" else "Normal", "DiagnosisComplete", said))
    out.status.update(s)
    return out


def _not_run(cands: list[dict], why: str) -> None:
    """The baseline reproduced on no seed: the candidates' runs are left out, said in their rows."""
    for row in cands:
        row["runs"] = [{**r, "phase": RUN_NOT_RUN} if r["phase"] == RUN_PENDING else r for r in row["runs"]]
        if not row.get("verdict"):
            row["verdict"], row["note"] = NOT_RUN, f"the baseline did not reproduce ({why})"[:1024]


def _row_phase(row: dict) -> str:
    phases = [r["phase"] for r in row["runs"]]
    if all(p == RUN_NOT_RUN for p in phases):
        return RUN_NOT_RUN
    if all(p in FINISHED for p in phases):
        return RUN_DONE
    return RUN_RUNNING if any(p != RUN_PENDING for p in phases) else RUN_PENDING


def _said(row: dict) -> str:
    if row["phase"] == RUN_ERROR:
        return f"error: {row.get('message')}"
    others = "".join(f"; {name} at step {step}" for name, step in (row.get("otherFailures") or {}).items())
    if row.get("reproduced"):
        return f"{row['signature']} at step {row['step']}{others}"
    return f"not reproduced in {row.get('stepsCompleted')} steps{others}"


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
