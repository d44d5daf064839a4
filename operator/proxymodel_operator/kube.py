"""A small asynchronous Kubernetes API client for the calls kopf does not make for us:
creating and deleting child workloads, reading pods and one Secret, patching a ProxyModel's
status from a child's handler.

It uses the same credentials kopf logs in with (`configure` is called from the login
handler) and refuses any call that `rbac.PERMISSIONS` does not list, so the Helm chart's
ClusterRole and the code cannot drift apart. Dicts in, dicts out.
"""

from __future__ import annotations

import base64
import ssl
import tempfile
from dataclasses import dataclass
from typing import Any

import aiohttp
import kopf

from . import rbac
from .resources import Resource


class ApiError(Exception):
    """The API server answered with an error status."""

    def __init__(self, status: int, reason: str, message: str):
        super().__init__(f"HTTP {status} {reason}: {message}")
        self.status, self.reason, self.message = status, reason, message


class NotListed(RuntimeError):
    """The code tried a call that rbac.PERMISSIONS does not grant (a bug, caught in tests)."""


@dataclass
class _State:
    info: kopf.ConnectionInfo | None = None
    session: aiohttp.ClientSession | None = None


_state = _State()


def configure(info: kopf.ConnectionInfo) -> None:
    """Use these credentials from now on (called by the operator's login handler)."""
    _state.info, _state.session = info, None


async def close() -> None:
    if _state.session is not None:
        await _state.session.close()
    _state.session = None


def _ssl_context(info: kopf.ConnectionInfo) -> ssl.SSLContext | bool:
    if info.insecure:
        return False
    context = ssl.create_default_context(cafile=info.ca_path)
    if info.ca_data:
        data = info.ca_data.decode() if isinstance(info.ca_data, bytes) else info.ca_data
        if "BEGIN CERTIFICATE" not in data:
            data = base64.b64decode(data).decode()
        context.load_verify_locations(cadata=data)
    if info.certificate_path or info.certificate_data:
        cert, key = info.certificate_path, info.private_key_path
        with tempfile.TemporaryDirectory() as tmp:  # ssl only loads client keys from files
            if info.certificate_data:
                cert = f"{tmp}/cert.pem"
                open(cert, "wb").write(_pem(info.certificate_data))
            if info.private_key_data:
                key = f"{tmp}/key.pem"
                open(key, "wb").write(_pem(info.private_key_data))
            context.load_cert_chain(cert, key)
    return context


def _pem(data: str | bytes) -> bytes:
    raw = data.encode() if isinstance(data, str) else data
    return raw if b"-----BEGIN" in raw else base64.b64decode(raw)


def _session() -> aiohttp.ClientSession:
    info = _state.info
    if info is None:
        raise RuntimeError("kube.configure() was not called: the operator has not logged in")
    if _state.session is None or _state.session.closed:
        headers = {"Accept": "application/json"}
        if info.token:
            headers["Authorization"] = f"{info.scheme or 'Bearer'} {info.token}"
        auth = aiohttp.BasicAuth(info.username, info.password or "") if info.username else None
        _state.session = aiohttp.ClientSession(
            base_url=info.server.rstrip("/") + "/", headers=headers, auth=auth,
            connector=aiohttp.TCPConnector(ssl=_ssl_context(info), limit=50),
            timeout=aiohttp.ClientTimeout(total=60),
        )
    return _state.session


async def _request(method: str, verb: str, resource: Resource, path: str, subresource: str | None = None,
                   **kwargs: Any) -> dict:
    plural = f"{resource.plural}/{subresource}" if subresource else resource.plural
    if not rbac.allowed(resource.group, plural, verb):
        raise NotListed(f"{verb} {resource.group or 'core'}/{plural} is not in rbac.PERMISSIONS")
    async with _session().request(method, path.lstrip("/"), **kwargs) as response:
        body = await response.json(content_type=None) if response.content_length != 0 else {}
        if response.status >= 400:
            body = body if isinstance(body, dict) else {}
            raise ApiError(response.status, str(body.get("reason", response.reason)),
                           str(body.get("message", "")))
        return body


async def create(resource: Resource, namespace: str, obj: dict) -> tuple[dict, bool]:
    """Create `obj`; if one of that name exists already, return it instead: (object, created).
    A retry after a crash or a restart therefore never makes a duplicate."""
    try:
        return await _request("POST", "create", resource, resource.path(namespace), json=obj), True
    except ApiError as exc:
        if exc.status != 409:
            raise
    return await get(resource, namespace, obj["metadata"]["name"]), False


async def exists(resource: Resource, namespace: str, name: str) -> bool:
    try:
        await get(resource, namespace, name)
        return True
    except ApiError as exc:
        if exc.status == 404:
            return False
        raise


async def get(resource: Resource, namespace: str, name: str) -> dict:
    return await _request("GET", "get", resource, resource.path(namespace, name))


async def get_or_none(resource: Resource, namespace: str, name: str) -> dict | None:
    """The object, or None when it is not there (404)."""
    try:
        return await get(resource, namespace, name)
    except ApiError as exc:
        if exc.status == 404:
            return None
        raise


async def delete(resource: Resource, namespace: str, name: str) -> bool:
    """Delete with background propagation (its pods go too); False if it was already gone."""
    body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
    try:
        await _request("DELETE", "delete", resource, resource.path(namespace, name), json=body)
        return True
    except ApiError as exc:
        if exc.status == 404:
            return False
        raise


async def list_(resource: Resource, namespace: str, labels: dict[str, str]) -> list[dict]:
    selector = ",".join(f"{k}={v}" for k, v in labels.items())
    body = await _request("GET", "list", resource, resource.path(namespace), params={"labelSelector": selector})
    items = body.get("items") or []
    # Filter here too: a label selector is a request, and not every server honours it.
    return [i for i in items if all((i.get("metadata", {}).get("labels") or {}).get(k) == v
                                    for k, v in labels.items())]


async def patch(resource: Resource, namespace: str, name: str, body: dict) -> dict:
    """Merge-patch the object itself (its metadata, e.g. an annotation)."""
    return await _request("PATCH", "patch", resource, resource.path(namespace, name), json=body,
                          headers={"Content-Type": "application/merge-patch+json"})


async def patch_status(resource: Resource, namespace: str, name: str, status: dict,
                       resource_version: str | None = None) -> dict:
    """Merge-patch the status subresource. With `resource_version`, only if the object is still
    at that version (else ApiError 409: re-read and decide again)."""
    body: dict = {"status": status}
    if resource_version:
        body["metadata"] = {"resourceVersion": resource_version}
    return await _request("PATCH", "patch", resource, resource.path(namespace, name, "status"),
                          subresource="status", json=body, headers={"Content-Type": "application/merge-patch+json"})
