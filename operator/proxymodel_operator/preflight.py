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
from dataclasses import dataclass

from moe_proxy.errors import MoeProxyError
from moe_proxy.planner import Plan, PlanOptions, plan

from . import kube
from .resources import SECRETS
from .settings import Settings
from .spec import ProxyModelSpec

CREDENTIAL_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken", "403"}
MISSING = {"NoSuchKey", "NoSuchBucket", "404", "NotFound"}


class PreflightError(Exception):
    """A reason (CamelCase, for the condition) and whether retrying later can help."""

    def __init__(self, reason: str, message: str, retry: bool = False):
        super().__init__(message)
        self.reason, self.message, self.retry = reason, message, retry


@dataclass(frozen=True)
class Preflight:
    config: dict
    plan: Plan


def redact(text: str, secrets: dict[str, str]) -> str:
    for value in secrets.values():
        if value and len(value) >= 4:
            text = text.replace(value, "***")
    return text


async def read_credentials(namespace: str, secret: str) -> dict[str, str]:
    """AWS_* values of the named Secret ({} when the ProxyModel names none)."""
    if not secret:
        return {}
    try:
        body = await kube.get(SECRETS, namespace, secret)
    except kube.ApiError as exc:
        if exc.status == 404:
            raise PreflightError("SecretNotFound", f"Secret {namespace}/{secret} (spec.source.credentialsSecret) "
                                 "does not exist; create it with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
                                 retry=True) from None
        raise PreflightError("SecretUnreadable", f"Secret {namespace}/{secret}: HTTP {exc.status} {exc.reason}",
                             retry=True) from None
    data = body.get("data") or {}
    values = {k: base64.b64decode(data[k]).decode() for k in CREDENTIAL_KEYS if data.get(k)}
    missing = [k for k in CREDENTIAL_KEYS[:2] if k not in values]
    if missing:
        raise PreflightError("SecretIncomplete", f"Secret {namespace}/{secret} lacks {' and '.join(missing)}",
                             retry=True)
    return values


def split_uri(uri: str) -> tuple[str, str]:
    bucket, _, prefix = uri[len("s3://"):].partition("/")
    return bucket, prefix.strip("/")


_clients: dict[tuple, object] = {}  # building a boto3 client costs ~0.2 s of CPU: reuse them
_clients_lock = threading.Lock()
MAX_CLIENTS = 64


def s3_client(spec: ProxyModelSpec, credentials: dict[str, str]):
    """A boto3 S3 client for the ProxyModel's endpoint with the Secret's credentials (cached
    per endpoint and credentials; the key holds a digest, not the secret)."""
    import boto3
    from botocore.config import Config

    source = spec.source
    digest = hashlib.sha256(json.dumps(credentials, sort_keys=True).encode()).hexdigest()
    key = (source.endpoint, source.region, digest)
    with _clients_lock:
        if key not in _clients:
            if len(_clients) >= MAX_CLIENTS:
                _clients.clear()
            _clients[key] = boto3.session.Session().client(
                "s3",
                endpoint_url=source.endpoint or None,
                region_name=source.region or "us-east-1",
                aws_access_key_id=credentials.get("AWS_ACCESS_KEY_ID"),
                aws_secret_access_key=credentials.get("AWS_SECRET_ACCESS_KEY"),
                aws_session_token=credentials.get("AWS_SESSION_TOKEN"),
                config=Config(s3={"addressing_style": "path"} if source.endpoint else None,
                              retries={"mode": "standard", "max_attempts": 2}, connect_timeout=3, read_timeout=10,
                              max_pool_connections=32),
            )
        return _clients[key]


def read_source_config(spec: ProxyModelSpec, credentials: dict[str, str]) -> dict:
    """config.json of the source checkpoint (blocking: run it in a thread)."""
    from botocore.exceptions import BotoCoreError, ClientError, EndpointConnectionError

    source = spec.source
    client = s3_client(spec, credentials)
    bucket, prefix = split_uri(source.uri)
    key = f"{prefix}/config.json" if prefix else "config.json"
    where = f"s3://{bucket}/{key}"
    try:
        raw = client.get_object(Bucket=bucket, Key=key)["Body"].read(1 << 20)
    except ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code in DENIED:
            raise PreflightError("S3AccessDenied", f"{where}: access denied ({code}); check the credentials "
                                 f"in spec.source.credentialsSecret and the bucket policy") from None
        if code in MISSING:
            raise PreflightError("S3NoSuchKey", f"{where} does not exist ({code}): spec.source.uri must be a "
                                 "Hugging Face checkpoint directory") from None
        raise PreflightError("S3Error", f"{where}: {code}", retry=True) from None
    except (EndpointConnectionError, BotoCoreError) as exc:
        raise PreflightError("S3Unreachable", f"{where}: the object store at {source.endpoint or 'AWS'} did not "
                             f"answer ({type(exc).__name__})", retry=True) from None
    try:
        config = json.loads(raw)
    except ValueError as exc:
        raise PreflightError("CorruptCheckpoint", f"{where} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise PreflightError("CorruptCheckpoint", f"{where} is not a JSON object")
    return config


def plan_for(config: dict, spec: ProxyModelSpec, settings: Settings) -> Plan:
    """The planner's verdict on this spec; its errors become a reason named after the error."""
    r, p = spec.reproduction, spec.pruning
    options = PlanOptions(
        experts=p.experts, keep_ratio=p.keep_ratio, top_k=p.top_k, precision=r.precision,
        accelerator=r.accelerator.resource, device_memory_gb=r.accelerator.memory_gb or settings.device_memory_gb,
        devices_per_node=r.accelerator.devices_per_node,
    )
    try:
        return plan(config, options)
    except MoeProxyError as exc:
        raise PreflightError(type(exc).__name__, str(exc)) from None


async def preflight(namespace: str, spec: ProxyModelSpec, settings: Settings) -> Preflight:
    credentials = await read_credentials(namespace, spec.source.credentials_secret)
    try:
        config = await asyncio.to_thread(read_source_config, spec, credentials)
        return Preflight(config, plan_for(config, spec, settings))
    except PreflightError as exc:
        raise PreflightError(exc.reason, redact(exc.message, credentials), exc.retry) from None
