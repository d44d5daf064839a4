"""200 ProxyModels applied at once: every one reaches its transformer Job, exactly once."""

from __future__ import annotations

import asyncio
import time

from proxymodel_operator.resources import JOBS, PROXYMODELS

from .harness import ACCESS_KEY, SECRET_KEY, eventually, proxymodel

NS = "load"
COUNT = 200


async def test_200_proxymodels_all_reach_their_first_job(cluster, operator):
    await cluster.secret(NS, "s3-creds", AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    started = time.monotonic()
    await asyncio.gather(*(cluster.create(PROXYMODELS, NS, proxymodel(f"pm-{i:03d}")) for i in range(COUNT)))
    expected = [f"pm-{i:03d}-transform-g1" for i in range(COUNT)]
    await eventually(lambda: cluster.names(JOBS, NS) == expected, timeout=150,
                     what=lambda: f"{COUNT} transformer Jobs ({len(cluster.names(JOBS, NS))} so far)")
    transforming = lambda: sum(cluster.status(NS, f"pm-{i:03d}").get("phase") == "Transforming"  # noqa: E731
                               for i in range(COUNT))
    await eventually(lambda: transforming() == COUNT, timeout=60,
                     what=lambda: f"every ProxyModel Transforming ({transforming()} so far)")
    elapsed = time.monotonic() - started
    posts = sum(1 for c in cluster.emulator.calls if (c.group, c.resource, c.verb, c.by_test) == ("batch", "jobs", "create", False))
    assert posts == COUNT  # no Job was posted twice
    print(f"\n{COUNT} ProxyModels -> {COUNT} transformer Jobs in {elapsed:.1f}s")
