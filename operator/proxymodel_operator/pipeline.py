"""What the ProxyModel pipeline does next, decided without I/O.

`decide(proxymodel, observed, settings)` takes the ProxyModel as read (its spec, and its
status, the single source of truth), what a handler observed (which event, a child's verdict,
whether a recorded child exists) and returns the actions to take, in order. The handlers
observe and act (`handlers.py`); nothing here calls the API, so every branch is unit-tested
without a cluster. The same split as CheckpointWatch's `watch_decisions.decide`.

`status.pipeline` records which spec the pipeline runs for (`specHash`), the generation its
children are named after, their names, and which transformer step runs (`transformerStep`:
the single build, or calibrate -> workers -> finalize when several workers share it). Each
child is recorded there before it is created, so its first event always finds it expected,
and a restart between the two creates it; so an operator restart never redoes a finished step
and never makes a second child.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace

from .children import FINALIZE, REPRODUCTION, TRANSFORMER
from .outcome import COULD_NOT_JUDGE, FAILED, RUNNING, SUCCEEDED, Outcome, cannot_show
from .reproduction import headless_service, reproduction_workload
from .resources import JOBS, SERVICES, Resource
from .runtimes import RUNTIMES, Runtime
from .settings import Settings
from .spec import parse
from .spec_types import SIGNATURE_REASONS, ProxyModelSpec
from .status import (ACCEPTED, FAILED as PHASE_FAILED, NOT_REPRODUCED, PENDING, PROXY_READY, PROXY_READY_CONDITION,
                     READY, REPRODUCED, REPRODUCED_CONDITION, REPRODUCING, SUSPENDED, SUSPENDED_CONDITION, TERMINAL,
                     TRANSFORMING, arrow, condition, plan_summary, proxy_summary, reproduction_summary, with_condition,
                     with_ready)
from .transformer_job import BUILD, STEP_TEXT, WORKERS, next_step, step_job, step_message, steps

# Spec fields that change how the pipeline runs, not what it builds: no restart for them.
RUN_CONTROL_FIELDS = ("suspend", "ttlSecondsAfterFinished")
MAX_EVENT = 1024  # characters of an Event's message
CRASHED_REASON = "Crashed"  # the user's framework crashed before the failure asked for was seen

# What a handler observed happen (Observed.event).
ADMITTED = "admitted"  # the ProxyModel was created, or seen again after a restart
VALIDATED = "validated"  # its spec was accepted (the validate step): start the transformer
SPEC_CHANGED = "spec-changed"
CHILD_CHANGED = "child-changed"  # a child workload or one of its pods changed
WORKERS_PROGRESS = "workers-progress"  # the workers' Indexed Job finished another index
RECHECK = "recheck"  # a refused ProxyModel's dependencies were looked at again (the back-off)
REJUDGE = "rejudge"  # a judgment was asked for again (the recheck annotation changed)
RETRY = "retry"  # the back-off of a child the API server refused looked again (`waits_on_refusal`)

# The reason of a step's condition while the API server refuses a child it needs first (the
# headless Service of a multi-node reproduction): nothing after it is created; tried again.
CREATE_REFUSED = "CreateRefused"


# --- what a handler observed -------------------------------------------------------------------


@dataclass(frozen=True)
class Child:
    """A child workload as its handler saw it."""

    name: str
    role: str  # TRANSFORMER | REPRODUCTION
    verdict: Outcome = Outcome(RUNNING)  # from the workload and its pods (`outcome.outcome`)
    failed_indexes: str | None = None  # an Indexed Job's status.failedIndexes
    progress: str | None = None  # an Indexed Job's finished indexes, done/all


@dataclass(frozen=True)
class Observed:
    event: str  # ADMITTED | VALIDATED | SPEC_CHANGED | CHILD_CHANGED | WORKERS_PROGRESS | RECHECK | REJUDGE | RETRY
    child: Child | None = None  # CHILD_CHANGED, WORKERS_PROGRESS
    child_exists: bool | None = None  # ADMITTED, RETRY: whether `recorded_child` exists
    # ADMITTED and RECHECK of a refused ProxyModel: what its refusal depended on, as now
    # (`preflight.dependencies`)
    dependencies: dict | None = None


# --- what to do ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class PatchStatus:
    status: dict
    # Written before the next action (a child created next must find itself recorded). Otherwise
    # the ProxyModel's own handlers leave it to kopf, which writes it when the handler returns.
    first: bool = False


@dataclass(frozen=True)
class Emit:
    """An Event on the ProxyModel."""

    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass(frozen=True)
class Failure:
    """How an API refusal of a child fails the ProxyModel."""

    kind: str  # the condition type
    what: str  # the step, as messages name it
    # A refusal that may pass (RBAC, a quota, an admission policy): the step waits and the child
    # is created again on the back-off, instead of failing the ProxyModel.
    retry: bool = False


@dataclass(frozen=True)
class CreateChild:
    """Create a child owned by the ProxyModel; one that exists already counts as created. When
    the API server refuses it, the actions after it are not taken (`create_refused` says what is)."""

    resource: Resource
    manifest: dict
    created: Emit | None = None  # the Event when it was created now
    refused: Failure | None = None  # None: an API refusal fails the handler (kopf retries it)


@dataclass(frozen=True)
class DeleteChildren:
    """Delete the ProxyModel's children of other generations (all of them: None)."""

    keep_generation: int | None
    announce: bool = False  # a ChildrenReplaced Event naming them


@dataclass(frozen=True)
class StartPipeline:
    """Validate the spec, then start the transformer: kopf sub-handlers, each done once."""


@dataclass(frozen=True)
class JudgeChild:
    """Judge a child again now (a step that finished while the ProxyModel was suspended)."""

    resource: Resource
    name: str
    role: str


@dataclass(frozen=True)
class AskJudgment:
    """Ask for the refused ProxyModel to be judged again (the recheck annotation, which runs the
    pipeline's steps as kopf sub-handlers): something its refusal depended on changed."""

    why: str


@dataclass(frozen=True)
class Log:
    message: str


Action = PatchStatus | Emit | CreateChild | DeleteChildren | StartPipeline | JudgeChild | AskJudgment | Log


# --- pure helpers over spec and status ------------------------------------------------------------


def spec_hash(spec: dict) -> str:
    """What the pipeline builds depends on every spec field except the run-control ones."""
    essence = {k: v for k, v in spec.items() if k not in RUN_CONTROL_FIELDS}
    return hashlib.sha256(json.dumps(essence, sort_keys=True, default=str).encode()).hexdigest()[:16]


def reproduces(spec: dict) -> bool:
    """Whether the spec asks for a reproduction (spec.reproduction.enabled, true by default)."""
    return bool((spec.get("reproduction") or {}).get("enabled", True))


def finished(spec: dict, status: dict) -> bool:
    """Whether the pipeline is done with this spec: a verdict or a failure, or the proxy when no
    reproduction is asked for. Status's Ready condition is True exactly for the first two."""
    return status.get("phase") in TERMINAL or (status.get("phase") == PROXY_READY and not reproduces(spec))


def keep_ready(status: dict, actions: list[Action], spec: dict | None = None) -> list[Action]:
    """`actions` with the Ready condition kept as the status each PatchStatus leaves implies
    (`status.ready`, over `status` as read and the patches before it): the one code path by
    which phase and conditions change also keeps Ready. A patch that leaves Ready as it is gets
    no conditions it did not have."""
    current, out, reproduce = dict(status), [], reproduces(spec or {})
    for action in actions:
        if isinstance(action, PatchStatus):
            conditions = with_ready({**current, **action.status}, reproduce)
            if conditions is not None:
                action = replace(action, status={**action.status, "conditions": conditions})
            current.update(action.status)
        out.append(action)
    return out


def ready_added(proxymodel: dict, actions: list[Action]) -> list[Action]:
    """At a resume: `actions`, and when they write nothing, a status patch that adds the Ready
    condition to a status an operator without it wrote (a ProxyModel it finished, or one that
    waits for its child). When they write status, Ready comes with it (`keep_ready`)."""
    status = proxymodel.get("status") or {}
    if not status.get("phase") or not all(isinstance(a, Log) for a in actions):
        return actions
    conditions = with_ready(status, reproduces(proxymodel.get("spec") or {}))
    return actions if conditions is None else [*actions, PatchStatus({"conditions": conditions})]


def _ran(status: dict) -> dict:
    return status.get("pipeline") or {}


def _generation(status: dict) -> int:
    """The generation the pipeline's children are named after."""
    return _ran(status).get("generation") or 1


def refusal(reason: str, generation: int, dependencies: dict, temporary: bool) -> dict:
    """`status.refusal`: the spec generation refused, why, and what the judgment depended on
    besides the spec (`preflight.dependencies`): it is judged again only when one changes."""
    return {"reason": reason, "generation": generation, "temporary": temporary, "dependencies": dependencies}


def refusal_of(status: dict, generation: int) -> dict | None:
    """The refusal that stands for this spec generation (None: not refused)."""
    refused = status.get("refusal")
    return refused if refused and refused.get("generation") == generation else None


def refused(status: dict, spec: dict, generation: int, reason: str, message: str, dependencies: dict,
            temporary: bool = False) -> tuple[dict, bool]:
    """The status a refusal of the spec writes (Failed; Pending while the cause may pass by itself,
    e.g. a Secret not created yet), recording what the judgment depended on; and whether it is
    news (a Warning Event): judged again to the same reason, it is not."""
    before = refusal_of(status, generation)
    patch = {"observedGeneration": generation,
             "conditions": with_condition(status.get("conditions"),
                                          condition(ACCEPTED, False, reason, message, generation)),
             "phase": PENDING if temporary else PHASE_FAILED, "message": message,
             "refusal": refusal(reason, generation, dependencies, temporary)}
    return _ready_kept(status, patch, spec), before is None or before.get("reason") != reason


def accepted(status: dict, spec: dict, generation: int, parsed: ProxyModelSpec, plan,
             prices: dict[str, float] | None = None) -> tuple[dict, str]:
    """The status an accepted spec starts its pipeline with, and the Accepted condition's message.
    `plan`: the preflight's sizing.Sizing (None when the preflight is off), `prices` its per-step
    device-hours by precision (preflight.precision_prices). The steps' conditions
    belong to the spec before: only Accepted and Ready stay (each keeps its lastTransitionTime
    while its status does not change)."""
    notes = parsed.pruning.notes
    patch = {"observedGeneration": generation, "refusal": None, "phase": PENDING, "message": None, "proxy": None, "reproduction": None,
             "workers": None, "plan": plan_summary(plan, notes, prices) if plan else None,
             "pipeline": {"specHash": spec_hash(spec), "generation": generation, "transformerJob": None,
                          "transformerStep": None, "reproductionJob": None, "reproductionKind": None}}
    if plan:
        devices = parsed.reproduction.accelerator.devices or plan.proxy.devices
        patch["experts"] = arrow(plan.original.experts_per_layer, plan.proxy.experts_per_layer)
        patch["accelerators"] = arrow(plan.original.devices, devices)
        message = (f"{plan.architecture}: {plan.original.experts_per_layer} -> {plan.proxy.experts_per_layer} experts "
                   f"per layer; {plan.original.devices} -> {devices} x {plan.accelerator}"
                   + "".join(f"; {note}" for note in [*plan.notes, *notes]))
    else:
        message = "spec accepted (preflight disabled)" + "".join(f"; {note}" for note in notes)
    kept = [c for c in status.get("conditions") or [] if c.get("type") in (ACCEPTED, READY)]
    patch["conditions"] = with_condition(kept, condition(ACCEPTED, True, "SpecValid", message, generation))
    return _ready_kept(status, patch, spec), message


def _ready_kept(status: dict, patch: dict, spec: dict) -> dict:
    """`patch` with the Ready condition that status after it implies."""
    conditions = with_ready({**status, **patch}, reproduces(spec))
    return patch | ({"conditions": conditions} if conditions is not None else {})


def _changed(refused: dict, now: dict | None) -> list[str]:
    """What of a refusal's dependencies differs now."""
    before = refused.get("dependencies") or {}
    now = now or {}
    return sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))


def recorded_child(spec: dict, status: dict) -> tuple[Resource, str] | None:
    """The child that status records as in progress for this spec and has no verdict from yet:
    what a restarted operator checks is there (`Observed.child_exists`)."""
    ran, phase = _ran(status), status.get("phase")
    if ran.get("specHash") != spec_hash(spec) or not ran.get("transformerJob"):
        return None
    if phase == TRANSFORMING and not status.get("proxy"):
        return JOBS, ran["transformerJob"]
    if phase == REPRODUCING and not status.get("reproduction") and ran.get("reproductionJob"):
        return child_resource(status, REPRODUCTION), ran["reproductionJob"]
    return None


def child_resource(status: dict, role: str) -> Resource:
    """The workload resource of the pipeline's child in `role`."""
    if role == TRANSFORMER:
        return JOBS
    return RUNTIMES[_ran(status).get("reproductionKind") or "Job"].resource


def wants_verdict(status: dict, role: str, child: str) -> bool:
    """Whether the child's verdict still matters: the current child of its role, with no verdict
    in status yet, of a ProxyModel that has not failed."""
    ran = _ran(status)
    if child != (ran.get("transformerJob") if role == TRANSFORMER else ran.get("reproductionJob")):
        return False  # a child of an older spec, being deleted
    if role == TRANSFORMER and status.get("proxy") or role == REPRODUCTION and status.get("reproduction"):
        return False  # this step's verdict is in status already
    return status.get("phase") != PHASE_FAILED


def as_planned(spec: ProxyModelSpec, status: dict) -> ProxyModelSpec:
    """The spec with the plan's expert count in place of a keep ratio. The planner may keep
    more than the ratio says (at least 2 x top-k where the device budget holds it); the build
    must make the proxy that was planned and that the reproduction was sized for."""
    planned = ((status.get("plan") or {}).get("proxy") or {}).get("expertsPerLayer")
    if spec.pruning.auto:  # the build chooses, up to the count the devices were planned for
        return replace(spec, pruning=replace(spec.pruning, max_experts=int(planned))) if planned else spec
    if spec.pruning.experts is not None or not planned:
        return spec
    return replace(spec, pruning=replace(spec.pruning, options=replace(spec.pruning.options, experts=int(planned),
                                                                           keep_ratio=None)))


def suspended(status: dict, generation: int) -> dict:
    """The status of a ProxyModel whose spec.suspend holds back every new child."""
    return {"phase": SUSPENDED, "observedGeneration": generation,
            "conditions": with_condition(status.get("conditions"), condition(
                SUSPENDED_CONDITION, True, "SuspendedBySpec", "spec.suspend is true: no new child is created",
                generation))}


def failed(status: dict, kind: str, reason: str, message: str, what: str) -> list[Action]:
    """Fail the ProxyModel at step `what`: phase Failed, the condition `kind`, a Warning Event."""
    new = condition(kind, False, reason, message, _generation(status))
    return [PatchStatus({"phase": PHASE_FAILED, "message": f"{what} failed: {reason}: {message}"[:MAX_EVENT],
                         "conditions": with_condition(status.get("conditions"), new)}),
            Emit("Warning", reason, f"{what} failed: {message}"[:MAX_EVENT])]


def create_refused(status: dict, refused: Failure, what: str, error: str, spec: dict | None = None,
                   reason: str = "CreateFailed") -> list[Action]:
    """The API server refused the child `what` (its answer: `error`). Permanent: the ProxyModel
    fails at that step. Retried: the step's condition (Unknown, CREATE_REFUSED) and the message
    say what waits and why, one Warning Event for the refusal (none for each try after it),
    and the `recreate` back-off tries again (`RETRY`). `spec`: the ProxyModel's (for Ready)."""
    return keep_ready(status, _create_refused(status, refused, what, error, reason), spec)


def _create_refused(status: dict, refused: Failure, what: str, error: str, reason: str) -> list[Action]:
    message = f"creating {what}: {error}"
    if not refused.retry:
        return failed(status, refused.kind, reason, message, refused.what)
    conditions = status.get("conditions") or []
    waiting = waits_on_refusal(status)
    text = f"{refused.what} waits: {message}"[:MAX_EVENT]
    new = condition(refused.kind, None, CREATE_REFUSED, f"{text}; tried again", _generation(status))
    actions: list[Action] = [PatchStatus({"message": text, "conditions": with_condition(conditions, new)})]
    return actions if waiting else [*actions, Emit("Warning", CREATE_REFUSED, text)]


def waits_on_refusal(status: dict) -> bool:
    """Whether a step waits for a child the API server refused (the back-off tries again)."""
    return status.get("phase") not in (*TERMINAL, SUSPENDED) and any(
        c.get("reason") == CREATE_REFUSED for c in status.get("conditions") or [])


def step_status(status: dict, step: str, job_name: str, spec: ProxyModelSpec, generation: int) -> dict:
    """The status that records `job_name` as the transformer step in progress (written before
    the Job is created)."""
    recorded = {
        "pipeline": {**_ran(status), "generation": generation, "transformerJob": job_name, "transformerStep": step},
        "phase": TRANSFORMING,
        "conditions": with_condition(status.get("conditions"), condition(
            PROXY_READY_CONDITION, False, STEP_TEXT[step].running, step_message(step, job_name, spec), generation)),
    }
    if spec.workers > 1:  # workers done, of all: every worker before finalize, none before
        recorded["workers"] = f"{spec.workers if step == FINALIZE else 0}/{spec.workers}"
    return recorded


# --- the decision ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _ProxyModel:
    """The ProxyModel a decision is about, as read."""

    namespace: str
    name: str
    generation: int  # metadata.generation
    spec: dict
    status: dict
    settings: Settings

    def parsed(self) -> ProxyModelSpec:
        return parse(dict(self.spec), self.namespace, self.name, self.settings)


def decide(proxymodel: dict, observed: Observed, settings: Settings) -> list[Action]:
    """The actions that follow what was observed, in order (none: nothing to do)."""
    meta = proxymodel["metadata"]
    pm = _ProxyModel(meta["namespace"], meta["name"], meta.get("generation") or 1, proxymodel.get("spec") or {},
                     proxymodel.get("status") or {}, settings)
    decisions = {ADMITTED: _admitted, VALIDATED: _validated, SPEC_CHANGED: _spec_changed,
                 CHILD_CHANGED: _child_changed, WORKERS_PROGRESS: _workers_progress, RECHECK: _recheck,
                 REJUDGE: _rejudge, RETRY: _retry}
    return keep_ready(pm.status, decisions[observed.event](pm, observed), pm.spec)


def _admitted(pm: _ProxyModel, observed: Observed) -> list[Action]:
    """Run the pipeline for this spec unless status shows it already runs (a resume after a
    restart, or the create event seen again): then only a recorded child that is missing. A
    refused spec is judged again only if something its refusal depended on changed."""
    refused = refusal_of(pm.status, pm.generation)
    if refused is not None and not _changed(refused, observed.dependencies):
        return [Log(f"refused ({refused.get('reason')}); nothing the refusal depended on changed: "
                    "not judged again")]
    ran = _ran(pm.status)
    if ran.get("specHash") == spec_hash(pm.spec) and ran.get("transformerJob"):
        return _recorded_but_missing(pm, observed.child_exists)
    if pm.spec.get("suspend"):
        return [PatchStatus(suspended(pm.status, pm.generation))]
    return [StartPipeline()]


def _recorded_but_missing(pm: _ProxyModel, exists: bool | None) -> list[Action]:
    """Status records each child before it is created; if the operator stopped in between, the
    child of the step in progress is created now."""
    if exists is not False or recorded_child(pm.spec, pm.status) is None:
        return []
    if pm.status.get("phase") == TRANSFORMING:
        step = _ran(pm.status).get("transformerStep") or BUILD  # absent in the status of older operators
        job = step_job(step, pm.name, pm.namespace, _generation(pm.status), as_planned(pm.parsed(), pm.status))
        return [CreateChild(JOBS, job, Emit("Normal", STEP_TEXT[step].created, f"Job {job['metadata']['name']}"))]
    into: dict = {}
    runtime, manifest = _reproduction(pm, pm.status, into)  # recorded already: only its condition is kept
    # After a refusal, once the Service is there: the condition says the run goes on again.
    resumed = PatchStatus({"message": None, "conditions": into["conditions"]}) if waits_on_refusal(pm.status) else None
    return _create_reproduction(runtime, manifest, resumed)


def _retry(pm: _ProxyModel, observed: Observed) -> list[Action]:
    """The back-off of a refused child: the recorded child (and what it needs first) created again."""
    if not waits_on_refusal(pm.status) or _ran(pm.status).get("specHash") != spec_hash(pm.spec):
        return []  # created meanwhile, or a new spec whose pipeline replaces it
    return _recorded_but_missing(pm, observed.child_exists)


def _validated(pm: _ProxyModel, observed: Observed) -> list[Action]:
    """Replace older generations' children by this generation's first transformer Job (the
    build; with several workers, calibration or the workers)."""
    if _ran(pm.status).get("specHash") != spec_hash(pm.spec):
        # kopf runs the next sub-handler even after one failed permanently
        return [Log("no transformer Job: this spec was not accepted (see the Accepted condition)")]
    spec = pm.parsed()
    # Generation 1 has no older children: no listings (they add up at scale).
    actions: list[Action] = [DeleteChildren(pm.generation, announce=True)] if pm.generation > 1 else []
    step = steps(spec)[0]
    job = step_job(step, pm.name, pm.namespace, pm.generation, as_planned(spec, pm.status))
    job_name = job["metadata"]["name"]
    recorded = step_status(pm.status, step, job_name, spec, pm.generation)
    recorded["pipeline"]["specHash"] = spec_hash(pm.spec)
    # Status first, then the Job: whatever the Job does next, its handler finds it recorded.
    return actions + [PatchStatus(recorded, first=True),
                      CreateChild(JOBS, job, Emit("Normal", STEP_TEXT[step].created,
                                                  step_message(step, job_name, spec)))]


def _spec_changed(pm: _ProxyModel, observed: Observed) -> list[Action]:
    """A new spec restarts the pipeline (old children deleted); suspend and TTL alone do not."""
    status, ran, generation = pm.status, _ran(pm.status), pm.generation
    if ran.get("specHash") != spec_hash(pm.spec):
        if pm.spec.get("suspend"):
            cleared = {"pipeline": None, "proxy": None, "reproduction": None, "plan": None, "workers": None}
            return [DeleteChildren(None), PatchStatus({**cleared, **suspended(status, generation)}),
                    Log("spec changed while suspended: the pipeline starts over on resume")]
        return [Log(f"spec changed: restarting the pipeline at generation {generation}"), StartPipeline()]

    out: dict = {"observedGeneration": generation}
    if pm.spec.get("suspend"):
        if not finished(pm.spec, status):
            out.update(suspended(status, generation))
        return [PatchStatus(out)]
    out["conditions"] = with_condition(status.get("conditions"), condition(
        SUSPENDED_CONDITION, False, "Resumed", "spec.suspend is false", generation))
    if not ran.get("transformerJob"):  # suspended before the first Job: start now
        return [PatchStatus(out), StartPipeline()]
    if status.get("phase") != SUSPENDED:
        return [PatchStatus(out)]
    out["phase"] = REPRODUCING if ran.get("reproductionJob") else (PROXY_READY if status.get("proxy") else TRANSFORMING)
    if status.get("proxy") and not ran.get("reproductionJob") and reproduces(pm.spec):
        runtime, manifest = _reproduction(pm, status, out)
        return [PatchStatus(out, first=True), *_create_reproduction(runtime, manifest)]
    if not status.get("proxy") and ran.get("transformerStep") not in (None, BUILD, FINALIZE):
        # A step before the workers' finalize may have succeeded while suspended, its next Job
        # held back: judge it again now, after status is written (the judge changes conditions).
        return [PatchStatus(out, first=True), JudgeChild(JOBS, ran["transformerJob"], TRANSFORMER)]
    return [PatchStatus(out)]


def _recheck(pm: _ProxyModel, observed: Observed) -> list[Action]:
    """The back-off's look at a refusal's dependencies: a change asks for a new judgment."""
    refused = refusal_of(pm.status, pm.generation)
    changed = _changed(refused, observed.dependencies) if refused is not None else []
    return [AskJudgment(f"{', '.join(changed)} changed since the refusal ({refused.get('reason')})")] \
        if changed else []


def _rejudge(pm: _ProxyModel, observed: Observed) -> list[Action]:
    """A judgment asked for again: only a refused spec is judged again (a pipeline that runs is
    left alone), and one accepted by this judgment goes on to its first Job."""
    if refusal_of(pm.status, pm.generation) is not None:
        return [Log("judging the refused spec again"), StartPipeline()]
    ran = _ran(pm.status)
    if ran.get("specHash") == spec_hash(pm.spec) and not ran.get("transformerJob"):
        return [StartPipeline()]  # accepted now: the transformer step follows
    return [Log("not refused: nothing to judge again")]


def _workers_progress(pm: _ProxyModel, observed: Observed) -> list[Action]:
    """`status.workers` shows done/all while the workers' Indexed Job runs."""
    child, ran = observed.child, _ran(pm.status)
    if (ran.get("transformerJob"), ran.get("transformerStep")) != (child.name, WORKERS) \
            or pm.status.get("workers") == child.progress:
        return []  # another step's, or an older spec's, or nothing new
    return [PatchStatus({"workers": child.progress})]


def _child_changed(pm: _ProxyModel, observed: Observed) -> list[Action]:
    """Carry a child's verdict into status, and start what follows it."""
    child = observed.child
    if not wants_verdict(pm.status, child.role, child.name):
        return []
    step = _ran(pm.status).get("transformerStep") or BUILD
    if child.role == REPRODUCTION:
        return _reproduction_verdict(pm, child.verdict)
    if step in (BUILD, FINALIZE):  # the Job that reports the proxy
        return _transformer_verdict(pm, child.verdict, STEP_TEXT[step].what)
    return _step_verdict(pm, child, step)


def _unfinished(status: dict, verdict: Outcome, kind: str, running_status: bool | None,
                what: str) -> list[Action] | None:
    """None when the child succeeded; else what its state brings: a failure, or a running
    child's notable state (e.g. Unschedulable) carried into its condition once."""
    if verdict.state == SUCCEEDED:
        return None
    if verdict.state == FAILED:
        return failed(status, kind, verdict.reason, verdict.message, what)
    conditions = status.get("conditions") or []
    if verdict.reason and not any(c.get("reason") == verdict.reason for c in conditions):
        new = condition(kind, running_status, verdict.reason, verdict.message, _generation(status))
        return [PatchStatus({"conditions": with_condition(conditions, new)}),
                Emit("Warning", verdict.reason, f"{what}: {verdict.message}"[:MAX_EVENT])]
    return []


def _transformer_verdict(pm: _ProxyModel, verdict: Outcome, what: str) -> list[Action]:
    """The Job that reports the proxy finished: ProxyReady, and the reproduction starts."""
    status = pm.status
    unfinished = _unfinished(status, verdict, PROXY_READY_CONDITION, False, what)
    if unfinished is not None:
        return unfinished
    report = verdict.report
    if not report.get("proxy_uri"):
        return failed(status, PROXY_READY_CONDITION, "NoProxyReport",
                      f"the {what} Job succeeded without reporting a proxy in its termination message", what)
    proxy = proxy_summary(report)
    experts = proxy["expertsPerLayer"]
    message = f"proxy at {proxy['uri']}: {experts['before']} -> {experts['after']} experts per layer"
    patch = {"phase": PROXY_READY, "proxy": proxy, "experts": arrow(experts["before"], experts["after"]),
             "conditions": with_condition(status.get("conditions"), condition(
                 PROXY_READY_CONDITION, True, "ProxyBuilt", message, _generation(status)))}
    spec = pm.parsed()
    create: list[Action] = []
    if spec.reproduction.enabled and not spec.suspend:
        create = _create_reproduction(*_reproduction(pm, {**status, **patch}, patch))
    elif spec.suspend:
        patch["phase"] = SUSPENDED
    return [Log(message), PatchStatus(patch), Emit("Normal", "ProxyReady", message), *create]


def _step_verdict(pm: _ProxyModel, child: Child, step: str) -> list[Action]:
    """A transformer step before the last (calibration, the workers) finished: on success, record
    and create the next step's Job. The workers' Indexed Job succeeds only once every index has."""
    status, what, verdict = pm.status, STEP_TEXT[step].what, child.verdict
    if verdict.state == FAILED and child.failed_indexes:
        verdict = replace(verdict, message=f"worker index(es) {child.failed_indexes} failed; {verdict.message}"
                          .rstrip("; "))
    unfinished = _unfinished(status, verdict, PROXY_READY_CONDITION, False, what)
    if unfinished is not None:
        return unfinished
    if _ran(status).get("specHash") != spec_hash(pm.spec):
        return []  # the spec changed: its new pipeline replaces these children
    spec = pm.parsed()
    if spec.suspend:
        return [Log(f"{what} done; the next step waits until spec.suspend is false")]
    following = next_step(spec, step)
    generation = _generation(status)
    job = step_job(following, pm.name, pm.namespace, generation, as_planned(spec, status))
    job_name = job["metadata"]["name"]
    return [PatchStatus(step_status(status, following, job_name, spec, generation)),
            CreateChild(JOBS, job, Emit("Normal", STEP_TEXT[following].created, step_message(following, job_name, spec)),
                        Failure(PROXY_READY_CONDITION, STEP_TEXT[following].what)),
            Log(f"{what} done: {following} Job {job_name}")]


def _asked(pm: _ProxyModel) -> str | None:
    """The --fail-on name the reproduction was given (the key of its report's cannot_show)."""
    fail_on = pm.parsed().reproduction.fail_on
    return fail_on.cli() if fail_on else None


def _reproduction_verdict(pm: _ProxyModel, verdict: Outcome) -> list[Action]:
    status = pm.status
    unfinished = _unfinished(status, verdict, REPRODUCED_CONDITION, None, "reproduction")
    if unfinished is not None:
        return unfinished
    result = reproduction_summary(verdict.report)
    if not verdict.report:
        phase, ok, reason = NOT_REPRODUCED, False, "NoReport"
        message = "the reproduction finished without a termination message; see its logs"
    elif "crash" in result and not result["reproduced"]:
        phase, ok, reason = NOT_REPRODUCED, False, CRASHED_REASON
        log = [line for line in result["crash"]["log"].splitlines() if line.strip()][-3:]
        message = verdict.report["stopped"] + ("; its log ends: " + " | ".join(log) if log else "")
    elif result["reproduced"]:
        signature = str(result["signature"] or "")
        phase, ok = REPRODUCED, True
        reason = SIGNATURE_REASONS.get(signature, "MetricThreshold" if signature else "FailureReproduced")
        message = verdict.report["stopped"] if "crash" in result else f"{signature} at step {result['step']}"
    elif why := cannot_show(verdict.report, _asked(pm)):  # not seen because it could not be: no verdict
        phase, ok, reason = NOT_REPRODUCED, None, "CannotShow"
        message = f"{COULD_NOT_JUDGE}: {why}"
    else:
        phase, ok, reason = NOT_REPRODUCED, False, "NotObserved"
        message = "the failure signature was not seen within the run"
    conditions = with_condition(status.get("conditions"),
                                condition(REPRODUCED_CONDITION, ok, reason, message, _generation(status)))
    return [PatchStatus({"phase": phase, "reproduction": result, "conditions": conditions}),
            Emit("Normal" if ok else "Warning", reason if ok or reason in (CRASHED_REASON, "CannotShow") else "NotReproduced",
                 message[:MAX_EVENT]),
            Log(f"reproduction: {phase} ({message})")]


def _reproduction(pm: _ProxyModel, status: dict, into: dict) -> tuple[Runtime, dict]:
    """The reproduction workload's manifest, recorded in the status patch `into` (pending over
    `status`): its name and runtime, phase Reproducing, and its condition."""
    spec = pm.parsed()
    r = spec.reproduction
    generation = _generation(status)
    devices = r.accelerator.devices or ((status.get("plan") or {}).get("proxy") or {}).get("devices")
    if not devices:  # validate refuses `auto` without a plan, so this is a bug
        raise RuntimeError("no device count: no plan and spec.reproduction.accelerator.devices is auto")
    proxy = status.get("proxy") or into.get("proxy") or {}
    experts = proxy.get("expertsPerLayer") or {}
    manifest = reproduction_workload(pm.name, pm.namespace, generation, spec, proxy["uri"],
                                     proxy.get("manifestSha256") or "", devices, experts.get("after"),
                                     experts.get("topK"))
    child = manifest["metadata"]["name"]
    into["pipeline"] = {**_ran(status), "reproductionJob": child, "reproductionKind": r.runtime}
    into["phase"] = REPRODUCING
    into["conditions"] = with_condition(into.get("conditions", status.get("conditions")), condition(
        REPRODUCED_CONDITION, None, "ReproductionRunning",
        f"{r.runtime} {child} runs up to {r.max_steps} steps on {devices} x {r.accelerator.resource}", generation))
    return RUNTIMES[r.runtime], manifest


def _create_reproduction(runtime: Runtime, manifest: dict, resumed: PatchStatus | None = None) -> list[Action]:
    """The workload, after the headless Service its pods' host names need (if any): both owned
    by the ProxyModel, both created once (one that exists counts as created). A refused Service
    holds the workload back (pods that cannot resolve each other would only time out) and is
    tried again; `resumed` is written once it is there."""
    container = runtime.pod_templates(manifest["spec"])[0]["spec"]["containers"][0]
    devices = next(iter((container.get("resources") or {}).get("limits", {}).items()), ("", ""))
    created = Emit("Normal", "ReproductionCreated",
                   f"{manifest['kind']} {manifest['metadata']['name']} ({devices[1]} x {devices[0]} per pod)")
    refused = Failure(REPRODUCED_CONDITION, "reproduction")
    service = headless_service(runtime, manifest)
    first: list[Action] = [CreateChild(SERVICES, service, refused=replace(refused, retry=True))] if service else []
    return first + ([resumed] if resumed else []) + [CreateChild(runtime.resource, manifest, created, refused)]
