"""The plain parallel copy: every object under one S3 prefix to another, with N requests' worth
of work in flight, and nothing else. The baseline a build is held against: moving the proxy's
bytes through the same endpoint (and the same paced relay) as fast as a simple tool would.

N threads share one boto3 client; each task copies one part (a ranged GET, then an UploadPart
of those bytes) or one small object (GET, then PUT), so at most N parts are in memory. All
objects' parts go into one queue: no pause between objects. Run in a fresh process; prints
one JSON line: seconds, cpu_s (user + system), max_rss (bytes), bytes (copied).

Usage: python bench/parallel_copy.py ENDPOINT s3://bucket/src s3://bucket/dst N [PART_MB]
(credentials from the environment)
"""

from __future__ import annotations

import json
import resource
import sys
import time
from concurrent.futures import ThreadPoolExecutor


def split(uri: str) -> tuple[str, str]:
    bucket, _, prefix = uri[len("s3://"):].partition("/")
    return bucket, prefix.rstrip("/")


def copy(client, src: str, dst: str, n: int, part: int) -> int:
    (sb, sp), (db, dp) = split(src), split(dst)
    objects = [(o["Key"][len(sp) + 1:], o["Size"])
               for page in client.get_paginator("list_objects_v2").paginate(Bucket=sb, Prefix=sp + "/")
               for o in page.get("Contents", [])]

    def get(name: str, start: int, length: int) -> bytes:
        r = client.get_object(Bucket=sb, Key=f"{sp}/{name}", Range=f"bytes={start}-{start + length - 1}")
        return r["Body"].read()

    def small(name: str, size: int) -> None:
        client.put_object(Bucket=db, Key=f"{dp}/{name}", Body=get(name, 0, size) if size else b"")

    def one_part(name: str, upload_id: str, number: int, start: int, length: int) -> dict:
        r = client.upload_part(Bucket=db, Key=f"{dp}/{name}", UploadId=upload_id, PartNumber=number,
                               Body=get(name, start, length))
        return {"PartNumber": number, "ETag": r["ETag"]}

    with ThreadPoolExecutor(n) as pool:
        uploads = []
        for name, size in objects:
            if size <= part:
                uploads.append((name, None, [pool.submit(small, name, size)]))
                continue
            upload_id = client.create_multipart_upload(Bucket=db, Key=f"{dp}/{name}")["UploadId"]
            parts = [pool.submit(one_part, name, upload_id, i + 1, s, min(part, size - s))
                     for i, s in enumerate(range(0, size, part))]
            uploads.append((name, upload_id, parts))
        for name, upload_id, parts in uploads:
            done = [f.result() for f in parts]
            if upload_id:
                client.complete_multipart_upload(Bucket=db, Key=f"{dp}/{name}", UploadId=upload_id,
                                                 MultipartUpload={"Parts": done})
    return sum(size for _, size in objects)


def main(argv: list[str]) -> None:
    import boto3
    from botocore.config import Config

    endpoint, src, dst, n = argv[:4]
    n, part = int(n), int(float(argv[4]) * (1 << 20)) if len(argv) > 4 else 16 << 20
    client = boto3.client("s3", endpoint_url=endpoint, config=Config(
        s3={"addressing_style": "path"}, max_pool_connections=n, retries={"mode": "standard", "max_attempts": 5},
        request_checksum_calculation="when_required"))
    t0, cpu0 = time.perf_counter(), sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
    copied = copy(client, src, dst, n, part)
    u = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"seconds": time.perf_counter() - t0, "cpu_s": u.ru_utime + u.ru_stime - cpu0,
                      "max_rss": u.ru_maxrss * 1024, "bytes": copied}))


if __name__ == "__main__":
    main(sys.argv[1:])
