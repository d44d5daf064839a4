"""Deleting a proxy from object storage, when a ProxyModel asks for it on deletion
(spec.cleanup.deleteProxy). Only then does the ProxyModel carry a finalizer."""

from __future__ import annotations

import asyncio

from .preflight import read_credentials, s3_store
from .spec_types import ProxyModelSpec


def _delete_all(spec: ProxyModelSpec, credentials: dict[str, str]) -> int:
    store = s3_store(spec.destination, spec, credentials)
    names = store.list()
    for name in names:
        store.delete(name)
    return len(names)


async def delete_prefix(namespace: str, spec: ProxyModelSpec) -> int:
    """Delete every object under spec.destination; returns how many."""
    credentials = await read_credentials(namespace, spec.source.credentials_secret)
    return await asyncio.to_thread(_delete_all, spec, credentials)
