"""The kopf handlers. Read top-down: operator set-up, the ProxyModel pipeline (create and
resume, validation, spec changes), the handlers that follow the children, clean-up on deletion.

Each handler observes (the ProxyModel, a child workload, its pods, whether a recorded child
exists), asks `pipeline.decide` what follows, and carries out the actions (`_act`). Status is
the single source of truth (see pipeline.py), so an operator restart never redoes a finished
step and never makes a second child. The operator's settings come from the environment once,
at start-up, into kopf's `memo`; every handler takes them from there.

A refusal (bad input, a missing Secret, an unreadable source) is a status outcome, not a
handler failure: the Accepted condition, `status.refusal` recording what the judgment
depended on (the operator's settings, the Secret's resourceVersion, the sha256 of the source's
config.json), and one Warning Event. It is judged again only when one of those changes: at a
restart (`admit`), or when the `recheck` daemon, every MOEPROXY_RECHECK_INTERVAL seconds, sees
a change and sets the `operator.moeproxy.io/recheck` annotation (a user may set it too) that `rejudge`
follows. A child the API server refuses in a way that may pass (the headless Service of a
multi-node reproduction) holds back what needs it; the `recreate` daemon tries it again as often.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import kopf

from . import kube, pipeline
from .children import REPRODUCTION, TRANSFORMER
from .outcome import RUNNING, Outcome, count_indexes, outcome, workload_state
from .pipeline import (ADMITTED, CHILD_CHANGED, RECHECK, REJUDGE, RETRY, SPEC_CHANGED, VALIDATED, WORKERS_PROGRESS,
                       Action, AskJudgment, Child, CreateChild, DeleteChildren, Emit, JudgeChild, Log, Observed,
                       PatchStatus, StartPipeline, decide, spec_hash)
from .preflight import PreflightError, dependencies, preflight, settings_fingerprint
from . import runtimes
from .resources import (GROUP, JOBS, LABEL_CHILD, LABEL_GENERATION, LABEL_PROXYMODEL, LABEL_ROLE, PODS, PROXYMODELS,
                        SERVICES, VERSION, Resource)
from .runtimes import CHILDREN, RUNTIME_MISSING, runtime_of
from .settings import Settings, from_env
from .spec import InvalidSpec, parse

PXM = (GROUP, VERSION, "proxymodels")
# Set: a refused ProxyModel is judged again. (Not under moeproxy.io/: kopf keeps its own records
# there and leaves those annotations out of what it compares between versions.)
RECHECK_ANNOTATION = f"operator.{GROUP}/recheck"


class _RefusalOutcome(logging.Filter):
    """kopf reports "Handler 'pipeline' succeeded." and "Creation is processed: 1 succeeded"
    whenever a handler returns, and a refusal is an outcome the handler returns with: for a
    refused ProxyModel, those lines say so instead."""

    def __init__(self) -> None:
        super().__init__()
        self.refusing: dict[tuple[str, str], str] = {}  # (namespace, name) -> reason, until reported

    def filter(self, record: logging.LogRecord) -> bool:
        ref, message = getattr(record, "k8s_ref", None), record.msg
        if not ref or not isinstance(message, str):
            return True
        if message == "Daemon 'recheck' succeeded.":  # it returns when the refusal is gone or on exit
            record.msg, record.args = "Daemon 'recheck' stopped looking at the refusal's dependencies.", ()
            return True
        key = (ref.get("namespace"), ref.get("name"))
        reason = self.refusing.get(key)
        if reason is None:
            return True
        if message.startswith(("Handler 'pipeline", "Handler 'rejudge")) and message.endswith(" succeeded."):
            record.msg = f"{message[:-len(' succeeded.')]} refused the ProxyModel: {reason} (see its Accepted condition)."
            record.args = ()
        elif " is processed: " in message:  # kopf's summary of the handlers: the last line about it
            del self.refusing[key]
            record.msg = f"{message.split(' is processed: ')[0]} is processed: the ProxyModel is refused ({reason})."
            record.args = ()
        return True


REFUSALS = _RefusalOutcome()


# --- operator set-up -------------------------------------------------------------------------


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    # The operator-wide memo: kopf gives each object a shallow copy, so these reach every handler.
    memo.settings = config = from_env()
    # One child verdict at a time per ProxyModel. Weak: a lock lives while a verdict holds or
    # waits for it, so there is never one per ProxyModel ever judged.
    memo.verdict_locks = weakref.WeakValueDictionary()
    # kopf's own bookkeeping goes in annotations, so status stays ours.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    settings.persistence.finalizer = f"{GROUP}/cleanup"
    settings.posting.level = logging.WARNING  # handler failures become Events; successes do not
    # Watch only our children and their pods (the API server filters): never every pod of a cluster.
    children = f"{LABEL_PROXYMODEL},{LABEL_ROLE}"
    for resource in (*runtimes.WORKLOADS, PODS):
        settings.watching.label_selectors[resource.group or resource.version, resource.plural] = children
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    logging.getLogger("kopf.objects").addFilter(REFUSALS)  # once: a filter is added only once
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


# --- acting on a decision --------------------------------------------------------------------------


@dataclass
class _Context:
    """Where a decision is carried out."""

    body: dict  # the ProxyModel as read: owner of the children, subject of the Events
    memo: kopf.Memo
    logger: logging.Logger
    patch: kopf.Patch | None = None  # the ProxyModel's own handlers: kopf writes it when they return
    versioned: bool = False  # child handlers write status only at the version they read


async def _act(actions: list[Action], ctx: _Context) -> None:
    meta = ctx.body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    status = dict(ctx.body.get("status") or {})  # as written so far
    for action in actions:
        if isinstance(action, PatchStatus):
            status.update(action.status)
            if ctx.patch is not None and not action.first:
                ctx.patch.status.update(action.status)
            else:
                version = meta.get("resourceVersion") if ctx.versioned else None
                await kube.patch_status(PROXYMODELS, namespace, name, action.status, version)
        elif isinstance(action, CreateChild):
            if not await _create(action, ctx, status):
                return  # refused: what follows needs it (the workload, its Service)
        elif isinstance(action, DeleteChildren):
            deleted = await _delete_children(namespace, name, action.keep_generation)
            ctx.logger.info("deleted %s", ", ".join(sorted(deleted)) or "no child")
            if deleted and action.announce:
                kopf.event(ctx.body, type="Normal", reason="ChildrenReplaced",
                           message=f"deleted {', '.join(sorted(deleted))} of an older spec")
        elif isinstance(action, Emit):
            kopf.event(ctx.body, type=action.type, reason=action.reason, message=action.message)
        elif isinstance(action, StartPipeline):
            await kopf.execute(fns={"validate": validate, "transform": transform},
                               lifecycle=kopf.lifecycles.one_by_one)
        elif isinstance(action, AskJudgment):
            asked = f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='milliseconds')} {action.why}"
            await kube.patch(PROXYMODELS, namespace, name, {"metadata": {"annotations": {RECHECK_ANNOTATION: asked}}})
            ctx.logger.info("judging again: %s", action.why)
        elif isinstance(action, JudgeChild):
            labels = {LABEL_PROXYMODEL: name, LABEL_ROLE: action.role, LABEL_CHILD: action.name}
            await judge_child(action.resource, namespace, labels, None, ctx.logger, ctx.memo)
        elif isinstance(action, Log):
            ctx.logger.info(action.message)
        else:
            raise TypeError(f"unknown action {action!r}")


async def _create(action: CreateChild, ctx: _Context, status: dict) -> bool:
    """Create a child recorded in status (True: it is there). A refusal the decision foresaw fails
    the ProxyModel, or for one that may pass, makes the step wait for the back-off (`recreate`)."""
    manifest, meta = action.manifest, ctx.body["metadata"]
    kopf.adopt(manifest, owner=ctx.body)
    what = f"{manifest['kind']} {manifest['metadata']['name']}"
    try:
        _, created = await kube.create(action.resource, meta["namespace"], manifest)
    except kube.ApiError as exc:
        if action.refused is None:
            raise
        # Status changed since the ProxyModel was read (the child was just recorded): unversioned.
        # A 404: the runtime's CRD is not installed (no retry helps: the condition says what to install).
        missing = exc.status == 404
        refused = pipeline.create_refused(status, replace(action.refused, retry=False) if missing else action.refused,
                                          what, runtimes.missing(action.resource) if missing else str(exc),
                                          ctx.body.get("spec") or {}, RUNTIME_MISSING if missing else "CreateFailed")
        ctx.logger.warning("the API server refused %s: %s%s", what, exc,
                           "; tried again later" if action.refused.retry else "")
        await _act(refused, _Context(ctx.body, ctx.memo, ctx.logger))
        return False
    ctx.logger.info("%s %s", what, "created" if created else "already exists")
    if created and action.created is not None:
        kopf.event(ctx.body, type=action.created.type, reason=action.created.reason, message=action.created.message)
    return True


async def _delete_children(namespace: str, proxymodel: str, keep_generation: int | None) -> list[str]:
    """Delete the children of other generations (all of them when keep_generation is None)."""
    deleted = []
    for resource in CHILDREN:
        try:
            children = await kube.list_(resource, namespace, {LABEL_PROXYMODEL: proxymodel})
        except kube.ApiError as exc:
            # 404: that runtime's CRD is not installed; 403: a runtime the chart left off (runtimes.*),
            # whose workloads this operator never creates.
            if exc.status == 404 or (exc.status == 403 and resource not in (JOBS, SERVICES)):
                continue
            raise
        for child in children:
            meta = child["metadata"]
            if keep_generation is None or meta.get("labels", {}).get(LABEL_GENERATION) != str(keep_generation):
                if await kube.delete(resource, namespace, meta["name"]):
                    deleted.append(meta["name"])
    return deleted


# --- the pipeline: create and resume, validation, spec changes ---------------------------------------


# id: kopf keeps the progress of this handler and of its steps (pipeline/validate, ...) in
# annotations under it.
@kopf.on.resume(*PXM, id="pipeline")
@kopf.on.create(*PXM, id="pipeline")
async def admit(spec: kopf.Spec, status: kopf.Status, body: kopf.Body, namespace: str, patch: kopf.Patch,
                reason: str, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    """Run the pipeline for this spec, or after a restart make sure the child status records
    as in progress exists."""
    recorded = pipeline.recorded_child(dict(spec), dict(status))
    exists = await kube.exists(recorded[0], namespace, recorded[1]) if recorded else None
    # A refusal recorded before this operator started: judged again only if what it depended on
    # changed. (While its own creation is handled, the refusal just made carries on to the end.)
    depended = await _dependencies(dict(body), memo.settings) if reason == "resume" else None
    _reports_refusal(dict(body))
    actions = decide(dict(body), Observed(ADMITTED, child_exists=exists, dependencies=depended), memo.settings)
    if reason == "resume":
        actions = pipeline.ready_added(dict(body), actions)
    await _act(actions, _Context(dict(body), memo, logger, patch))


def _reports_refusal(body: dict) -> None:
    """kopf's report of this handling says the ProxyModel is refused, unless it is accepted now."""
    meta = body["metadata"]
    refused = pipeline.refusal_of(body.get("status") or {}, meta.get("generation") or 1)
    if refused is not None:
        REFUSALS.refusing[(meta["namespace"], meta["name"])] = str(refused.get("reason"))


async def _dependencies(body: dict, settings: Settings) -> dict | None:
    """What the refusal of this ProxyModel depended on, as now (None when it is not refused)."""
    meta = body["metadata"]
    if pipeline.refusal_of(body.get("status") or {}, meta.get("generation") or 1) is None:
        return None
    return await dependencies(meta["namespace"], meta["name"], dict(body.get("spec") or {}), settings)


def _refused(status: kopf.Status, meta: kopf.Meta, **_: Any) -> bool:
    return pipeline.refusal_of(dict(status), meta.get("generation") or 1) is not None


@kopf.daemon(*PXM, id="recheck", when=_refused, cancellation_timeout=10)
async def recheck(stopped: kopf.DaemonStopped, namespace: str, name: str, memo: kopf.Memo, logger: logging.Logger,
                  **_: Any) -> None:
    """The back-off of a refused ProxyModel: every recheck interval, look at what its refusal
    depended on; a change asks for a new judgment. kopf stops it once it is not refused."""
    while not stopped.is_set():
        await stopped.wait(memo.settings.recheck_interval)
        if stopped.is_set():
            return
        body = await _get_parent(namespace, name)
        if body is None:
            return
        observed = Observed(RECHECK, dependencies=await _dependencies(body, memo.settings))
        await _act(decide(body, observed, memo.settings), _Context(body, memo, logger))


def _waits_on_refusal(status: kopf.Status, **_: Any) -> bool:
    return pipeline.waits_on_refusal(dict(status))


@kopf.daemon(*PXM, id="recreate", when=_waits_on_refusal, cancellation_backoff=5, cancellation_timeout=10)
async def recreate(stopped: kopf.DaemonStopped, namespace: str, name: str, memo: kopf.Memo,
                   logger: logging.Logger, **_: Any) -> None:
    """The back-off of a child the API server refused that may pass (the headless Service of a
    multi-node reproduction: RBAC, a quota, an admission policy): every recheck interval, the
    recorded child is created again, with what it needs first. kopf stops it once the step no
    longer waits."""
    async def retry() -> None:
        body = await _get_parent(namespace, name)
        if body is None:
            return
        recorded = pipeline.recorded_child(dict(body.get("spec") or {}), dict(body.get("status") or {}))
        exists = await kube.exists(recorded[0], namespace, recorded[1]) if recorded else None
        await _act(decide(body, Observed(RETRY, child_exists=exists), memo.settings),
                   _Context(body, memo, logger, versioned=True))

    while not stopped.is_set():
        await stopped.wait(memo.settings.recheck_interval)
        if not stopped.is_set():
            # The status it writes once the Service is there stops this daemon (asked to, then
            # cancelled): shielded, as the workload is created after that write.
            await asyncio.shield(_one_at_a_time(memo, namespace, name, retry))


@kopf.on.update(*PXM, id="rejudge", field=("metadata", "annotations", RECHECK_ANNOTATION))
async def rejudge(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    """Judge a refused spec again: `recheck` saw a change (or a user asked: `kubectl annotate
    proxymodel NAME operator.moeproxy.io/recheck=now --overwrite`)."""
    _reports_refusal(dict(body))
    await _act(decide(dict(body), Observed(REJUDGE), memo.settings), _Context(dict(body), memo, logger, patch))


def _refuse(body: kopf.Body, patch: kopf.Patch, status: dict, generation: int, reason: str, message: str,
            depended: dict, logger: logging.Logger, temporary: bool = False) -> None:
    """Refuse the spec (`pipeline.refused`), with one Warning Event per new reason."""
    meta = body["metadata"]
    refusal, news = pipeline.refused(status, dict(body.get("spec") or {}), generation, reason, message, depended,
                                     temporary)
    patch.status.update(refusal)
    if news:
        kopf.warn(body, reason=reason, message=message)
    REFUSALS.refusing[(meta["namespace"], meta["name"])] = reason
    logger.info("refused%s: %s: %s", " until that changes" if temporary else "", reason, message)


async def validate(spec: kopf.Spec, status: kopf.Status, meta: kopf.Meta, body: kopf.Body, namespace: str,
                   name: str, patch: kopf.Patch, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    """Step 1: the spec beyond the schema, then the source checkpoint's config.json and a plan."""
    config: Settings = memo.settings
    generation = meta.get("generation") or 1
    depended = {"settings": settings_fingerprint(config)}  # and, from the preflight, the Secret and source
    try:
        parsed = parse(dict(spec), namespace, name, config)
    except InvalidSpec as exc:
        return _refuse(body, patch, dict(status), generation, "InvalidSpec", str(exc), depended, logger)
    if parsed.reproduction.enabled and parsed.reproduction.accelerator.devices is None and not config.preflight:
        return _refuse(body, patch, dict(status), generation, "InvalidSpec",
                       "spec.reproduction.accelerator.devices is auto, which needs the preflight read of config.json "
                       "(disabled in this operator): set a device count", depended, logger)

    plan, prices = None, None
    if config.preflight:
        try:
            planned = await preflight(namespace, parsed, config, depended)
            plan, prices = planned.plan, planned.prices
        except PreflightError as exc:
            return _refuse(body, patch, dict(status), generation, exc.reason, exc.message, depended, logger,
                           temporary=exc.retry)

    REFUSALS.refusing.pop((namespace, name), None)
    accepted, message = pipeline.accepted(dict(status), dict(spec), generation, parsed, plan, prices)
    patch.status.update(accepted)
    logger.info(message)


async def transform(body: kopf.Body, spec: kopf.Spec, status: kopf.Status, namespace: str, name: str,
                    patch: kopf.Patch, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    """Step 2: replace older generations' children by this generation's first transformer Job."""
    current = dict(body)
    if (status.get("pipeline") or {}).get("specHash") != spec_hash(dict(spec)) \
            and pipeline.refusal_of(dict(status), (body.get("metadata") or {}).get("generation") or 1) is None:
        # kopf waits only so long (settings.persistence.consistency_timeout) for the version its
        # patch of the validate step made; on a loaded API server it may hand over an older one.
        current = await kube.get(PROXYMODELS, namespace, name)
    await _act(decide(current, Observed(VALIDATED), memo.settings), _Context(current, memo, logger, patch))


@kopf.on.update(*PXM, field="spec")
async def spec_changed(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: logging.Logger,
                       **_: Any) -> None:
    """A new spec restarts the pipeline (old children deleted); suspend and TTL alone do not."""
    await _act(decide(dict(body), Observed(SPEC_CHANGED), memo.settings), _Context(dict(body), memo, logger, patch))


# --- following the children ----------------------------------------------------------------------


CHILD_LABELS = {LABEL_PROXYMODEL: kopf.PRESENT, LABEL_ROLE: kopf.PRESENT}


async def child_changed(event: dict, body: kopf.Body, resource: kopf.Resource, namespace: str,
                        memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    """A child workload changed: maybe it finished."""
    runtime = runtime_of(resource)
    if runtime is None:
        raise ValueError(f"not a child resource: {resource}")
    child = runtime.resource
    if event.get("type") == "DELETED" or workload_state(child, dict(body)) == Outcome(RUNNING):
        return  # nothing to report yet (its pods' own events report pull errors and the like)
    labels = body.get("metadata", {}).get("labels", {})
    await judge_child(child, namespace, labels, dict(body), logger, memo)


def register_workloads(served: tuple[str, ...] = (), registry: kopf.OperatorRegistry | None = None) -> None:
    """Follow the workloads of the runtimes this operator serves (settings.runtimes; empty: all of
    them), the transformer's batch/v1 Jobs always: kopf lists and watches only what the chart's
    RBAC grants (a runtime's rules come with its runtimes.<name>.enabled)."""
    names = set(served or runtimes.RUNTIMES) | {"Job"}
    for workload in dict.fromkeys(r.resource for r in runtimes.RUNTIMES.values() if r.name in names):
        kopf.on.event(workload.group, workload.version, workload.plural, labels=CHILD_LABELS,
                      registry=registry)(child_changed)


@kopf.on.event(PODS.group, PODS.version, PODS.plural, labels={LABEL_CHILD: kopf.PRESENT, LABEL_ROLE: kopf.PRESENT})
async def pod_changed(event: dict, body: kopf.Body, namespace: str, memo: kopf.Memo, logger: logging.Logger,
                      **_: Any) -> None:
    """A child's pod changed: a pull that never succeeds or an unschedulable pod shows only here.
    A deleted pod is judged as it ended (a RayJob's cluster, shut down after the job, takes the
    verdict with its pods: the event's body is their last state)."""
    labels = body.get("metadata", {}).get("labels", {})
    await judge_child(None, namespace, labels, None, logger, memo, pod=dict(body))


async def judge_child(resource: Resource | None, namespace: str, labels: dict, workload: dict | None,
                      logger: logging.Logger, memo: kopf.Memo, pod: dict | None = None) -> None:
    """Read the child's verdict and carry it into its ProxyModel's status. Status is written
    only if nobody changed the ProxyModel meanwhile; otherwise it is read and judged again.
    `pod`: one of its pods as an event has it (counted even if gone from the listing)."""
    proxymodel, role, child = labels.get(LABEL_PROXYMODEL), labels.get(LABEL_ROLE), labels.get(LABEL_CHILD)
    if not (proxymodel and role in (TRANSFORMER, REPRODUCTION) and child):
        return

    async def judge() -> None:
        parent = await _get_parent(namespace, proxymodel)
        if parent is None:
            return
        status = parent.get("status") or {}
        if not pipeline.wants_verdict(status, role, child):
            return  # read nothing more
        kind = resource or pipeline.child_resource(status, role)  # a pod's event: its workload's
        try:
            current = workload if workload is not None else await kube.get(kind, namespace, child)
        except kube.ApiError as exc:
            if exc.status == 404 and pod is not None:
                return  # a pod going with its workload: nothing to judge
            raise
        pods = await kube.list_(PODS, namespace, {LABEL_CHILD: child})
        if pod is not None and all(p["metadata"]["name"] != pod["metadata"]["name"] for p in pods):
            pods.append(pod)
        seen = Child(child, role, outcome(kind, current, pods),
                     failed_indexes=(current.get("status") or {}).get("failedIndexes"))
        await _act(decide(parent, Observed(CHILD_CHANGED, child=seen), memo.settings),
                   _Context(parent, memo, logger, versioned=True))

    await _one_at_a_time(memo, namespace, proxymodel, judge)


def _is_indexed(body: kopf.Body, **_: Any) -> bool:
    return (body.get("spec") or {}).get("completionMode") == "Indexed"


@kopf.on.event(JOBS.group, JOBS.version, JOBS.plural, labels={LABEL_PROXYMODEL: kopf.PRESENT, LABEL_ROLE: TRANSFORMER},
               when=_is_indexed)
async def workers_progress(event: dict, body: kopf.Body, namespace: str, memo: kopf.Memo, logger: logging.Logger,
                           **_: Any) -> None:
    """The workers' Indexed Job finished another index: `status.workers` shows done/all. (Its
    verdict, and the finalize Job after it, are child_changed's.)"""
    if event.get("type") == "DELETED":
        return
    meta, job_status = body.get("metadata") or {}, body.get("status") or {}
    proxymodel = meta["labels"][LABEL_PROXYMODEL]
    progress = f"{count_indexes(job_status.get('completedIndexes'))}/{(body.get('spec') or {}).get('completions')}"
    seen = Child(meta["name"], TRANSFORMER, progress=progress)

    async def record() -> None:
        parent = await _get_parent(namespace, proxymodel)
        if parent is not None:
            await _act(decide(parent, Observed(WORKERS_PROGRESS, child=seen), memo.settings),
                       _Context(parent, memo, logger, versioned=True))

    await _one_at_a_time(memo, namespace, proxymodel, record)


async def _one_at_a_time(memo: kopf.Memo, namespace: str, proxymodel: str,
                         decide_and_act: Callable[[], Awaitable[None]]) -> None:
    """Run `decide_and_act` (it reads the ProxyModel and writes status at the version it read)
    alone for this ProxyModel; when somebody else wrote meanwhile (409), it reads and decides again."""
    lock = memo.verdict_locks.setdefault((namespace, proxymodel), asyncio.Lock())  # held here while in use
    async with lock:
        for attempt in range(3):
            try:
                return await decide_and_act()
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


# --- deletion ----------------------------------------------------------------------------------


def _wants_cleanup(spec: kopf.Spec, **_: Any) -> bool:
    return bool((spec.get("cleanup") or {}).get("deleteProxy"))


@kopf.on.delete(*PXM, when=_wants_cleanup, retries=3, backoff=10, timeout=300)
async def delete_proxy(spec: kopf.Spec, namespace: str, name: str, retry: int, memo: kopf.Memo,
                       logger: logging.Logger, **_: Any) -> None:
    """Only when spec.cleanup.deleteProxy asks: remove the proxy from object storage. Best
    effort: after the last retry the finalizer goes anyway, so deletion never hangs."""
    from .cleanup import delete_prefix

    parsed = parse(dict(spec), namespace, name, memo.settings)
    try:
        count = await delete_prefix(namespace, parsed)
        logger.info("deleted %d objects under %s", count, parsed.destination)
    except Exception as exc:  # noqa: BLE001 - reported, then released
        if retry < 2:
            raise kopf.TemporaryError(f"deleting {parsed.destination}: {exc}", delay=10) from None
        logger.warning("giving up deleting %s (%s); the ProxyModel is released anyway", parsed.destination, exc)
