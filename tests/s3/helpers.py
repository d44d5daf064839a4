"""Helpers shared by the S3 tests (the fixtures are in conftest.py)."""

from __future__ import annotations

import secrets
from pathlib import Path

from moe_proxy.demo.seaweed import SeaweedFS

ACCESS_KEY = "moe-proxy-test-key"
SECRET_KEY = "test-secret-" + secrets.token_hex(12)
PART = 5 << 20  # S3's smallest multipart part: makes multi-part uploads out of small files


def tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def download(seaweed: SeaweedFS, uri: str, dest: Path) -> Path:
    bucket, _, prefix = uri[len("s3://"):].partition("/")
    client = seaweed.client()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for obj in page.get("Contents", []):
            target = dest / obj["Key"][len(prefix) + 1:]
            target.parent.mkdir(parents=True, exist_ok=True)
            client.download_file(bucket, obj["Key"], str(target))
    return dest


def incomplete_uploads(seaweed: SeaweedFS, bucket: str, prefix: str) -> list[dict]:
    return seaweed.client().list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])
