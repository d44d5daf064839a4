"""Diagnosis: which candidate fix cures a ProxyModel's reproduced failure, on the cluster
(`moe-proxy diagnose`'s matrix, each run a reproduction workload of the planned size).

One kopf timer per Diagnosis. Every `tick` seconds (settings' diagnosis_tick) it
1. reads the Diagnosis's ProxyModel (the baseline: its proxy, plan, runtime and reproduction);
2. lists the runs' workloads and pods (label `moeproxy.io/diagnosis`) and reads the outcome of
   each run status records as running, as the ProxyModel's reproduction verdict is read
   (`outcome.outcome`: the termination message, or the most specific failure reason);
3. decides (diagnosis_matrix.decide) and acts: writes status first (every run it is about to
   create is recorded there as Running under its deterministic name), then creates the
   workloads (owned by the Diagnosis; one that exists counts as created), then posts Events.
A finished Diagnosis (Complete or Failed for its generation) reads nothing more.

A bisection (spec.checkpoints, diagnosis_bisect) lists the run's checkpoints once (its
CheckpointWatch's prefix, or its own; `moe_proxy.investigate.bisect.sources`, the CLI's listing),
then reads only its probes in flight (a round's, spec.parallelism at most): their ProxyModels and runs;
before each round, the namespace's ProxyModels, to reuse a CheckpointWatch's of the same content key.

Registered (`register`) by the operator's main at start-up, as checkpoint_watch is (kopf takes
the timer's interval when it is registered). Importing this module registers nothing.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf

from moe_proxy.errors import InvalidRange, MoeProxyError, StorageError, TooFewCheckpoints
from moe_proxy.investigate.bisect import sources

from . import diagnosis_bisect as bisection, handlers, kube  # noqa: F401 - handlers' startup handler: settings
from .checkpoint_watch import CHECKPOINT_WATCHES, REASONS
from .diagnosis_spec import InvalidDiagnosis, candidates_spec
from .diagnosis_matrix import decide
from .diagnosis_rows import recorded_running, refused_create
from .diagnosis_runs import LABEL_DIAGNOSIS, NotYet
from .diagnosis_status import DIAGNOSED, DIAGNOSIS_FAILED, DiagnosisDecision
from .preflight import PreflightError, read_credentials, redact
from .outcome import RUNNING, outcome
from .resources import DIAGNOSES, GROUP, LABEL_CHILD, PODS, PROXYMODELS, VERSION
from . import runtimes
from .runtimes import RUNTIMES


def register(tick: float, registry: kopf.OperatorRegistry | None = None) -> None:
    """Serve Diagnoses: a timer on each that wakes every `tick` seconds."""
    kopf.timer(GROUP, VERSION, DIAGNOSES.plural, interval=tick, id="diagnose", registry=registry)(reconcile)


async def _proxymodel(namespace: str, name: str) -> dict | None:
    return await kube.get_or_none(PROXYMODELS, namespace, name)


async def list_checkpoints(namespace: str, b: bisection.BisectSpec, settings) -> tuple[dict, list[dict]]:
    """(the watch-like spec the probes are made from, the checkpoints [{step, uri, fingerprint}] to bisect),
    as `moe-proxy bisect` lists them; NotYet (temporary: a missing watch or Secret, an
    unreachable store) or InvalidDiagnosis (fewer than 2 checkpoints, good/bad at no checkpoint)."""
    raw = b.inline
    if b.watch is not None:
        watch_body = await kube.get_or_none(CHECKPOINT_WATCHES, namespace, b.watch)
        if watch_body is None:
            raise NotYet("CheckpointWatchNotFound", f"CheckpointWatch {b.watch} does not exist in {namespace}")
        raw = {k: v for k, v in (watch_body.get("spec") or {}).items()
               if k in ("source", "template", "pattern", "stepRegex")}
    watch = bisection.watch_spec(raw, f"CheckpointWatch {b.watch}" if b.watch else "spec.checkpoints", settings)
    credentials: dict[str, str] = {}
    try:
        credentials = await read_credentials(namespace, watch.source.credentials_secret)
        found = await asyncio.to_thread(sources, watch.source.uri, watch.pattern, watch.step_regex, b.good, b.bad, {
            "endpoint_url": watch.source.endpoint or None, "region": watch.source.region or "us-east-1",
            "credentials": credentials, "max_attempts": 2, "connect_timeout": 3, "read_timeout": 20})
    except PreflightError as exc:
        raise NotYet(exc.reason, str(exc)) from None
    except StorageError as exc:
        raise NotYet(REASONS.get(type(exc), "S3Error"), redact(str(exc), credentials)) from None
    except (TooFewCheckpoints, InvalidRange) as exc:  # the CLI's own refusals, the reason named after each
        raise InvalidDiagnosis(type(exc).__name__, str(exc)) from None
    except MoeProxyError as exc:  # another refusal of the listing (e.g. a step regex without a group)
        raise InvalidDiagnosis("InvalidSpec", str(exc)) from None
    return raw, [{"step": c.step, "uri": c.uri, "fingerprint": c.fingerprint} for c in found]


async def bisect(body: dict, status: dict, namespace: str, name: str, settings) -> DiagnosisDecision:
    """The bisection's decision this tick (its I/O: the listing once, then the probe in flight)."""
    generation = body["metadata"].get("generation") or 1
    if not (status.get("bisection") or {}).get("checkpoints"):
        try:
            b = bisection.parse_bisection(dict(body.get("spec") or {}))
            raw, checkpoints = await list_checkpoints(namespace, b, settings)
        except (NotYet, InvalidDiagnosis) as exc:
            return bisection.listing_refused(status, generation, exc)
        return bisection.start(status, b, raw, checkpoints, generation)
    if status.get("observedGeneration") != generation:  # the bisection is fixed once listed (said once)
        return DiagnosisDecision({"observedGeneration": generation}, [], [("Warning", "SpecChangeIgnored", (
            f"spec changed (generation {generation}) after the checkpoints were listed: this Diagnosis goes on with "
            "the bisection in status; create another Diagnosis for the new spec"))])
    flying = bisection.flying(status)
    children = {p["proxyModel"]: await _proxymodel(namespace, p["proxyModel"]) for p in flying}
    seen = await observe(namespace, name, status)
    # a round may come now (every run in flight has ended): the CheckpointWatches' ProxyModels,
    # each probe's proxy perhaps among them
    found = bisection.reusable(await kube.list_(PROXYMODELS, namespace, {})) if all(
        (o := seen.get(p.get("workload"))) is not None and o.state != RUNNING for p in flying) else {}
    return bisection.progress(body, None, seen, settings, children=children, found=found)


async def observe(namespace: str, diagnosis: str, status: dict) -> dict:
    """The outcomes of the recorded running runs whose workloads exist, by workload name."""
    wanted = set(recorded_running(status))
    if not wanted:
        return {}
    runtime = RUNTIMES[(status.get("proxyModel") or {}).get("runtime") or "Job"]
    selector = {LABEL_DIAGNOSIS: diagnosis}
    try:
        listed = await kube.list_(runtime.resource, namespace, selector)
    except kube.ApiError as exc:
        if exc.status == 404:  # the runtime's CRD is not installed: its runs were refused (RuntimeNotInstalled)
            return {}
        raise
    workloads = [w for w in listed if w["metadata"]["name"] in wanted and not w["metadata"].get("deletionTimestamp")]
    pods = await kube.list_(PODS, namespace, selector) if workloads else []
    return {w["metadata"]["name"]: outcome(runtime.resource, w, [
        p for p in pods if (p["metadata"].get("labels") or {}).get(LABEL_CHILD) == w["metadata"]["name"]])
        for w in workloads}


async def reconcile(body: kopf.Body, meta: kopf.Meta, status: kopf.Status, spec: kopf.Spec, namespace: str,
                    name: str, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    generation = meta.get("generation") or 1
    # Only this timer writes a Diagnosis's status, and kopf's body can lag its last write by a watch
    # event (seconds, under load): a tick decides from both, or a stale body decides (and says) again.
    ours = memo.setdefault("status_written", {})
    current = {**dict(status), **ours}
    as_written = {**dict(body), "status": current}
    if current.get("phase") in (DIAGNOSED, DIAGNOSIS_FAILED) and current.get("observedGeneration") == generation:
        return  # finished: read nothing
    if bisection.is_bisection(dict(spec)) and not current.get("candidatesOn"):
        decision = await bisect(as_written, current, namespace, name, memo.settings)
    else:
        if current.get("candidatesOn"):  # a bisection's candidates: a matrix on its first bad probe's ProxyModel
            as_written = {**as_written, "spec": candidates_spec(dict(spec), current["candidatesOn"]["proxyModel"])}
        proxy_model = as_written["spec"].get("proxyModel")
        proxymodel = await _proxymodel(namespace, proxy_model) if isinstance(proxy_model, str) and proxy_model \
            else None
        decision = decide(as_written, proxymodel, await observe(namespace, name, current), memo.settings)
    if any(current.get(k) != v for k, v in decision.status.items()):  # a tick that saw nothing new writes nothing
        await kube.patch_status(DIAGNOSES, namespace, name, decision.status)
        ours.update(decision.status)
    written, refused = {**current, **decision.status}, set()
    for resource, manifest in decision.create:
        if manifest["metadata"]["name"] in refused:
            continue  # its Service was refused: the run is an error already
        kopf.adopt(manifest, owner=dict(body))
        what = f"{manifest['kind']} {manifest['metadata']['name']}"
        try:
            _, created = await kube.create(resource, namespace, manifest)
        except kube.ApiError as exc:
            if exc.status not in (400, 403, 404, 422):
                raise  # kopf retries the timer; the run is recorded, so it is created then
            message = f"the API server refused {what}: " + (
                runtimes.missing(resource) if exc.status == 404 else (exc.message or str(exc)))
            logger.warning(message)
            kopf.warn(dict(body), reason="RunRefused", message=message[:1024])
            refused.add(manifest["metadata"]["name"])
            errored = refused_create(written, manifest["metadata"]["name"], message)
            written.update(errored)
            await kube.patch_status(DIAGNOSES, namespace, name, errored)
            ours.update(errored)
            continue
        logger.info("%s %s", what, "created" if created else "already exists")
    for resource, workload in decision.delete:  # runs stopped early: status says so already
        if await kube.delete(resource, namespace, workload):
            logger.info("%s %s deleted", resource.kind, workload)
    for kind, reason, message in decision.events:
        kopf.event(dict(body), type=kind, reason=reason, message=message[:1024])
        logger.info("%s: %s", reason, message)
