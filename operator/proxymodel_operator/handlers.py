"""The kopf handlers. Read top-down: operator set-up, the ProxyModel pipeline (create and
resume, then spec changes), the handlers that follow the children, clean-up on deletion.

Status is the single source of truth: `status.pipeline` records which spec the pipeline
runs for (`specHash`), the generation its children are named after, their names, and which
transformer step runs (`transformerStep`: the single build, or calibrate -> workers ->
finalize when several workers share it). A handler decides what to do from it, so an
operator restart never redoes a finished step and never makes a second child.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, NoReturn

import kopf

from . import kube, settings as settings_module
from .children import FINALIZE, REPRODUCTION, TRANSFORMER
from .outcome import FAILED, RUNNING, SUCCEEDED, Outcome, count_indexes, outcome, workload_state
from .preflight import PreflightError, preflight
from .reproduction import reproduction_workload
from .resources import (ASCEND_JOBS, GROUP, JOBS, LABEL_CHILD, LABEL_GENERATION, LABEL_PROXYMODEL, LABEL_ROLE,
                        PODS, PROXYMODELS, RUNTIMES, VERSION, VOLCANO_JOBS, Resource)
from .spec import SIGNATURE_REASONS, InvalidSpec, ProxyModelSpec, parse
from .status import (ACCEPTED, FAILED as PHASE_FAILED, NOT_REPRODUCED, PENDING, PROXY_READY,
                     PROXY_READY_CONDITION, REPRODUCED, REPRODUCED_CONDITION, REPRODUCING, SUSPENDED,
                     SUSPENDED_CONDITION, TERMINAL, TRANSFORMING, arrow, condition, plan_summary, proxy_summary,
                     reproduction_summary, with_condition)
from .transformer_job import BUILD, STEP_TEXT, WORKERS, next_step, step_job, step_message, steps

PXM = (GROUP, VERSION, "proxymodels")
RETRY_DELAY = 30  # seconds before a step that waits on the outside world is tried again
# Spec fields that change how the pipeline runs, not what it builds: no restart for them.
RUN_CONTROL_FIELDS = ("suspend", "ttlSecondsAfterFinished")

config = settings_module.Settings()  # replaced from the environment at start-up
_locks: dict[tuple[str, str], asyncio.Lock] = {}  # one child verdict at a time per ProxyModel


# --- operator set-up -------------------------------------------------------------------------


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, logger: logging.Logger, **_: Any) -> None:
    global config
    config = settings_module.from_env()
    _locks.clear()  # they belong to the event loop of a previous run (tests restart the operator)
    # kopf's own bookkeeping goes in annotations, so status stays ours.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    settings.persistence.finalizer = f"{GROUP}/cleanup"
    settings.posting.level = logging.WARNING  # handler failures become Events; successes do not
    # Watch only our children and their pods (the API server filters): never every pod of a cluster.
    children = f"{LABEL_PROXYMODEL},{LABEL_ROLE}"
    for resource in (JOBS, VOLCANO_JOBS, ASCEND_JOBS, PODS):
        settings.watching.label_selectors[resource.group or resource.version, resource.plural] = children
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    logger.info("watching %s; default accelerator %s; preflight %s",
                ", ".join(config.namespaces) or "all namespaces", config.accelerator,
                "on" if config.preflight else "off")


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """kopf's own logins (in-cluster service account, else kubeconfig); our client uses the same."""
    info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
    if info is not None:
        kube.configure(info)
    return info


@kopf.on.cleanup()
async def close_client(**_: Any) -> None:
    await kube.close()


# --- helpers over status ---------------------------------------------------------------------


def spec_hash(spec: dict) -> str:
    """What the pipeline builds depends on every spec field except the run-control ones."""
    essence = {k: v for k, v in spec.items() if k not in RUN_CONTROL_FIELDS}
    return hashlib.sha256(json.dumps(essence, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _status(patch: kopf.Patch, status: dict, key: str) -> Any:
    """A status field as it will be after this handler: the pending patch wins."""
    return patch.status[key] if key in patch.status else status.get(key)


def _set_condition(patch: kopf.Patch, status: dict, new: dict) -> None:
    patch.status["conditions"] = with_condition(_status(patch, status, "conditions"), new)


def _parse(spec: dict, namespace: str, name: str) -> ProxyModelSpec:
    return parse(dict(spec), namespace, name, config)


def _as_planned(spec: ProxyModelSpec, status: dict) -> ProxyModelSpec:
    """The spec with the plan's expert count in place of a keep ratio. The planner may keep
    more than the ratio says (at least 2 x top-k where the device budget holds it); the build
    must make the proxy that was planned and that the reproduction was sized for."""
    planned = ((status.get("plan") or {}).get("proxy") or {}).get("expertsPerLayer")
    if spec.pruning.experts is not None or not planned:
        return spec
    return replace(spec, pruning=replace(spec.pruning, experts=int(planned)))


def _refuse(body: kopf.Body, patch: kopf.Patch, status: dict, generation: int, reason: str, message: str) -> NoReturn:
    """Bad input: say so in status and an Event, then stop (kopf.PermanentError)."""
    _set_condition(patch, status, condition(ACCEPTED, False, reason, message, generation))
    patch.status["phase"] = PHASE_FAILED
    patch.status["message"] = message
    kopf.warn(body, reason=reason, message=message)
    raise kopf.PermanentError(f"{reason}: {message}")


async def _delete_children(namespace: str, proxymodel: str, keep_generation: int | None) -> list[str]:
    """Delete the children of other generations (all of them when keep_generation is None)."""
    deleted = []
    for resource in {JOBS, VOLCANO_JOBS, ASCEND_JOBS}:
        try:
            children = await kube.list_(resource, namespace, {LABEL_PROXYMODEL: proxymodel})
        except kube.ApiError as exc:
            if exc.status == 404:  # that runtime's CRD is not installed
                continue
            raise
        for child in children:
            meta = child["metadata"]
            if keep_generation is None or meta.get("labels", {}).get(LABEL_GENERATION) != str(keep_generation):
                if await kube.delete(resource, namespace, meta["name"]):
                    deleted.append(meta["name"])
    return deleted


# --- the pipeline: create and resume -----------------------------------------------------------


@kopf.on.resume(*PXM)
@kopf.on.create(*PXM)
async def pipeline(spec: kopf.Spec, status: kopf.Status, meta: kopf.Meta, body: kopf.Body, namespace: str,
                   name: str, patch: kopf.Patch, **_: Any) -> None:
    """Run the pipeline for this spec unless status shows it already runs (a resume after a
    restart, or the create event seen again)."""
    ran = status.get("pipeline") or {}
    if ran.get("specHash") == spec_hash(dict(spec)) and ran.get("transformerJob"):
        await _ensure_recorded_child(dict(body))
        return
    if spec.get("suspend"):
        _suspend(patch, status, meta.get("generation") or 1)
        return
    await _run_steps()


async def _ensure_recorded_child(body: dict) -> None:
    """Status records each child before it is created; if the operator stopped in between,
    the child of the step in progress is created now (AlreadyExists is the usual answer)."""
    status, meta = body.get("status") or {}, body["metadata"]
    ran, phase = status.get("pipeline") or {}, status.get("phase")
    if phase == TRANSFORMING and not status.get("proxy"):
        spec = _parse(body["spec"], meta["namespace"], meta["name"])
        step = ran.get("transformerStep") or BUILD  # absent in the status of older operators
        job = step_job(step, meta["name"], meta["namespace"], ran["generation"], _as_planned(spec, status))
        kopf.adopt(job, owner=body)
        if not await kube.exists(JOBS, meta["namespace"], job["metadata"]["name"]):
            await kube.create(JOBS, meta["namespace"], job)
            kopf.event(body, type="Normal", reason=STEP_TEXT[step].created, message=f"Job {job['metadata']['name']}")
    elif phase == REPRODUCING and not status.get("reproduction") and ran.get("reproductionJob"):
        resource = RUNTIMES[ran.get("reproductionKind") or "Job"]
        if not await kube.exists(resource, meta["namespace"], ran["reproductionJob"]):
            await _create_reproduction(body, _record_reproduction(body, patch_into={}))


async def _run_steps() -> None:
    """The pipeline's steps as kopf sub-handlers: one at a time, in order, each recorded as done
    in an annotation, so a retry or a restart never redoes a finished step."""
    await kopf.execute(fns={"validate": validate, "transform": transform}, lifecycle=kopf.lifecycles.one_by_one)


def _suspend(patch: kopf.Patch, status: dict, generation: int) -> None:
    patch.status["phase"] = SUSPENDED
    patch.status["observedGeneration"] = generation
    _set_condition(patch, status, condition(SUSPENDED_CONDITION, True, "SuspendedBySpec",
                                            "spec.suspend is true: no new child is created", generation))


async def validate(spec: kopf.Spec, status: kopf.Status, meta: kopf.Meta, body: kopf.Body, namespace: str,
                   name: str, patch: kopf.Patch, logger: logging.Logger, **_: Any) -> None:
    """Step 1: the spec beyond the schema, then the source checkpoint's config.json and a plan."""
    generation = meta.get("generation") or 1
    patch.status["observedGeneration"] = generation
    try:
        parsed = _parse(spec, namespace, name)
    except InvalidSpec as exc:
        _refuse(body, patch, status, generation, "InvalidSpec", str(exc))
    if parsed.reproduction.enabled and parsed.reproduction.accelerator.devices is None and not config.preflight:
        _refuse(body, patch, status, generation, "InvalidSpec",
                "spec.reproduction.accelerator.devices is auto, which needs the preflight read of config.json "
                "(disabled in this operator): set a device count")

    plan = None
    if config.preflight:
        try:
            plan = (await preflight(namespace, parsed, config)).plan
        except PreflightError as exc:
            if not exc.retry:
                _refuse(body, patch, status, generation, exc.reason, exc.message)
            _set_condition(patch, status, condition(ACCEPTED, False, exc.reason, exc.message, generation))
            patch.status["phase"] = PENDING
            raise kopf.TemporaryError(f"{exc.reason}: {exc.message}", delay=RETRY_DELAY)

    patch.status["pipeline"] = {"specHash": spec_hash(dict(spec)), "generation": generation, "transformerJob": None,
                                "transformerStep": None, "reproductionJob": None, "reproductionKind": None}
    patch.status.update(phase=PENDING, message=None, proxy=None, reproduction=None, workers=None,
                        plan=plan_summary(plan) if plan else None)
    conditions = [c for c in status.get("conditions") or [] if c.get("type") == ACCEPTED]
    patch.status["conditions"] = conditions
    if plan:
        patch.status["experts"] = arrow(plan.original.experts_per_layer, plan.proxy.experts_per_layer)
        devices = parsed.reproduction.accelerator.devices or plan.proxy.devices
        patch.status["accelerators"] = arrow(plan.original.devices, devices)
        message = (f"{plan.architecture}: {plan.original.experts_per_layer} -> {plan.proxy.experts_per_layer} experts "
                   f"per layer; {plan.original.devices} -> {devices} x {plan.accelerator}"
                   + "".join(f"; {note}" for note in plan.notes))
    else:
        message = "spec accepted (preflight disabled)"
    _set_condition(patch, status, condition(ACCEPTED, True, "SpecValid", message, generation))
    logger.info(message)


async def transform(spec: kopf.Spec, status: kopf.Status, meta: kopf.Meta, body: kopf.Body, namespace: str,
                    name: str, patch: kopf.Patch, logger: logging.Logger, **_: Any) -> None:
    """Step 2: replace older generations' children by this generation's first transformer Job
    (the build; with several workers, calibration or the workers)."""
    if (status.get("pipeline") or {}).get("specHash") != spec_hash(dict(spec)):
        logger.info("no transformer Job: this spec was not accepted (see the Accepted condition)")
        return  # kopf runs the next sub-handler even after one failed permanently
    generation = meta.get("generation") or 1
    parsed = _parse(spec, namespace, name)
    # Generation 1 has no older children: skip the three listings (they add up at scale).
    deleted = await _delete_children(namespace, name, keep_generation=generation) if generation > 1 else []
    if deleted:
        kopf.event(body, type="Normal", reason="ChildrenReplaced",
                   message=f"deleted {', '.join(sorted(deleted))} of an older spec")
    step = steps(parsed)[0]
    job = step_job(step, name, namespace, generation, _as_planned(parsed, dict(status)))
    kopf.adopt(job, owner=body)
    job_name = job["metadata"]["name"]
    # Status first, then the Job: whatever the Job does next, its handler finds it recorded.
    recorded = _step_status(dict(status), step, job_name, parsed, generation)
    recorded["pipeline"]["specHash"] = spec_hash(dict(spec))
    await kube.patch_status(PROXYMODELS, namespace, name, recorded)
    _, created = await kube.create(JOBS, namespace, job)
    if created:
        kopf.event(body, type="Normal", reason=STEP_TEXT[step].created, message=step_message(step, job_name, parsed))
    logger.info("%s Job %s %s", step, job_name, "created" if created else "already exists")


def _step_status(status: dict, step: str, job_name: str, spec: ProxyModelSpec, generation: int) -> dict:
    """The status that records `job_name` as the transformer step in progress (written before
    the Job is created)."""
    text = STEP_TEXT[step]
    recorded = {
        "pipeline": {**(status.get("pipeline") or {}), "generation": generation, "transformerJob": job_name,
                     "transformerStep": step},
        "phase": TRANSFORMING,
        "conditions": with_condition(status.get("conditions"), condition(
            PROXY_READY_CONDITION, False, text.running, step_message(step, job_name, spec), generation)),
    }
    if spec.workers > 1:  # workers done, of all: every worker before finalize, none before
        recorded["workers"] = f"{spec.workers if step == FINALIZE else 0}/{spec.workers}"
    return recorded


# --- spec changes ------------------------------------------------------------------------------


@kopf.on.update(*PXM, field="spec")
async def spec_changed(spec: kopf.Spec, status: kopf.Status, meta: kopf.Meta, body: kopf.Body, namespace: str,
                       name: str, patch: kopf.Patch, logger: logging.Logger, **_: Any) -> None:
    """A new spec restarts the pipeline (old children deleted); suspend and TTL alone do not."""
    generation = meta.get("generation") or 1
    ran = status.get("pipeline") or {}
    if ran.get("specHash") != spec_hash(dict(spec)):
        if spec.get("suspend"):
            deleted = await _delete_children(namespace, name, keep_generation=None)
            patch.status.update(pipeline=None, proxy=None, reproduction=None, plan=None, workers=None)
            _suspend(patch, status, generation)
            logger.info("spec changed while suspended; deleted %s", deleted or "nothing")
            return
        logger.info("spec changed: restarting the pipeline at generation %s", generation)
        await _run_steps()
        return

    patch.status["observedGeneration"] = generation
    if spec.get("suspend"):
        if status.get("phase") not in TERMINAL:
            _suspend(patch, status, generation)
        return
    _set_condition(patch, status, condition(SUSPENDED_CONDITION, False, "Resumed",
                                            "spec.suspend is false", generation))
    if not ran.get("transformerJob"):  # suspended before the first Job: start now
        await _run_steps()
        return
    if status.get("phase") == SUSPENDED:
        patch.status["phase"] = REPRODUCING if ran.get("reproductionJob") else (
            PROXY_READY if status.get("proxy") else TRANSFORMING)
        if status.get("proxy") and not ran.get("reproductionJob"):
            fresh = {**await kube.get(PROXYMODELS, namespace, name), "spec": dict(spec)}
            manifest = _record_reproduction(fresh, patch_into=patch.status)
            await kube.patch_status(PROXYMODELS, namespace, name, dict(patch.status))  # before the child exists
            await _create_reproduction(fresh, manifest)
        elif not status.get("proxy") and ran.get("transformerStep") not in (None, BUILD, FINALIZE):
            # A step before the workers' finalize may have succeeded while suspended, its next
            # Job held back: judge it again now. Status is written first and dropped from kopf's
            # patch, which would otherwise put back the conditions the judge is about to change.
            await kube.patch_status(PROXYMODELS, namespace, name, dict(patch.status))
            patch.pop("status", None)
            labels = {LABEL_PROXYMODEL: name, LABEL_ROLE: TRANSFORMER, LABEL_CHILD: ran["transformerJob"]}
            await judge_child(JOBS, namespace, labels, None, logger)


# --- following the children --------------------------------------------------------------------


def _resource_of(kopf_resource: kopf.Resource) -> Resource:
    for r in (JOBS, VOLCANO_JOBS, ASCEND_JOBS):
        if (r.group, r.version, r.plural) == (kopf_resource.group, kopf_resource.version, kopf_resource.plural):
            return r
    raise ValueError(f"not a child resource: {kopf_resource}")


CHILD_LABELS = {LABEL_PROXYMODEL: kopf.PRESENT, LABEL_ROLE: kopf.PRESENT}


@kopf.on.event(JOBS.group, JOBS.version, JOBS.plural, labels=CHILD_LABELS)
@kopf.on.event(VOLCANO_JOBS.group, VOLCANO_JOBS.version, VOLCANO_JOBS.plural, labels=CHILD_LABELS)
@kopf.on.event(ASCEND_JOBS.group, ASCEND_JOBS.version, ASCEND_JOBS.plural, labels=CHILD_LABELS)
async def child_changed(event: dict, body: kopf.Body, resource: kopf.Resource, namespace: str,
                        logger: logging.Logger, **_: Any) -> None:
    """A child workload changed: maybe it finished."""
    child = _resource_of(resource)
    if event.get("type") == "DELETED" or workload_state(child, dict(body)) == Outcome(RUNNING):
        return  # nothing to report yet (its pods' own events report pull errors and the like)
    labels = body.get("metadata", {}).get("labels", {})
    await judge_child(child, namespace, labels, dict(body), logger)


@kopf.on.event(PODS.group, PODS.version, PODS.plural, labels={LABEL_CHILD: kopf.PRESENT, LABEL_ROLE: kopf.PRESENT})
async def pod_changed(event: dict, body: kopf.Body, namespace: str, logger: logging.Logger, **_: Any) -> None:
    """A child's pod changed: a pull that never succeeds or an unschedulable pod shows only here."""
    if event.get("type") == "DELETED":
        return
    labels = body.get("metadata", {}).get("labels", {})
    await judge_child(None, namespace, labels, None, logger)


async def judge_child(resource: Resource | None, namespace: str, labels: dict, workload: dict | None,
                      logger: logging.Logger) -> None:
    """Read the child's verdict and carry it into its ProxyModel's status. Status is written
    only if nobody changed the ProxyModel meanwhile; otherwise it is read and judged again."""
    proxymodel, role, child = labels.get(LABEL_PROXYMODEL), labels.get(LABEL_ROLE), labels.get(LABEL_CHILD)
    if not (proxymodel and role in (TRANSFORMER, REPRODUCTION) and child):
        return
    await _one_at_a_time(namespace, proxymodel,
                         lambda: _judge_once(resource, namespace, proxymodel, role, child, workload, logger))


async def _one_at_a_time(namespace: str, proxymodel: str, decide: Callable[[], Awaitable[None]]) -> None:
    """Run `decide` (it reads the ProxyModel and writes status at the version it read) alone for
    this ProxyModel; when somebody else wrote meanwhile (409), it reads and decides again."""
    async with _locks.setdefault((namespace, proxymodel), asyncio.Lock()):
        for attempt in range(3):
            try:
                return await decide()
            except kube.ApiError as exc:
                if exc.status != 409 or attempt == 2:
                    raise


async def _get_parent(namespace: str, proxymodel: str) -> dict | None:
    try:
        return await kube.get(PROXYMODELS, namespace, proxymodel)
    except kube.ApiError as exc:
        if exc.status == 404:
            return None  # the ProxyModel is gone; its children follow through owner references
        raise


async def _judge_once(resource: Resource | None, namespace: str, proxymodel: str, role: str, child: str,
                      workload: dict | None, logger: logging.Logger) -> None:
    parent = await _get_parent(namespace, proxymodel)
    if parent is None:
        return
    status = parent.get("status") or {}
    ran = status.get("pipeline") or {}
    current = ran.get("transformerJob") if role == TRANSFORMER else ran.get("reproductionJob")
    if child != current:
        return  # a child of an older spec, being deleted
    if role == TRANSFORMER and status.get("proxy") or role == REPRODUCTION and status.get("reproduction"):
        return  # this step's verdict is in status already
    if status.get("phase") == PHASE_FAILED:
        return
    if resource is None:  # from a pod event: read the workload it belongs to
        resource = JOBS if role == TRANSFORMER else RUNTIMES[ran.get("reproductionKind") or "Job"]
    if workload is None:
        workload = await kube.get(resource, namespace, child)
    pods = await kube.list_(PODS, namespace, {LABEL_CHILD: child})
    verdict = outcome(resource, workload, pods)
    step = ran.get("transformerStep") or BUILD
    if role == REPRODUCTION:
        await _reproduction_verdict(parent, verdict, logger)
    elif step in (BUILD, FINALIZE):  # the Job that reports the proxy
        await _transformer_verdict(parent, verdict, STEP_TEXT[step].what, logger)
    else:
        await _step_verdict(parent, verdict, step, workload, logger)


async def _patch_parent(parent: dict, status_patch: dict) -> None:
    meta = parent["metadata"]
    await kube.patch_status(PROXYMODELS, meta["namespace"], meta["name"], status_patch, meta.get("resourceVersion"))


def _generation(parent: dict) -> int:
    return (parent.get("status") or {}).get("pipeline", {}).get("generation") or 1


async def _transformer_verdict(parent: dict, verdict: Outcome, what: str, logger: logging.Logger) -> None:
    status, generation = parent.get("status") or {}, _generation(parent)
    conditions = status.get("conditions") or []
    if await _unfinished(parent, verdict, PROXY_READY_CONDITION, False, what):
        return
    report = verdict.report
    if not report.get("proxy_uri"):
        await _fail(parent, PROXY_READY_CONDITION, "NoProxyReport",
                    f"the {what} Job succeeded without reporting a proxy in its termination message", what)
        return
    proxy = proxy_summary(report)
    experts = proxy["expertsPerLayer"]
    message = f"proxy at {proxy['uri']}: {experts['before']} -> {experts['after']} experts per layer"
    patch = {"phase": PROXY_READY, "proxy": proxy, "experts": arrow(experts["before"], experts["after"]),
             "conditions": with_condition(conditions, condition(PROXY_READY_CONDITION, True, "ProxyBuilt",
                                                                message, generation))}
    logger.info(message)
    spec = parse(parent.get("spec") or {}, parent["metadata"]["namespace"], parent["metadata"]["name"], config)
    manifest = None
    if spec.reproduction.enabled and not spec.suspend:
        manifest = _record_reproduction({**parent, "status": {**status, **patch}}, patch_into=patch)
    elif spec.suspend:
        patch["phase"] = SUSPENDED
    await _patch_parent(parent, patch)
    kopf.event(parent, type="Normal", reason="ProxyReady", message=message)
    if manifest is not None:
        await _create_reproduction(parent, manifest)


async def _step_verdict(parent: dict, verdict: Outcome, step: str, workload: dict, logger: logging.Logger) -> None:
    """A transformer step before the last (calibration, the workers) finished: on success, record
    and create the next step's Job. The workers' Indexed Job succeeds only once every index has."""
    meta, status, generation = parent["metadata"], parent.get("status") or {}, _generation(parent)
    what = STEP_TEXT[step].what
    failed_indexes = (workload.get("status") or {}).get("failedIndexes")
    if verdict.state == FAILED and failed_indexes:
        verdict = replace(verdict, message=f"worker index(es) {failed_indexes} failed; {verdict.message}".rstrip("; "))
    if await _unfinished(parent, verdict, PROXY_READY_CONDITION, False, what):
        return
    if (status.get("pipeline") or {}).get("specHash") != spec_hash(parent.get("spec") or {}):
        return  # the spec changed: its new pipeline replaces these children
    spec = parse(parent.get("spec") or {}, meta["namespace"], meta["name"], config)
    if spec.suspend:
        logger.info("%s done; the next step waits until spec.suspend is false", what)
        return
    following = next_step(spec, step)
    job = step_job(following, meta["name"], meta["namespace"], generation, _as_planned(spec, status))
    kopf.adopt(job, owner=parent)
    job_name = job["metadata"]["name"]
    await _patch_parent(parent, _step_status(status, following, job_name, spec, generation))
    if await _create_child(parent, JOBS, job, PROXY_READY_CONDITION, STEP_TEXT[following].what):
        kopf.event(parent, type="Normal", reason=STEP_TEXT[following].created,
                   message=step_message(following, job_name, spec))
    logger.info("%s done: %s Job %s", what, following, job_name)


def _is_indexed(body: kopf.Body, **_: Any) -> bool:
    return (body.get("spec") or {}).get("completionMode") == "Indexed"


@kopf.on.event(JOBS.group, JOBS.version, JOBS.plural, labels={LABEL_PROXYMODEL: kopf.PRESENT, LABEL_ROLE: TRANSFORMER},
               when=_is_indexed)
async def workers_progress(event: dict, body: kopf.Body, namespace: str, **_: Any) -> None:
    """The workers' Indexed Job finished another index: `status.workers` shows done/all. (Its
    verdict, and the finalize Job after it, are child_changed's.)"""
    if event.get("type") == "DELETED":
        return
    meta, job_status = body.get("metadata") or {}, body.get("status") or {}
    proxymodel, child = meta["labels"][LABEL_PROXYMODEL], meta["name"]
    progress = f"{count_indexes(job_status.get('completedIndexes'))}/{(body.get('spec') or {}).get('completions')}"

    async def record() -> None:
        parent = await _get_parent(namespace, proxymodel)
        status = (parent or {}).get("status") or {}
        ran = status.get("pipeline") or {}
        if parent is None or (ran.get("transformerJob"), ran.get("transformerStep")) != (child, WORKERS) \
                or status.get("workers") == progress:
            return  # another step's, or an older spec's, or nothing new
        await _patch_parent(parent, {"workers": progress})

    await _one_at_a_time(namespace, proxymodel, record)


def _record_reproduction(parent: dict, patch_into: dict) -> dict:
    """Record the reproduction workload in `patch_into` and return its manifest; the caller
    writes the status, then creates it (`_create_reproduction`)."""
    meta, status = parent["metadata"], parent.get("status") or {}
    namespace, name = meta["namespace"], meta["name"]
    spec = parse(parent.get("spec") or {}, namespace, name, config)
    generation = _generation(parent)
    devices = spec.reproduction.accelerator.devices or ((status.get("plan") or {}).get("proxy") or {}).get("devices")
    if not devices:  # validate refuses `auto` without a plan, so this is a bug
        raise RuntimeError("no device count: no plan and spec.reproduction.accelerator.devices is auto")
    proxy = status.get("proxy") or patch_into.get("proxy") or {}
    manifest = reproduction_workload(name, namespace, generation, spec, proxy["uri"], proxy.get("manifestSha256") or "",
                                     devices)
    kopf.adopt(manifest, owner=parent)
    child = manifest["metadata"]["name"]
    patch_into["pipeline"] = {**(status.get("pipeline") or {}), "reproductionJob": child,
                              "reproductionKind": spec.reproduction.runtime}
    patch_into["phase"] = REPRODUCING
    conditions = patch_into.get("conditions", status.get("conditions"))
    patch_into["conditions"] = with_condition(conditions, condition(
        REPRODUCED_CONDITION, None, "ReproductionRunning",
        f"{spec.reproduction.runtime} {child} runs up to {spec.reproduction.max_steps} steps on {devices} x "
        f"{spec.reproduction.accelerator.resource}", generation))
    return manifest


async def _create_child(parent: dict, resource: Resource, manifest: dict, kind: str, what: str) -> bool:
    """Create a child recorded in status; an API refusal fails the ProxyModel visibly. True
    when it was created now (False: it existed, or the API refused it)."""
    try:
        _, created = await kube.create(resource, parent["metadata"]["namespace"], manifest)
    except kube.ApiError as exc:
        # Status changed since `parent` was read (we just recorded the child): patch unconditionally.
        unversioned = {**parent, "metadata": {**parent["metadata"], "resourceVersion": None}}
        await _fail(unversioned, kind, "CreateFailed",
                    f"creating {manifest['kind']} {manifest['metadata']['name']}: {exc}", what)
        return False
    return created


async def _create_reproduction(parent: dict, manifest: dict) -> None:
    """Create the recorded reproduction workload."""
    kind = manifest["kind"]
    resource = next(r for r in RUNTIMES.values() if (r.api_version, r.kind) == (manifest["apiVersion"], kind))
    if await _create_child(parent, resource, manifest, REPRODUCED_CONDITION, "reproduction"):
        container = _first_container(manifest)
        devices = next(iter((container.get("resources") or {}).get("limits", {}).items()), ("", ""))
        kopf.event(parent, type="Normal", reason="ReproductionCreated",
                   message=f"{kind} {manifest['metadata']['name']} ({devices[1]} x {devices[0]} per pod)")


def _first_container(manifest: dict) -> dict:
    spec = manifest["spec"]
    template = spec.get("template") or (spec.get("tasks") or [{}])[0].get("template") or \
        spec["replicaSpecs"]["Master"]["template"]
    return template["spec"]["containers"][0]


async def _reproduction_verdict(parent: dict, verdict: Outcome, logger: logging.Logger) -> None:
    status, generation = parent.get("status") or {}, _generation(parent)
    conditions = status.get("conditions") or []
    if await _unfinished(parent, verdict, REPRODUCED_CONDITION, None, "reproduction"):
        return
    result = reproduction_summary(verdict.report)
    if not verdict.report:
        phase, ok, reason = NOT_REPRODUCED, False, "NoReport"
        message = "the reproduction finished without a termination message; see its logs"
    elif result["reproduced"]:
        signature = str(result["signature"] or "")
        phase, ok = REPRODUCED, True
        reason = SIGNATURE_REASONS.get(signature, "MetricThreshold" if signature else "FailureReproduced")
        message = f"{signature} at step {result['step']}"
    else:
        phase, ok, reason = NOT_REPRODUCED, False, "NotObserved"
        message = "the failure signature was not seen within the run"
    await _patch_parent(parent, {
        "phase": phase, "reproduction": result,
        "conditions": with_condition(conditions, condition(REPRODUCED_CONDITION, ok, reason, message, generation)),
    })
    kopf.event(parent, type="Normal" if ok else "Warning", reason=reason if ok else "NotReproduced", message=message)
    logger.info("reproduction: %s (%s)", phase, message)


async def _unfinished(parent: dict, verdict: Outcome, kind: str, running_status: bool | None, step: str) -> bool:
    """Carry a running child's notable state (e.g. Unschedulable) or a failure into status;
    True unless the child succeeded."""
    if verdict.state == SUCCEEDED:
        return False
    if verdict.state == FAILED:
        await _fail(parent, kind, verdict.reason, verdict.message, step)
        return True
    conditions = (parent.get("status") or {}).get("conditions") or []
    if verdict.reason and not any(c.get("reason") == verdict.reason for c in conditions):
        new = condition(kind, running_status, verdict.reason, verdict.message, _generation(parent))
        await _patch_parent(parent, {"conditions": with_condition(conditions, new)})
        kopf.warn(parent, reason=verdict.reason, message=f"{step}: {verdict.message}"[:1024])
    return True


async def _fail(parent: dict, kind: str, reason: str, message: str, step: str) -> None:
    status = parent.get("status") or {}
    conditions = with_condition(status.get("conditions"), condition(kind, False, reason, message, _generation(parent)))
    await _patch_parent(parent, {"phase": PHASE_FAILED, "message": f"{step} failed: {reason}: {message}"[:1024],
                                 "conditions": conditions})
    kopf.warn(parent, reason=reason, message=f"{step} failed: {message}"[:1024])


# --- deletion ----------------------------------------------------------------------------------


def _wants_cleanup(spec: kopf.Spec, **_: Any) -> bool:
    return bool((spec.get("cleanup") or {}).get("deleteProxy"))


@kopf.on.delete(*PXM, when=_wants_cleanup, retries=3, backoff=10, timeout=300)
async def delete_proxy(spec: kopf.Spec, namespace: str, name: str, retry: int, logger: logging.Logger,
                       **_: Any) -> None:
    """Only when spec.cleanup.deleteProxy asks: remove the proxy from object storage. Best
    effort: after the last retry the finalizer goes anyway, so deletion never hangs."""
    from .cleanup import delete_prefix

    parsed = _parse(spec, namespace, name)
    try:
        count = await delete_prefix(namespace, parsed)
        logger.info("deleted %d objects under %s", count, parsed.destination)
    except Exception as exc:  # noqa: BLE001 - reported, then released
        if retry < 2:
            raise kopf.TemporaryError(f"deleting {parsed.destination}: {exc}", delay=10) from None
        logger.warning("giving up deleting %s (%s); the ProxyModel is released anyway", parsed.destination, exc)
