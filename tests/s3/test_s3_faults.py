"""Builds survive a bad network (drops, delays, 500s between client and server) and resume
after being killed mid-upload, without re-uploading what was complete."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from moe_proxy.pruning.build import build_proxy
from moe_proxy.pruning.shares import journal_name
from moe_proxy.checkpoint.reader import MANIFEST
from .faultproxy import FaultProxy
from .helpers import PART, download, incomplete_uploads, tree

KEEP = 56  # of 64: output shards of ~5.9 MB, two 5 MiB-part multipart uploads each


@pytest.fixture(scope="module")
def local_proxy(local_ckpt, tmp_path_factory):
    """The reference: the same build, local to local."""
    out = tmp_path_factory.mktemp("local") / "proxy"
    build_proxy(str(local_ckpt), str(out), experts=KEEP)
    return out


def same_files(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        if name != MANIFEST:
            assert got[name] == want[name], name


def journaled(client, prefix: str) -> dict:
    """The files the build's journal records as complete (none while there is no journal)."""
    try:
        body = client.get_object(Bucket="proxy", Key=f"{prefix}/{journal_name(0, 1)}")["Body"].read()
    except client.exceptions.NoSuchKey:
        return {}
    return json.loads(body).get("files", {})


def server_port(seaweed) -> int:
    return int(seaweed.endpoint_url.rsplit(":", 1)[1])


def test_build_through_drops_delays_and_500s(seaweed, s3_ckpt, local_proxy, prefix, tmp_path):
    faults = {"drop": 0.08, "delay": 0.04, "500": 0.08}
    # Half the delays outlast the 2 s read timeout: the client gives up and retries.
    with FaultProxy(server_port(seaweed), faults, seed=6, delay=(1.0, 3.0)) as net:
        options = {"endpoint_url": net.endpoint_url, "part_size": PART, "read_timeout": 2.0}
        m = build_proxy(s3_ckpt, f"s3://proxy/{prefix}", experts=KEEP, store_options=options)
        fates = dict(net.fates)
    print(f"\nconnections by fate: {fates}")
    assert all(fates.get(f, 0) >= 2 for f in faults), fates  # every kind of fault really happened
    assert m["experts"]["after"] == KEEP
    same_files(tree(download(seaweed, f"s3://proxy/{prefix}", tmp_path / "got")), tree(local_proxy))
    assert incomplete_uploads(seaweed, "proxy", prefix) == []


def test_killed_build_resumes_without_reuploading(seaweed, s3_ckpt, local_proxy, prefix, tmp_path, caplog):
    dst = f"s3://proxy/{prefix}"
    shards = sorted(f for f in os.listdir(local_proxy) if f.endswith(".safetensors"))
    first = (local_proxy / shards[0]).stat().st_size
    with FaultProxy(server_port(seaweed)) as net:
        # Freeze the part uploads once the first shard and one part of the second have gone
        # up, then kill the build like an evicted pod (SIGKILL: no cleanup runs). Uploads
        # overlap by one shard, so the second's first part may go up before the first is
        # committed: wait for the journal to list the first shard (written after its commit;
        # the journal exists, empty, from the start).
        net.stall_after_up = first + PART + (256 << 10)
        options = {"endpoint_url": net.endpoint_url, "part_size": PART}
        code = f"from moe_proxy.pruning.build import build_proxy; build_proxy({s3_ckpt!r}, {dst!r}, experts={KEEP}, store_options={options!r})"
        proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        client = seaweed.client()
        while not (net.bytes_up >= first + PART and incomplete_uploads(seaweed, "proxy", prefix)
                   and shards[0] in journaled(client, prefix)):
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "the build never got to its second shard"
            time.sleep(0.1)
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    client = seaweed.client()
    names = [o["Key"].split("/", 1)[1] for o in client.list_objects_v2(Bucket="proxy", Prefix=prefix)["Contents"]]
    assert MANIFEST not in names  # the leftovers do not look like a proxy
    assert shards[0] in names and shards[1] not in names and journal_name(0, 1) in names
    assert len(incomplete_uploads(seaweed, "proxy", prefix)) == 1

    with FaultProxy(server_port(seaweed)) as net, caplog.at_level(logging.INFO):
        m = build_proxy(s3_ckpt, dst, experts=KEEP, store_options={"endpoint_url": net.endpoint_url, "part_size": PART})
        uploaded, downloaded = net.bytes_up, net.bytes_down
    second = (local_proxy / shards[1]).stat().st_size
    print(f"\nresume: uploaded {uploaded} B (first shard {first} B kept, second {second} B), downloaded {downloaded} B")
    assert f"{shards[0]}: already complete" in caplog.text
    assert uploaded < second + first // 2  # the first shard did not go up again
    assert downloaded < second + first // 2  # ... nor was it read again, nor downloaded to re-hash it
    assert m["files"][shards[0]]["size"] == first
    same_files(tree(download(seaweed, dst, tmp_path / "got")), tree(local_proxy))
    assert incomplete_uploads(seaweed, "proxy", prefix) == []  # the dead attempt's upload was aborted
