"""Before any Job exists: read the source checkpoint's config.json and plan the proxy.

This catches, in seconds and with a clear condition, what would otherwise fail a Job after
it was scheduled: an unsupported or dense architecture, an expert count the model cannot
keep, wrong credentials, a missing checkpoint. It reads one small object with the
credentials of the Secret the ProxyModel names; they stay in memory, and any message that
leaves this module has them scrubbed out.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import threading
from dataclasses import dataclass, field, replace

from moe_proxy.errors import AccessDenied, EndpointUnreachable, MoeProxyError, ObjectNotFound, StorageError
from moe_proxy.sizing import (BYTES_PER_PARAM, Sizing, SizingOptions, auto_plan, estimate, rollout_copy,
                              rollout_snapshots)
from moe_proxy.storage.s3 import S3Store

from . import kube
from .resources import SECRETS
from .settings import Settings
from .spec import InvalidSpec, parse
from .spec_types import ProxyModelSpec

CREDENTIAL_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


class PreflightError(Exception):
    """A reason (CamelCase, for the condition) and whether retrying later can help."""

    def __init__(self, reason: str, message: str, retry: bool = False):
        super().__init__(message)
        self.reason, self.message, self.retry = reason, message, retry


@dataclass(frozen=True)
class Preflight:
    config: dict
    plan: Sizing
    prices: dict[str, float] = field(default_factory=dict)  # precision_prices: per step at each precision


def redact(text: str, secrets: dict[str, str]) -> str:
    for value in secrets.values():
        if value and len(value) >= 4:
            text = text.replace(value, "***")
    return text


async def read_credentials(namespace: str, secret: str, seen: dict | None = None) -> dict[str, str]:
    """AWS_* values of the named Secret ({} when the ProxyModel names none). `seen["secret"]`:
    which Secret the answer came from (its resourceVersion, or "absent")."""
    if not secret:
        return {}
    try:
        body = await kube.get(SECRETS, namespace, secret)
    except kube.ApiError as exc:
        if seen is not None:
            seen["secret"] = "absent" if exc.status == 404 else f"HTTP {exc.status}"
        if exc.status == 404:
            raise PreflightError("SecretNotFound", f"Secret {namespace}/{secret} (spec.source.credentialsSecret) "
                                 "does not exist; create it with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
                                 retry=True) from None
        raise PreflightError("SecretUnreadable", f"Secret {namespace}/{secret}: HTTP {exc.status} {exc.reason}",
                             retry=True) from None
    if seen is not None:
        seen["secret"] = (body.get("metadata") or {}).get("resourceVersion") or "unversioned"
    data = body.get("data") or {}
    values = {k: base64.b64decode(data[k]).decode() for k in CREDENTIAL_KEYS if data.get(k)}
    missing = [k for k in CREDENTIAL_KEYS[:2] if k not in values]
    if missing:
        raise PreflightError("SecretIncomplete", f"Secret {namespace}/{secret} lacks {' and '.join(missing)}",
                             retry=True)
    return values


_stores: dict[tuple, S3Store] = {}  # building a boto3 client costs ~0.2 s of CPU: reuse them
_stores_lock = threading.Lock()
MAX_STORES = 64


def s3_store(uri: str, spec: ProxyModelSpec, credentials: dict[str, str]) -> S3Store:
    """moe_proxy's S3Store for `uri` with the Secret's credentials (cached per location and
    credentials; the key holds a digest, not the secret)."""
    source = spec.source
    digest = hashlib.sha256(json.dumps(credentials, sort_keys=True).encode()).hexdigest()
    key = (uri, source.endpoint, source.region, digest)
    with _stores_lock:
        if key not in _stores:
            if len(_stores) >= MAX_STORES:
                _stores.clear()
            _stores[key] = S3Store(uri, endpoint_url=source.endpoint or None, region=source.region or "us-east-1",
                                   credentials=credentials, max_attempts=2, connect_timeout=3, read_timeout=10)
        return _stores[key]


def read_source_config(spec: ProxyModelSpec, credentials: dict[str, str], seen: dict | None = None) -> dict:
    """config.json of the source checkpoint (blocking: run it in a thread). `seen["source"]`:
    which source the answer came from (the sha256 of the bytes read, or why none were)."""
    where = f"{spec.source.uri.rstrip('/')}/config.json"
    seen = {} if seen is None else seen
    try:
        raw = s3_store(spec.source.uri, spec, credentials).read_bytes("config.json")
    except AccessDenied as exc:
        seen["source"] = "denied"
        raise PreflightError("S3AccessDenied", f"access denied reading {where}: {exc}; check the credentials in "
                             "spec.source.credentialsSecret and the bucket policy") from None
    except ObjectNotFound as exc:
        seen["source"] = "absent"
        raise PreflightError("S3NoSuchKey", f"{where} does not exist ({exc}): spec.source.uri must be a "
                             "Hugging Face checkpoint directory") from None
    except EndpointUnreachable as exc:
        seen["source"] = "unreachable"
        raise PreflightError("S3Unreachable", str(exc), retry=True) from None
    except StorageError as exc:
        seen["source"] = "unreadable"
        raise PreflightError("S3Error", str(exc), retry=True) from None
    seen["source"] = hashlib.sha256(raw).hexdigest()[:16]
    try:
        config = json.loads(raw)
    except ValueError as exc:
        raise PreflightError("CorruptCheckpoint", f"{where} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise PreflightError("CorruptCheckpoint", f"{where} is not a JSON object")
    return config


def plan_options(spec: ProxyModelSpec, settings: Settings, precision: str | None = None) -> SizingOptions:
    """The planner's options for this spec, at `precision` (default the reproduction's): the
    rollout copy follows the training precision as repro makes it."""
    r, p = spec.reproduction, spec.pruning
    precision = precision or r.precision
    return SizingOptions(
        experts=p.experts, keep_ratio=p.keep_ratio, top_k=p.top_k, precision=precision,
        accelerator=r.accelerator.resource, device_memory_gb=r.accelerator.memory_gb or settings.device_memory_gb,
        devices_per_node=r.accelerator.devices_per_node,
        max_devices=r.accelerator.devices,  # an explicit device count is the budget for the kept experts
        rollout_copy=rollout_copy(precision, r.config.rollout_precision, r.config.rollout_kernels,
                                  r.config.rollout_staleness),
        rollout_snapshots=rollout_snapshots(r.config.rollout_staleness),
    )


def plan_for(config: dict, spec: ProxyModelSpec, settings: Settings) -> Sizing:
    """The planner's verdict on this spec; its errors become a reason named after the error."""
    options = plan_options(spec, settings)
    try:
        if spec.pruning.auto:  # `experts: auto`: sized for the largest count the build may choose
            return auto_plan(config, options)
        return estimate(config, options)
    except MoeProxyError as exc:
        raise PreflightError(type(exc).__name__, str(exc)) from None


def precision_prices(config: dict, spec: ProxyModelSpec, settings: Settings, plan: Sizing) -> dict[str, float]:
    """The proxy's device-hours per RL step at each precision a run could take (a Diagnosis's
    candidate may change it), so that every finished run is priced at the precision it ran at.
    `plan`'s kept experts and top-k are given explicitly: a precision cannot change the proxy's
    shape. A precision the planner refuses (e.g. over the device budget) is left out."""
    prices = {plan.precision: plan.proxy.device_hours_per_step}
    for precision in BYTES_PER_PARAM.keys() - prices.keys():
        options = replace(plan_options(spec, settings, precision), experts=plan.proxy.experts_per_layer,
                          keep_ratio=None, top_k=plan.proxy.top_k)
        try:
            prices[precision] = estimate(config, options).proxy.device_hours_per_step
        except MoeProxyError:
            continue
    return {p: prices[p] for p in BYTES_PER_PARAM if p in prices}


async def preflight(namespace: str, spec: ProxyModelSpec, settings: Settings, seen: dict | None = None) -> Preflight:
    """Read the Secret and config.json, and plan. `seen` collects what the verdict depended on
    (see `dependencies`), whatever the verdict."""
    credentials = await read_credentials(namespace, spec.source.credentials_secret, seen)
    try:
        config = await asyncio.to_thread(read_source_config, spec, credentials, seen)
        plan = plan_for(config, spec, settings)
        return Preflight(config, plan, precision_prices(config, spec, settings, plan))
    except PreflightError as exc:
        raise PreflightError(exc.reason, redact(exc.message, credentials), exc.retry) from None


def settings_fingerprint(settings: Settings) -> str:
    """The operator's settings, in short: a judgment made under other settings may differ."""
    return hashlib.sha256(repr(settings).encode()).hexdigest()[:12]


async def dependencies(namespace: str, name: str, spec: dict, settings: Settings) -> dict:
    """What judging this spec depends on besides the spec: the operator's settings, the Secret
    (its resourceVersion) and the source (its config.json's sha256), as `validate` records them
    in a refusal. Read the same way as the preflight, without judging anything."""
    seen = {"settings": settings_fingerprint(settings)}
    try:
        parsed = parse(spec, namespace, name, settings)
    except InvalidSpec:
        return seen
    if settings.preflight:
        try:
            credentials = await read_credentials(namespace, parsed.source.credentials_secret, seen)
            await asyncio.to_thread(read_source_config, parsed, credentials, seen)
        except PreflightError:
            pass  # what could not be read is recorded as such
    return seen
