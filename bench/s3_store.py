"""S3Store benchmark: streamed multipart upload and ranged reads against boto3's own managed
transfers (s3transfer), on a local SeaweedFS, with each process's peak memory.

- upload: S3Writer fed 8 MiB chunks (as a shard writer produces them; 64 MiB parts, 4 in
  flight) versus `client.upload_fileobj` of the same bytes from a file;
- download: read_range in 64 MiB ranges on 4 threads (as the builder reads) versus
  `client.download_fileobj` to a file.

Each measurement runs in a fresh process (peak RSS is per process). Prints a table and writes
bench/out/s3_store.json. Usage: .venv/bin/python bench/s3_store.py [--gib 1] [--out bench/out] [--quick]
(--quick: 80 MiB, one full 64 MiB part and a short one: a smoke run whose figures mean nothing;
tests/bench/test_bench_quick.py runs it.)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from moe_proxy.demo.seaweed import SeaweedFS

KEYS = ("bench-access-key", "bench-secret-key")
CHUNK = 8 << 20

# Each snippet gets: endpoint, size, path (a local file of `size` bytes); prints SECONDS and PEAK.
COMMON = f"""
import os, resource, sys, time
os.environ.update(AWS_ACCESS_KEY_ID={KEYS[0]!r}, AWS_SECRET_ACCESS_KEY={KEYS[1]!r}, AWS_EC2_METADATA_DISABLED="true")
endpoint, size, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def done(t0):
    print("SECONDS", time.perf_counter() - t0)
    print("PEAK", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""
SNIPPETS = {
    "upload: S3Writer (moe-proxy)": """
from moe_proxy.storage import open_store
store = open_store("s3://bench/ours", endpoint_url=endpoint)
t0 = time.perf_counter()
w = store.writer("blob")
with open(path, "rb") as f:
    while chunk := f.read(%d):
        w.write(chunk)
w.commit()
done(t0)
""" % CHUNK,
    "upload: upload_fileobj (s3transfer)": """
import boto3
from botocore.config import Config
c = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", config=Config(s3={"addressing_style": "path"}))
t0 = time.perf_counter()
with open(path, "rb") as f:
    c.upload_fileobj(f, "bench", "theirs/blob")
done(t0)
""",
    "download: read_range x4 threads (moe-proxy)": """
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from moe_proxy.storage import open_store
store = open_store("s3://bench/ours", endpoint_url=endpoint)
part = 64 << 20
t0 = time.perf_counter()
with ThreadPoolExecutor(4) as pool, open(path + ".back", "wb") as f:
    ahead = deque()  # at most 4 ranges in memory, as the builder's read-ahead
    for s in range(0, size, part):
        ahead.append(pool.submit(store.read_range, "blob", s, min(part, size - s)))
        if len(ahead) == 4:
            f.write(ahead.popleft().result())
    while ahead:
        f.write(ahead.popleft().result())
done(t0)
""",
    "download: download_fileobj (s3transfer)": """
import boto3
from botocore.config import Config
c = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", config=Config(s3={"addressing_style": "path"}))
t0 = time.perf_counter()
with open(path + ".back2", "wb") as f:
    c.download_fileobj("bench", "theirs/blob", f)
done(t0)
""",
}


def run(snippet: str, endpoint: str, size: int, path: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", COMMON + snippet, endpoint, str(size), str(path)],
                         capture_output=True, text=True, check=True).stdout
    values = dict(line.split() for line in out.splitlines() if line.startswith(("SECONDS", "PEAK")))
    return {"seconds": float(values["SECONDS"]), "peak_rss": int(values["PEAK"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--out", default="bench/out")
    parser.add_argument("--quick", action="store_true", help="80 MiB instead of --gib: a smoke run")
    args = parser.parse_args()
    size = 80 << 20 if args.quick else int(args.gib * (1 << 30))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, SeaweedFS(Path(tmp) / "weed", *KEYS, buckets=["bench"]) as s3:
        path = Path(tmp) / "blob"
        block = bytes(range(256)) * (CHUNK // 256)
        with open(path, "wb") as f:  # incompressible enough; the store does not compress anyway
            for i in range(0, size, CHUNK):
                f.write(block[: min(CHUNK, size - i)])
        results = {name: run(snippet, s3.endpoint_url, size, path) for name, snippet in SNIPPETS.items()}
        assert (Path(tmp) / "blob.back").read_bytes() == path.read_bytes(), "read back differs"
    print(f"{size / 2**30:.2f} GiB through SeaweedFS on 127.0.0.1")
    print(f"{'':46} {'MB/s':>8} {'peak RSS MB':>12}")
    for name, r in results.items():
        print(f"{name:46} {size / r['seconds'] / 1e6:8.0f} {r['peak_rss'] / 1e6:12.0f}")
    (out / "s3_store.json").write_text(json.dumps({"bytes": size, "results": results}, indent=2))


if __name__ == "__main__":
    main()
