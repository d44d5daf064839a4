"""Diagnosis: which candidate fix cures a ProxyModel's reproduced failure, on the cluster
(`moe-proxy diagnose`'s matrix, each run a reproduction workload of the planned size).

One kopf timer per Diagnosis. Every `tick` seconds (settings' diagnosis_tick) it
1. reads the Diagnosis's ProxyModel (the baseline: its proxy, plan, runtime and reproduction);
2. lists the runs' workloads and pods (label `moeproxy.io/diagnosis`) and reads the outcome of
   each run status records as running, as the ProxyModel's reproduction verdict is read
   (`outcome.outcome`: the termination message, or the most specific failure reason);
3. decides (diagnosis_decisions.decide) and acts: writes status first (every run it is about to
   create is recorded there as Running under its deterministic name), then creates the
   workloads (owned by the Diagnosis; one that exists counts as created), then posts Events.
A finished Diagnosis (Complete or Failed for its generation) reads nothing more.

Registered (`register`) by the operator's main at start-up, as checkpoint_watch is (kopf takes
the timer's interval when it is registered). Importing this module registers nothing.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from . import handlers, kube  # noqa: F401 - handlers' startup handler puts the settings in memo
from .diagnosis_decisions import (DIAGNOSED, DIAGNOSIS_FAILED, LABEL_DIAGNOSIS, decide, recorded_running,
                                  refused_create)
from .outcome import outcome
from .resources import DIAGNOSES, GROUP, LABEL_CHILD, PODS, PROXYMODELS, VERSION
from .runtimes import RUNTIMES


def register(tick: float, registry: kopf.OperatorRegistry | None = None) -> None:
    """Serve Diagnoses: a timer on each that wakes every `tick` seconds."""
    kopf.timer(GROUP, VERSION, DIAGNOSES.plural, interval=tick, id="diagnose", registry=registry)(reconcile)


async def _proxymodel(namespace: str, name: str) -> dict | None:
    try:
        return await kube.get(PROXYMODELS, namespace, name)
    except kube.ApiError as exc:
        if exc.status == 404:
            return None
        raise


async def observe(namespace: str, diagnosis: str, status: dict) -> dict:
    """The outcomes of the recorded running runs whose workloads exist, by workload name."""
    wanted = set(recorded_running(status))
    if not wanted:
        return {}
    runtime = RUNTIMES[(status.get("proxyModel") or {}).get("runtime") or "Job"]
    selector = {LABEL_DIAGNOSIS: diagnosis}
    workloads = [w for w in await kube.list_(runtime.resource, namespace, selector)
                 if w["metadata"]["name"] in wanted and not w["metadata"].get("deletionTimestamp")]
    pods = await kube.list_(PODS, namespace, selector) if workloads else []
    return {w["metadata"]["name"]: outcome(runtime.resource, w, [
        p for p in pods if (p["metadata"].get("labels") or {}).get(LABEL_CHILD) == w["metadata"]["name"]])
        for w in workloads}


async def reconcile(body: kopf.Body, meta: kopf.Meta, status: kopf.Status, spec: kopf.Spec, namespace: str,
                    name: str, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    generation = meta.get("generation") or 1
    current = dict(status)
    if current.get("phase") in (DIAGNOSED, DIAGNOSIS_FAILED) and current.get("observedGeneration") == generation:
        return  # finished: read nothing
    proxy_model = spec.get("proxyModel")
    proxymodel = await _proxymodel(namespace, proxy_model) if isinstance(proxy_model, str) and proxy_model else None
    seen = await observe(namespace, name, current)
    decision = decide(dict(body), proxymodel, seen, memo.settings)
    if any(current.get(k) != v for k, v in decision.status.items()):  # a tick that saw nothing new writes nothing
        await kube.patch_status(DIAGNOSES, namespace, name, decision.status)
    written, refused = {**current, **decision.status}, set()
    for resource, manifest in decision.create:
        if manifest["metadata"]["name"] in refused:
            continue  # its Service was refused: the run is an error already
        kopf.adopt(manifest, owner=dict(body))
        what = f"{manifest['kind']} {manifest['metadata']['name']}"
        try:
            _, created = await kube.create(resource, namespace, manifest)
        except kube.ApiError as exc:
            if exc.status not in (400, 403, 422):
                raise  # kopf retries the timer; the run is recorded, so it is created then
            message = f"the API server refused {what}: {exc.message or exc}"
            logger.warning(message)
            kopf.warn(dict(body), reason="RunRefused", message=message[:1024])
            refused.add(manifest["metadata"]["name"])
            errored = refused_create(written, manifest["metadata"]["name"], message)
            written.update(errored)
            await kube.patch_status(DIAGNOSES, namespace, name, errored)
            continue
        logger.info("%s %s", what, "created" if created else "already exists")
    for kind, reason, message in decision.events:
        kopf.event(dict(body), type=kind, reason=reason, message=message[:1024])
        logger.info("%s: %s", reason, message)
