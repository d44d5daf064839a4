"""Whole builds from and to S3 (real SeaweedFS): same bytes as a local build, only the kept
bytes downloaded, idempotent reruns, refusal of a different proxy, CLI inspect/verify."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest

from moe_proxy.pruning.build import build_proxy, build_share, finalize_build
from moe_proxy.checkpoint.reader import MANIFEST
from moe_proxy.errors import DestinationExists
from .faultproxy import FaultProxy
from .helpers import download, incomplete_uploads, tree


def without_source_uri(manifest: dict) -> dict:
    m = json.loads(json.dumps(manifest))
    m["source"].pop("uri")
    return m


def test_round_trip_equals_local_build(seaweed, local_ckpt, s3_ckpt, prefix, tmp_path):
    """local -> S3 -> proxy (built S3 to S3) -> local is byte for byte the local-only build."""
    local = build_proxy(str(local_ckpt), str(tmp_path / "local"), experts=8)
    remote = build_proxy(s3_ckpt, f"s3://proxy/{prefix}", experts=8,
                         store_options={"endpoint_url": seaweed.endpoint_url})
    assert without_source_uri(remote) == without_source_uri(local)
    got, want = tree(download(seaweed, f"s3://proxy/{prefix}", tmp_path / "back")), tree(tmp_path / "local")
    assert sorted(got) == sorted(want)
    for name in want:
        if name != MANIFEST:  # the manifest names its source, which differs
            assert got[name] == want[name], name


def test_downloads_little_more_than_the_proxy(seaweed, s3_ckpt, prefix):
    """87.5% pruning (64 -> 8 experts) with router features: bytes that came over the wire,
    counted at a TCP proxy in front of the server, are close to the proxy's own size."""
    with FaultProxy(int(seaweed.endpoint_url.rsplit(":", 1)[1])) as counter:
        m = build_proxy(s3_ckpt, f"s3://proxy/{prefix}", experts=8,
                        store_options={"endpoint_url": counter.endpoint_url})
        downloaded, gets = counter.bytes_down, counter.methods["GET"]
    checkpoint = m["bytes"]["before"]
    proxy = sum(f["size"] for f in m["files"].values())
    assert m["experts"]["after"] == 8 and m["experts"]["before"] == 64
    # Neighbouring kept tensors share requests: fewer GETs than tensors in the proxy, all
    # reads of config, index, headers, routers and listings included.
    index = seaweed.client().get_object(Bucket="proxy", Key=f"{prefix}/model.safetensors.index.json")
    tensors = len(json.loads(index["Body"].read())["weight_map"])
    print(f"\ncheckpoint {checkpoint} B, proxy {proxy} B, downloaded {downloaded} B "
          f"({downloaded / proxy:.2f}x proxy, {downloaded / checkpoint:.1%} of checkpoint) in {gets} GETs "
          f"for {tensors} tensors in the proxy")
    assert gets < 0.75 * tensors, (gets, tensors)
    assert downloaded < 1.25 * proxy  # measured: 1.08x (routers read once, headers, HTTP headers)
    assert downloaded < 0.2 * checkpoint


def test_rerun_is_a_no_op_and_a_different_proxy_is_refused(seaweed, s3_ckpt, prefix):
    options = {"endpoint_url": seaweed.endpoint_url}
    dst = f"s3://proxy/{prefix}"
    first = build_proxy(s3_ckpt, dst, experts=8, store_options=options)
    client = seaweed.client()
    stamps = {o["Key"]: o["LastModified"] for o in client.list_objects_v2(Bucket="proxy", Prefix=prefix)["Contents"]}

    again = build_proxy(s3_ckpt, dst, experts=8, store_options=options)
    assert again.up_to_date is True
    assert again["files"] == first["files"]
    now = {o["Key"]: o["LastModified"] for o in client.list_objects_v2(Bucket="proxy", Prefix=prefix)["Contents"]}
    assert now == stamps  # nothing rewritten

    with pytest.raises(DestinationExists, match="--overwrite"):
        build_proxy(s3_ckpt, dst, experts=16, store_options=options)
    other = build_proxy(s3_ckpt, dst, experts=16, overwrite=True, store_options=options)
    assert other["experts"]["after"] == 16
    assert json.loads(client.get_object(Bucket="proxy", Key=f"{prefix}/{MANIFEST}")["Body"].read()) == other


def test_scale_out_workers_then_finalize_on_s3(seaweed, s3_ckpt, local_ckpt, prefix, tmp_path):
    """Two workers write their shares of the shards, then finalize checks them against the
    journals by the store's checksums, downloading none of them, and publishes."""
    dst = f"s3://proxy/{prefix}"
    local = build_proxy(str(local_ckpt), str(tmp_path / "local"), experts=8)
    with FaultProxy(int(seaweed.endpoint_url.rsplit(":", 1)[1])) as counter:
        options = {"endpoint_url": counter.endpoint_url}
        for worker in (0, 1):
            build_share(s3_ckpt, dst, experts=8, worker=worker, workers=2, store_options=options)
        before = counter.bytes_down
        m = finalize_build(s3_ckpt, dst, experts=8, workers=2, store_options=options)
        finalize_downloaded = counter.bytes_down - before
    shards = sum(f["size"] for name, f in m["files"].items() if name.endswith(".safetensors"))
    print(f"\nfinalize downloaded {finalize_downloaded} B; the shards it checked are {shards} B")
    assert finalize_downloaded < shards / 4  # headers, router rows, json files: no shard
    assert without_source_uri(m) == without_source_uri(local)
    got = tree(download(seaweed, dst, tmp_path / "back"))
    assert {n: b for n, b in got.items() if n != MANIFEST} == {
        n: b for n, b in tree(tmp_path / "local").items() if n != MANIFEST}


@pytest.mark.parametrize("where", ["local", "s3"])
def test_unfinished_writes_of_killed_attempts_are_discarded(where, seaweed, s3_ckpt, local_ckpt, prefix, tmp_path):
    """A killed attempt of another build left an unfinished write under a name this build does
    not produce (a temporary file on disk; an incomplete multipart upload in S3): finalize,
    once every shard is in, throws it away."""
    options = {"endpoint_url": seaweed.endpoint_url}
    if where == "local":
        src, dst = str(local_ckpt), tmp_path / "proxy"
        dst.mkdir()
        (dst / ".moe-proxy-tmp-killed").write_bytes(b"half a shard")
        build_proxy(src, str(dst), experts=8)
        assert not list(dst.glob(".moe-proxy-tmp-*"))
    else:
        seaweed.client().create_multipart_upload(Bucket="proxy", Key=f"{prefix}/old-name.safetensors")
        build_proxy(s3_ckpt, f"s3://proxy/{prefix}", experts=8, store_options=options)
        assert incomplete_uploads(seaweed, "proxy", prefix) == []


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moe_proxy", *args], capture_output=True, text=True, timeout=300)


def test_cli_build_inspect_verify_on_s3(seaweed, s3_ckpt, prefix):
    endpoint = ["--endpoint-url", seaweed.endpoint_url]
    r = cli("build", s3_ckpt, f"s3://proxy/{prefix}", "--experts", "8", "--no-progress", *endpoint)
    assert r.returncode == 0, r.stderr
    assert "64 -> 8" in r.stdout
    r = cli("build", s3_ckpt, f"s3://proxy/{prefix}", "--experts", "8", "--no-progress", *endpoint)
    assert r.returncode == 0 and "nothing to do" in r.stderr, r.stderr  # the rerun says so
    r = cli("inspect", s3_ckpt, *endpoint)
    assert r.returncode == 0, r.stderr
    assert "qwen3" in r.stdout.lower()
    r = cli("verify", f"s3://proxy/{prefix}", *endpoint)
    assert r.returncode == 0, r.stdout + r.stderr


def _objects(client, bucket: str, prefix: str = "") -> dict[str, str]:
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            out[o["Key"]] = hashlib.sha256(client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()).hexdigest()
    return out


@pytest.mark.parametrize("dst", ["s3://ckpt/qwen3", "s3://ckpt//qwen3/", "s3://ckpt/qwen3/proxy", "s3://ckpt",
                                 "s3://ckpt/"])
def test_an_s3_destination_overlapping_the_source_is_refused(seaweed, s3_ckpt, dst):
    client = seaweed.client()
    before = _objects(client, "ckpt")
    with pytest.raises(DestinationExists, match="source checkpoint"):
        build_proxy(s3_ckpt, dst, experts=8, overwrite=True, store_options={"endpoint_url": seaweed.endpoint_url})
    assert _objects(client, "ckpt") == before  # every source object intact, nothing added


def test_an_s3_prefix_that_is_not_a_proxy_is_refused_with_overwrite(seaweed, s3_ckpt, prefix):
    client = seaweed.client()
    client.put_object(Bucket="proxy", Key=f"{prefix}/data/train.parquet", Body=b"someone's data")
    before = _objects(client, "proxy", prefix)
    with pytest.raises(DestinationExists, match="not a moe-proxy output.*data/train.parquet"):
        build_proxy(s3_ckpt, f"s3://proxy/{prefix}", experts=8, overwrite=True,
                    store_options={"endpoint_url": seaweed.endpoint_url})
    assert _objects(client, "proxy", prefix) == before
