"""Deleting a proxy from object storage, when a ProxyModel asks for it on deletion
(spec.cleanup.deleteProxy). Only then does the ProxyModel carry a finalizer."""

from __future__ import annotations

import asyncio

from .preflight import read_credentials, s3_client, split_uri
from .spec import ProxyModelSpec


def _delete_all(spec: ProxyModelSpec, credentials: dict[str, str]) -> int:
    client = s3_client(spec, credentials)
    bucket, prefix = split_uri(spec.destination)
    deleted = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        keys = [{"Key": o["Key"]} for o in page.get("Contents") or []]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
            deleted += len(keys)
    return deleted


async def delete_prefix(namespace: str, spec: ProxyModelSpec) -> int:
    """Delete every object under spec.destination; returns how many."""
    credentials = await read_credentials(namespace, spec.source.credentials_secret)
    return await asyncio.to_thread(_delete_all, spec, credentials)
