"""One in-flight byte budget shared by a build's reads and its multipart uploads (against a real
SeaweedFS): never exceeded, never a deadlock when it is tight, the same proxy at any setting."""

from __future__ import annotations

import os
import threading

from moe_proxy.pruning.build import build_proxy
from moe_proxy.storage import open_store
from moe_proxy.storage.inflight import MiB, Transfer

from .faultproxy import FaultProxy
from .helpers import PART


def test_uploads_of_several_files_share_the_budget(seaweed, prefix):
    """Three writers at once, each streaming 4 parts, with room for 3 parts in flight."""
    transfer = Transfer(max_inflight=3 * PART, streams=8)
    s = open_store(f"s3://proxy/{prefix}", endpoint_url=seaweed.endpoint_url, part_size=PART, transfer=transfer)
    data = os.urandom(4 * PART)

    def upload(name):
        w = s.writer(name)
        for i in range(0, len(data), 1 << 20):
            w.write(data[i : i + (1 << 20)])
        w.commit()

    threads = [threading.Thread(target=upload, args=(f"f{i}",)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(s.read_bytes(f"f{i}") == data for i in range(3))
    assert transfer.budget.peak <= 3 * PART and transfer.budget.held == 0


def test_tight_budget_builds_the_same_proxy_with_the_same_gets(seaweed, s3_ckpt, prefix):
    """56 of 64 experts kept: shards over one upload part, so reads and multipart uploads
    compete for a budget of two 5 MiB parts (reads: half of it, in 1 MiB requests)."""
    plain = build_proxy(s3_ckpt, f"s3://proxy/{prefix}-plain", experts=56,
                        store_options={"endpoint_url": seaweed.endpoint_url, "part_size": PART})
    transfer = Transfer(max_inflight=2 * PART, streams=16, read_part=1 * MiB)
    with FaultProxy(int(seaweed.endpoint_url.rsplit(":", 1)[1])) as counter:
        tight = build_proxy(s3_ckpt, f"s3://proxy/{prefix}", experts=56,
                            store_options={"endpoint_url": counter.endpoint_url, "part_size": PART,
                                           "transfer": transfer})
    assert tight["files"] == plain["files"]
    assert transfer.streams == 16 and transfer.read_part <= 1 * MiB
    assert 0 < transfer.budget.peak <= 2 * PART and transfer.budget.held == 0
    assert counter.methods["PUT"] > 2  # multipart parts went up under the budget
