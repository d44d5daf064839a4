"""The watched run (issue 43): on each poll of a CheckpointWatch with spec.metrics and
spec.onFailure, follow the run's metrics, open an incident on a watched failure, make its one
Diagnosis, follow it, and put the answer where the team looks (status, Events, report.md/json
next to the run, a webhook). The decisions are incident.py's; this module does the I/O.

The run's watcher (run_metrics: a moe_proxy.metrics.incident.RunWatcher) stays in kopf's memo
between polls; a restarted operator reads the metrics again from the start (or from the last
incident's step), and finds the incident in status and its Diagnosis under its deterministic name:
never a second one. Metrics that cannot be read (MetricsMalformed) are read again from the start
at the next poll, by a fresh watcher: a file rewritten in place is read whole.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging

import aiohttp
import kopf

from moe_proxy.checkpoint.listing import list_checkpoints as list_prefix
from moe_proxy.errors import MalformedMetrics, StorageError
from moe_proxy.metrics.incident import RunWatcher
from moe_proxy.storage.s3 import S3Store

from . import incident as inc, kube
from .preflight import PreflightError, plan_for, read_credentials, read_source_config, redact
from .resources import DIAGNOSES, SECRETS
from .run_metrics import poll, watcher_for
from .settings import Settings
from .spec import InvalidSpec, parse as parse_proxymodel
from .watch_spec import WatchSpec

METRICS_READABLE, RUN_HEALTHY, WEBHOOK_DELIVERED = "MetricsReadable", "RunHealthy", "WebhookDelivered"
WEBHOOK_TIMEOUT = 5.0  # seconds: a webhook never holds a poll longer
WEBHOOK_ATTEMPTS = 20  # tries of one answer's webhook (one per poll), then given up (said in the condition)


def _store_options(watch: WatchSpec, credentials: dict[str, str]) -> dict:
    return {"endpoint_url": watch.source.endpoint or None, "region": watch.source.region or "us-east-1",
            "credentials": credentials, "max_attempts": 2, "connect_timeout": 3, "read_timeout": 20}


def _watcher(memo: kopf.Memo, watch: WatchSpec, credentials: dict[str, str], after: int | None,
             fresh: bool = False) -> RunWatcher:
    """The run's watcher, kept in memo while what it follows is the same (`fresh`: a new one)."""
    m, f = watch.metrics, watch.on_failure
    key = (m.uri, m.format, m.profile, m.last_step, tuple(f.fail_on), after, watch.source.endpoint)
    held = memo.get("run_watcher")
    if fresh or held is None or held[0] != key:
        held = (key, watcher_for(m.uri, list(f.fail_on), m.format, m.profile, m.last_step,
                                 _store_options(watch, credentials), after))
        memo["run_watcher"] = held
    return held[1]


async def follow_run(body: kopf.Body, watch: WatchSpec, status: dict, patch: kopf.Patch, memo: kopf.Memo,
                     set_condition, logger: logging.Logger) -> None:
    """One poll of the run's metrics and its incident (`set_condition(kind, ok, reason, message)`
    sets a condition on the watch and says whether it changed)."""
    namespace = body["metadata"]["namespace"]
    incident = dict(status.get("incident") or {}) or None
    credentials: dict[str, str] = {}
    try:
        credentials = await read_credentials(namespace, watch.source.credentials_secret)
        after = inc.after_step(incident)
        polled = await asyncio.to_thread(poll, _watcher(memo, watch, credentials, after),
                                         lambda: _watcher(memo, watch, credentials, after, fresh=True))
    except (PreflightError, StorageError, MalformedMetrics) as exc:
        if isinstance(exc, MalformedMetrics):
            memo.pop("run_watcher", None)  # what was read is in doubt: from the start next poll
        reason = exc.reason if isinstance(exc, PreflightError) else (
            "MetricsMalformed" if isinstance(exc, MalformedMetrics) else type(exc).__name__)
        message = redact(str(exc), credentials)[:1024]
        if set_condition(METRICS_READABLE, False, reason, message):
            kopf.warn(body, reason=reason, message=message)
        logger.warning("reading the metrics %s failed: %s: %s", watch.metrics.uri, reason, message)
        return
    watcher, failure = polled.watcher, polled.failure
    if polled.rewound:
        kopf.warn(body, reason="MetricsRewound", message=f"{watch.metrics.uri} is shorter than at the last poll: "
                  "the run started over; read again from the start (incidents in status stand)")
    said = f"{watch.metrics.uri}: through step {watcher.last_step}" if watcher.last_step is not None else \
        f"{watch.metrics.uri}: no step logged yet"
    set_condition(METRICS_READABLE, True, "Read" if watcher.last_step is not None else "NoSteps", said)
    patch.status["metrics"] = {"lastStep": watcher.last_step, "finished": watcher.finished}
    before = dict(incident) if incident else None
    try:
        incident = await _advance(body, watch, incident, failure, polled.hits, watcher.finished, credentials,
                                  memo.settings, logger)
    except StorageError as exc:  # listing the checkpoints for a new incident: tried again next poll
        logger.warning("listing %s for an incident failed: %s", watch.source.uri, redact(str(exc), credentials))
        return
    if incident is None:
        set_condition(RUN_HEALTHY, True, "NoFailure", said)
        return
    await _answer(body, watch, before, incident, credentials, set_condition, logger)
    # a merge patch keeps the keys it does not name: a new incident clears its predecessor's
    patch.status["incident"] = {**{k: None for k in before or {} if k not in incident}, **incident}
    patch.status["incidents"] = _history(status, before, incident)
    healthy = incident["state"] in (inc.S_RECOVERED, inc.S_FIXED)
    set_condition(RUN_HEALTHY, healthy, incident["state"], inc.said(incident)[:1024])


def _history(status: dict, before: dict | None, incident: dict) -> list[dict]:
    """status.incidents: the earlier incidents (step, state, diagnosis), newest last."""
    history = list(status.get("incidents") or [])
    if before and before.get("step") != incident.get("step") and before.get("state") != inc.S_CONFIRMING:
        history.append({k: before.get(k) for k in ("step", "signature", "state", "diagnosis", "firstBad",
                                                    "fixedBy")})
    return history[-inc.MAX_HISTORY:]


async def _advance(body: kopf.Body, watch: WatchSpec, incident: dict | None, failure, hits: list[bool],
                   finished: str | None, credentials: dict[str, str], settings: Settings,
                   logger: logging.Logger) -> dict | None:
    """The incident after this poll (None: none ever)."""
    f = watch.on_failure
    what = inc.confirmation(incident, failure, hits, bool(finished), f.confirm_steps)
    if what in ("wait", "recovered", "open"):
        previous = incident if incident and incident.get("step") != failure.step else None
        fresh = {"step": failure.step, "signature": failure.signature, "reason": failure.reason[:512],
                 "after": inc.after_step(previous) if previous else (incident or {}).get("after"),
                 "confirmSteps": f.confirm_steps, "previous": (previous or {}).get("diagnosis") or (
                     (previous or {}).get("name")), "name": inc.incident_name(body["metadata"]["name"], failure.step)}
        incident = {**(incident if incident and not previous else {}), **fresh}
        if what == "wait":
            return incident | {"state": inc.S_CONFIRMING}
        if what == "recovered":
            return incident | {"state": inc.S_RECOVERED}
        return await _open(body, watch, incident, failure, credentials, settings, logger)
    if incident and incident.get("state") == inc.S_DIAGNOSING:
        incident = await _follow_diagnosis(body["metadata"]["namespace"], watch, incident, logger)
    return incident


async def _follow_diagnosis(namespace: str, watch: WatchSpec, incident: dict, logger: logging.Logger) -> dict:
    """The incident as its Diagnosis has it; a Diagnosis past the budget is stopped (deleted with
    its runs, owned by it): what it found so far stays in the incident. Spent is what its runs
    cost (inc.cost: each by the completed steps); the check adds the planned hours of those still
    to run."""
    budget = watch.on_failure.budget
    diagnosis = await kube.get_or_none(DIAGNOSES, namespace, incident["diagnosis"])
    incident = incident | inc.answer(incident, diagnosis)
    runs, hours = incident.get("spentRuns") or 0, incident.get("spentDeviceHours")
    incident["budget"] = inc.budget_status(budget, runs, hours)
    to_run = inc.cost((diagnosis or {}).get("status") or {}, None).to_run
    over = inc.over_budget(budget, runs, hours, to_run, incident.get("runHours"))
    if incident["state"] == inc.S_DIAGNOSING and over:
        await kube.delete(DIAGNOSES, namespace, incident["diagnosis"])
        logger.warning("Diagnosis %s %s", incident["diagnosis"], over)
        incident.update(state=inc.S_BUDGET_SPENT, budgetRefused=over)
    return incident


def run_hours_of(watch: WatchSpec, checkpoint: str, credentials: dict[str, str], settings: Settings) -> float | None:
    """What one run is planned to cost, in device-hours, as `plan` prices it (status.plan's
    deviceHoursPerStep total of the proxy, x the template's steps: all of them), from the
    checkpoint's config.json (blocking); None when it cannot be priced (the plan's own refusal, an
    unreadable config). The forecast only: what was spent is what the runs cost (inc.cost)."""
    try:
        spec = parse_proxymodel({**watch.template_spec, "source": {"uri": checkpoint, **watch.source_fields}},
                                "namespace", "probe", settings)
        sizing = plan_for(read_source_config(spec, credentials), spec, settings)
    except (InvalidSpec, PreflightError):
        return None
    return sizing.phase_table()["total"]["proxy"] * spec.reproduction.max_steps


async def _open(body: kopf.Body, watch: WatchSpec, incident: dict, failure, credentials: dict[str, str],
                settings: Settings, logger: logging.Logger) -> dict:
    """A confirmed failure: the checkpoints up to it, the plan within the budget, the Diagnosis."""
    meta, f = body["metadata"], watch.on_failure
    found = await asyncio.to_thread(list_prefix, watch.source.uri, watch.pattern, watch.step_regex,
                                    **_store_options(watch, credentials))
    steps = sorted({c.step for c in found if c.source and c.complete and c.step is not None
                    and c.step <= failure.step})
    incident["checkpoints"] = len(steps)
    if not steps:
        return incident | {"state": inc.S_NO_CHECKPOINT}
    if len(steps) == 1:
        return incident | {"state": inc.S_TOO_FEW}
    last = next(c.uri for c in found if c.step == steps[-1] and c.source and c.complete)
    run_hours = await asyncio.to_thread(run_hours_of, watch, last, credentials, settings)
    candidates = f.candidates_for(failure.signature)
    p = inc.plan(len(steps), candidates, f.budget, inc.SEEDS, run_hours)
    incident.update(badStep=steps[-1], candidates=list(p.candidates), leftOut=list(p.left_out), runHours=run_hours,
                    budget=inc.budget_status(f.budget, 0, 0.0))  # nothing spent yet
    if p.refused:
        return incident | {"state": inc.S_BUDGET_SPENT, "budgetRefused": p.refused}
    manifest = inc.diagnosis_for(dict(body), f, failure, steps[-1], p, incident.get("previous"))
    kopf.adopt(manifest, owner=dict(body))  # deleting the watch deletes its Diagnoses
    try:
        _, created = await kube.create(DIAGNOSES, meta["namespace"], manifest)
    except kube.ApiError as exc:
        if exc.status not in (400, 403, 422):
            raise  # kopf retries the poll; the name is the incident's, so it is made once
        return incident | {"state": inc.S_DIAGNOSIS_FAILED, "message": f"the API server refused Diagnosis "
                           f"{manifest['metadata']['name']}: {exc.message or exc}"[:512]}
    logger.info("Diagnosis %s %s", manifest["metadata"]["name"], "created" if created else "exists")
    return incident | {"state": inc.S_DIAGNOSING, "diagnosis": manifest["metadata"]["name"]}


def report_prefix(watch: WatchSpec, step: int) -> str:
    """Where an incident's report goes: next to the run, s3://<run prefix>/moe-proxy/incident-<step>/."""
    return f"{watch.source.uri}/moe-proxy/incident-{step}"


def _write_report(prefix: str, report: dict, store_options: dict) -> None:
    store = S3Store(prefix, **store_options)
    for name, data in (("report.json", json.dumps(report, indent=2).encode()),
                       ("report.md", inc.report_md(report).encode())):
        writer = store.writer(name)
        writer.write(data)
        writer.commit()


async def _answer(body: kopf.Body, watch: WatchSpec, before: dict | None, incident: dict,
                  credentials: dict[str, str], set_condition, logger: logging.Logger) -> None:
    """Events for the stages reached, the report next to the run when its answer changed, and the
    webhook once the incident is closed (both retried on the next poll when they fail)."""
    meta = body["metadata"]
    for kind, reason, message in inc.events(before, incident):
        kopf.event(body, type=kind, reason=reason, message=message)
    if incident["state"] == inc.S_CONFIRMING:
        return
    report = inc.report(meta["name"], meta["namespace"], incident)
    stage = [incident["state"], incident.get("firstBad"), incident.get("fixedBy")]
    if incident.get("reported") != stage:
        prefix = report_prefix(watch, incident["step"])
        try:
            await asyncio.to_thread(_write_report, prefix, report, _store_options(watch, credentials))
            incident.update(reported=stage, report=f"{prefix}/report.md")
        except StorageError as exc:
            logger.warning("writing the report to %s failed: %s", prefix, redact(str(exc), credentials))
    if not inc.is_open(incident) and watch.on_failure.webhook_secret:
        await _webhook(body, watch, incident, report, set_condition, logger)


async def _webhook(body: kopf.Body, watch: WatchSpec, incident: dict, report: dict, set_condition,
                   logger: logging.Logger) -> None:
    """POST the answer once; a refusal is the WebhookDelivered condition, tried again next poll
    (at most WEBHOOK_ATTEMPTS times). The URL is never logged, in status or in an Event."""
    hook = dict(incident.get("webhook") or {})
    if hook.get("state") == "Delivered" or hook.get("attempts", 0) >= WEBHOOK_ATTEMPTS:
        return
    hook["attempts"] = hook.get("attempts", 0) + 1
    error = await post_webhook(body["metadata"]["namespace"], watch.on_failure.webhook_secret,
                               inc.webhook_body(report))
    if error is None:
        hook.update(state="Delivered", error=None)
        set_condition(WEBHOOK_DELIVERED, True, "Delivered", f"incident at step {incident['step']}: the answer was "
                      f"posted (attempt {hook['attempts']})")
    else:
        gave_up = hook["attempts"] >= WEBHOOK_ATTEMPTS
        hook.update(state="GaveUp" if gave_up else "Refused", error=error)
        reason = "WebhookGaveUp" if gave_up else "WebhookRefused"
        message = (f"incident at step {incident['step']}: the webhook refused the answer ({error}); attempt "
                   f"{hook['attempts']} of {WEBHOOK_ATTEMPTS}" + ("; given up" if gave_up else ", tried again "
                                                                  "next poll"))
        if set_condition(WEBHOOK_DELIVERED, False, reason, message):
            kopf.warn(body, reason=reason, message=message)
        logger.warning(message)
    incident["webhook"] = hook


async def post_webhook(namespace: str, ref: tuple[str, str], payload: dict) -> str | None:
    """None when the receiver took it; else why not, without the URL (an HTTP status, or the
    error's kind)."""
    name, key = ref
    try:
        secret = await kube.get(SECRETS, namespace, name)
    except kube.ApiError as exc:
        return f"Secret {name}: HTTP {exc.status}"
    raw = (secret.get("data") or {}).get(key)
    if not raw:
        return f"Secret {name} has no key {key}"
    url = base64.b64decode(raw).decode().strip()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WEBHOOK_TIMEOUT)) as session:
            async with session.post(url, json=payload) as response:
                if response.status >= 300:
                    return f"HTTP {response.status}"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        return type(exc).__name__  # never str(exc): it may hold the URL
    return None
