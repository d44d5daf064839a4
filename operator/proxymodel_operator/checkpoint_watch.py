"""CheckpointWatch: a ProxyModel for every new complete checkpoint of a training run.

One kopf timer per CheckpointWatch. Every `spec.pollInterval` seconds it
1. lists the ProxyModels the watch made (label `moeproxy.io/checkpoint-watch`): what exists
   is the truth, so a restarted operator never makes one twice;
2. lists the run's prefix with `moe_proxy.checkpoint.listing` (the function behind
   `moe-proxy checkpoints`; config, index and shard headers only), with the credentials of
   the Secret the watch names, read with `get` and kept in memory;
3. decides (watch_decisions.decide) and acts: creates ProxyModels `<watch>-step-<N>` owned by the
   watch, deletes the oldest beyond keepLast, and writes what it saw to status.
With spec.metrics and spec.onFailure, each poll also follows the run's metrics and its incident
(watched_run.follow_run: one Diagnosis per incident, the answer in status, Events, a report next
to the run and a webhook). An incomplete checkpoint is looked at again on the next poll; one that is no source (dense,
unsupported, unreadable) gets one warning Event. Listing errors become the SourceReachable
condition (S3AccessDenied, EndpointUnreachable, ...) and the next poll tries again.

Registered (`register`) only when the operator runs with MOEPROXY_CHECKPOINT_WATCH=true (the
chart's checkpointWatch.enabled), which is also when the chart grants the RBAC it needs.
Importing this module registers nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import kopf

from moe_proxy.checkpoint.listing import ListedCheckpoint, find, inspect_all
from moe_proxy.errors import AccessDenied, EndpointUnreachable, ObjectNotFound, StorageError
from moe_proxy.storage.s3 import S3Store

from . import handlers, kube, watched_run  # noqa: F401 - handlers' startup handler puts the settings in memo
from .preflight import PreflightError, read_credentials, redact
from .resources import DIAGNOSES, GROUP, PROXYMODELS, VERSION, Resource
from .settings import Settings
from .status import ACCEPTED, SUSPENDED_CONDITION, condition, now, with_condition
from .watch_decisions import (LABEL_STEP, LABEL_WATCH, MadeProxyModel, children_status, considered, decide,
                              in_use_by, newly_skipped, proxymodel_for, status_after, watch_label)
from .watch_spec import InvalidWatch, WatchSpec, parse_watch

CHECKPOINT_WATCHES = Resource(GROUP, VERSION, "checkpointwatches", "CheckpointWatch")
SOURCE_REACHABLE = "SourceReachable"  # condition: the checkpoint prefix can be listed
REASONS = {AccessDenied: "S3AccessDenied", EndpointUnreachable: "EndpointUnreachable",
           ObjectNotFound: "S3NoSuchBucket"}


# --- reading: the ProxyModels that exist, the checkpoints under the prefix -------------------------


async def children_of(namespace: str, watch: str) -> list[MadeProxyModel]:
    """The ProxyModels this watch made, oldest step first (those being deleted left out)."""
    items = await kube.list_(PROXYMODELS, namespace, {LABEL_WATCH: watch_label(watch)})
    out = []
    for item in items:
        meta = item.get("metadata") or {}
        step = (meta.get("labels") or {}).get(LABEL_STEP, "")
        if meta.get("deletionTimestamp") or not step.isdigit():
            continue
        out.append(MadeProxyModel(meta["name"], int(step), (item.get("status") or {}).get("phase"),
                         ((item.get("spec") or {}).get("source") or {}).get("uri", "")))
    return sorted(out, key=lambda c: c.step)


def list_checkpoints(watch: WatchSpec, credentials: dict[str, str], made: set[int],
                     retired_through: int | None, seen: dict) -> list[ListedCheckpoint]:
    """The prefix's checkpoints still to decide (blocking: runs in a thread). Directories of
    steps already made, retired or before startAfterStep are found but not read, nor is a
    directory whose files (names, sizes, ETags) are as the last poll saw them: `seen` keeps
    those answers between polls, so a pending or incomplete checkpoint costs one listing."""
    store = S3Store(watch.source.uri, endpoint_url=watch.source.endpoint or None,
                    region=watch.source.region or "us-east-1", credentials=credentials,
                    max_attempts=2, connect_timeout=3, read_timeout=20)
    candidates = [c for c in find(store, watch.pattern, watch.step_regex)
                  if considered(watch, c.step, made, retired_through)]
    keys = {c.path: (c.path, c.step, c.fingerprint) for c in candidates}  # a rewrite (new ETags) is read again
    new = [c for c in candidates if keys[c.path] not in seen]
    # Deep: a checkpoint about to become a ProxyModel is worth its whole index and headers
    # (read once: answers are kept while its files are unchanged).
    answers = dict(zip((keys[c.path] for c in new), inspect_all(store, new, deep=True)))
    answers.update({k: seen[k] for k in keys.values() if k in seen})
    seen.clear()
    seen.update(answers)
    return [answers[keys[c.path]] for c in candidates]


# --- the timer -----------------------------------------------------------------------------------


def _due(memo: kopf.Memo, watch: WatchSpec, generation: int, status: dict) -> bool:
    """A poll is due when pollInterval has passed since the last one (in this process), or
    the spec changed since status was written."""
    last = memo.get("last_poll")
    if last is None or status.get("observedGeneration") != generation:
        return True
    return time.monotonic() - last >= watch.poll_interval


def register(tick: float, registry: kopf.OperatorRegistry | None = None) -> None:
    """Serve CheckpointWatches: a timer on each that wakes every `tick` seconds (settings'
    checkpoint_tick: the CRD's smallest pollInterval, so polls fall on 30 s ticks and kopf logs
    one line per tick) to see whether its pollInterval has passed. kopf takes the interval when
    the timer is registered, so it is registered here, from the settings, not at import."""
    kopf.timer(GROUP, VERSION, CHECKPOINT_WATCHES.plural, interval=tick, id="poll", registry=registry)(poll)


async def poll(spec: kopf.Spec, status: kopf.Status, meta: kopf.Meta, body: kopf.Body, namespace: str,
               name: str, patch: kopf.Patch, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    generation = meta.get("generation") or 1
    try:
        watch = parse_watch(dict(spec), memo.settings)
    except InvalidWatch as exc:
        if status.get("observedGeneration") != generation:  # say so once per spec
            if _condition(patch, status, ACCEPTED, False, "InvalidSpec", str(exc), generation):
                kopf.warn(body, reason="InvalidSpec", message=str(exc))
            patch.status["observedGeneration"] = generation
        return
    if not _due(memo, watch, generation, dict(status)):
        return
    memo["last_poll"] = time.monotonic()
    patch.status.update(observedGeneration=generation, lastPollTime=now())

    children = await children_of(namespace, name)
    if watch.suspend:
        _condition(patch, status, SUSPENDED_CONDITION, True, "SuspendedBySpec",
                   "spec.suspend is true: the prefix is not listed and no ProxyModel is made", generation)
        patch.status.update(children_status(children))
        return
    _condition(patch, status, SUSPENDED_CONDITION, False, "Polling", f"listing every {watch.poll_interval}s",
               generation)
    if watch.metrics and watch.on_failure:  # the watched run: its metrics and incident (watched_run)
        await watched_run.follow_run(body, watch, dict(status), patch, memo, lambda kind, ok, reason, message: (
            _condition(patch, status, kind, ok, reason, message, generation)), logger)

    retired = status.get("retiredThrough")
    credentials: dict[str, str] = {}
    try:
        credentials = await read_credentials(namespace, watch.source.credentials_secret)
        found = await asyncio.to_thread(list_checkpoints, watch, credentials, {c.step for c in children}, retired,
                                        memo.setdefault("inspected", {}))
    except (PreflightError, StorageError) as exc:
        reason = exc.reason if isinstance(exc, PreflightError) else REASONS.get(type(exc), "S3Error")
        message = redact(str(exc), credentials)
        if _condition(patch, status, SOURCE_REACHABLE, False, reason, message, generation):
            kopf.warn(body, reason=reason, message=message)
        logger.warning("listing %s failed: %s: %s", watch.source.uri, reason, message)
        patch.status.update(children_status(children))
        return
    failing = next((c for c in status.get("conditions") or [] if c.get("type") == SOURCE_REACHABLE
                    and c.get("status") == "False"), None)
    _condition(patch, status, SOURCE_REACHABLE, True, "Listed",
               f"{watch.source.uri}: {len(found)} new checkpoint(s) looked at", generation)
    if failing:
        kopf.event(body, type="Normal", reason="SourceReachable", message=f"listing {watch.source.uri} works again")

    # retention keeps the ProxyModels an unfinished Diagnosis uses (a probe reuses the watch's, proxy_key)
    decision = decide(watch, children, found, retired, await _in_use(namespace) if watch.keep_last else frozenset())
    await act(body, watch, decision, children, status, patch, memo.setdefault("warned", set()), logger,
              memo.settings)


async def _in_use(namespace: str) -> frozenset[str]:
    """The ProxyModels the namespace's unfinished Diagnoses name (watch_decisions.in_use_by)."""
    try:
        return in_use_by(await kube.list_(DIAGNOSES, namespace, {}))
    except kube.ApiError as exc:
        if exc.status == 404:  # no Diagnosis resource served: nothing uses the watch's ProxyModels
            return frozenset()
        raise


async def act(body: kopf.Body, watch: WatchSpec, decision, children: list[MadeProxyModel], status: dict,
              patch: kopf.Patch, warned: set[int], logger: logging.Logger,
              settings: Settings | None = None) -> None:
    """Carry out a decision and record it in status. `warned`: the steps whose skipping this
    process has reported already (status keeps only the newest few)."""
    namespace = body["metadata"]["namespace"]
    for child in decision.delete:
        if await kube.delete(PROXYMODELS, namespace, child.name):
            kopf.event(body, type="Normal", reason="ProxyModelRetired",
                       message=f"deleted {child.name} (step {child.step}): keepLast is {watch.keep_last}")
            logger.info("retired ProxyModel %s (step %d)", child.name, child.step)
    kept, rejected, not_made = [c for c in children if c not in decision.delete], None, []
    for i, checkpoint in enumerate(decision.create):
        manifest = proxymodel_for(dict(body), watch, checkpoint.step, checkpoint.uri, checkpoint.fingerprint,
                                  settings)
        pxm = manifest["metadata"]["name"]
        try:
            _, created = await kube.create(PROXYMODELS, namespace, manifest)
        except kube.ApiError as exc:
            if exc.status not in (400, 422):
                raise  # kopf retries the timer
            rejected = f"the API server refused ProxyModel {pxm} made from spec.template: {exc.message}"
            not_made = [c.step for c in decision.create[i:]]
            break
        if created:
            kopf.event(body, type="Normal", reason="ProxyModelCreated",
                       message=f"{pxm} from step {checkpoint.step} ({checkpoint.uri})")
            logger.info("created ProxyModel %s from step %d", pxm, checkpoint.step)
        kept.append(MadeProxyModel(pxm, checkpoint.step, None, checkpoint.uri))

    if rejected:
        if _condition(patch, status, ACCEPTED, False, "ProxyModelRejected", rejected, watch_generation(body)):
            kopf.warn(body, reason="ProxyModelRejected", message=rejected)
    else:
        _condition(patch, status, ACCEPTED, True, "SpecValid", "the template makes valid ProxyModels",
                   watch_generation(body))
    warned.update(s.get("step") for s in status.get("skipped") or [])
    for checkpoint in newly_skipped(decision, warned):
        warned.add(checkpoint.step)
        kopf.warn(body, reason="CheckpointSkipped",
                  message=f"step {checkpoint.step} ({checkpoint.uri}) is no source: {checkpoint.reason}")
    patch.status.update(status_after(status, decision, kept, not_made))


# --- status ----------------------------------------------------------------------------------------


def watch_generation(body: kopf.Body) -> int:
    return body.get("metadata", {}).get("generation") or 1


def _condition(patch: kopf.Patch, status: dict, kind: str, ok: bool, reason: str, message: str,
               generation: int) -> bool:
    """Set a condition; True when its status or reason differs from status's (worth an Event)."""
    current = patch.status["conditions"] if "conditions" in patch.status else status.get("conditions")
    before = next((c for c in status.get("conditions") or [] if c.get("type") == kind), None)
    patch.status["conditions"] = with_condition(current, condition(kind, ok, reason, message, generation))
    return before is None or (before.get("status"), before.get("reason")) != ("True" if ok else "False", reason)
