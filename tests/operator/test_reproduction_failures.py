"""A multi-node reproduction that cannot start or that breaks, through kopf and the API emulator:

- the API server refuses the headless Service the pods' host names need: the workload is not
  created (its pods could not find each other), the condition says why with one Warning Event,
  and the back-off tries again until the Service is there, then creates the workload;
- a pod fails (a collective timeout, an OOM on one node): the workload fails once, the reason
  reaches the status, and nothing the pods or the workload do afterwards gives a second verdict.
"""

from __future__ import annotations

import json

import aiohttp
import kmock
import pytest

from proxymodel_operator.resources import JOBS, PROXYMODELS, SERVICES

from .harness import ACCESS_KEY, SECRET_KEY, eventually, proxymodel

NS = "team-f"
TWO_NODES = {"runtime": "Job", "accelerator": {"devices": 4, "devicesPerNode": 2}}


async def _reproduction(cluster, name: str) -> dict:
    """The ProxyModel `name` on two nodes, its proxy built: the reproduction Job's turn."""
    await cluster.secret(NS, "s3-creds", AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    await cluster.create(PROXYMODELS, NS, proxymodel(name, reproduction=TWO_NODES))
    transformer = await eventually(lambda: cluster.get(JOBS, NS, f"{name}-transform-g1"), what="transformer Job")
    await cluster.transformer_succeeds(NS, transformer)


def _events(cluster, reason: str) -> list[dict]:
    return [e for e in cluster.objects_of("events", NS) if e.get("reason") == reason]


def _creates(cluster, group: str, resource: str) -> int:
    return sum(1 for c in cluster.emulator.calls if (c.group, c.resource, c.verb, c.by_test) ==
               (group, resource, "create", False))


async def test_a_refused_headless_service_holds_the_workload_back_and_is_tried_again(cluster, operator):
    handle, refusing, refused = cluster.emulator._handle, [True], []

    async def refuse(request):  # a quota or an admission policy on Services, until it is lifted
        if refusing[0] and request.action == kmock.action.CREATE and not request.headers.get("X-Test-Client") \
                and request.resource == kmock.resource("v1/services"):
            refused.append(request.name)
            return aiohttp.web.json_response(status=403, data={
                "kind": "Status", "status": "Failure", "reason": "Forbidden", "code": 403,
                "message": 'services "h1-repro-g1" is forbidden: exceeded quota: services=0'})
        return await handle(request)

    object.__setattr__(cluster.emulator, "_handle", refuse)
    await _reproduction(cluster, "h1")
    await eventually(lambda: cluster.condition(NS, "h1", "FailureReproduced").get("reason") == "CreateRefused",
                     what="the refusal in the condition")
    waiting = cluster.condition(NS, "h1", "FailureReproduced")
    assert waiting["status"] == "Unknown" and "Service h1-repro-g1" in waiting["message"]
    assert "403" in waiting["message"]
    status = cluster.status(NS, "h1")
    assert status["phase"] == "Reproducing" and "exceeded quota" in status["message"]
    assert status["pipeline"]["reproductionJob"] == "h1-repro-g1"  # recorded: the back-off creates it

    await eventually(lambda: len(refused) >= 3, what="the back-off trying the Service again")
    assert cluster.get(JOBS, NS, "h1-repro-g1") is None and _creates(cluster, "batch", "jobs") == 1  # the transformer
    await eventually(lambda: len(_events(cluster, "CreateRefused")) == 1, what="the Warning Event")
    assert _events(cluster, "CreateRefused")[0]["type"] == "Warning"

    refusing[0] = False  # the quota raised
    job = await eventually(lambda: cluster.get(JOBS, NS, "h1-repro-g1"), what="the Job, once its Service is there")
    assert cluster.get(SERVICES, NS, "h1-repro-g1")["spec"]["clusterIP"] == "None"
    assert job["spec"]["template"]["spec"]["subdomain"] == "h1-repro-g1"
    await eventually(lambda: cluster.condition(NS, "h1", "FailureReproduced").get("reason") == "ReproductionRunning",
                     what="the condition back to running")
    assert cluster.status(NS, "h1").get("message") is None
    await eventually(lambda: _events(cluster, "ReproductionCreated"), what="the ReproductionCreated Event")
    assert len(_events(cluster, "CreateRefused")) == 1 and len(_events(cluster, "ReproductionCreated")) == 1


RANK_FAILED = {"error": "RankFailed", "message": "rank 2 (local rank 0) failed: collective operation timed out "
                                                 "after 600 s (gloo allreduce); the run was ended on every node"}


@pytest.mark.parametrize("node0, node1, reason, detail", [
    # rank 2 (node 1) hangs: node 0's run ends with the error naming the rank; node 1 is ended too
    ((1, "Error", RANK_FAILED), (1, "Error", None), "RankFailed", "collective operation timed out"),
    # node 1 is OOM-killed; node 0 loses its peer and ends without a message of its own
    ((1, "Error", None), (137, "OOMKilled", None), "OOMKilled", "exited with code 137"),
], ids=["collective-timeout", "oom-on-one-node"])
async def test_a_failed_pod_fails_the_multi_node_run_once(cluster, operator, node0, node1, reason, detail):
    await _reproduction(cluster, "k1")
    job = await eventually(lambda: cluster.get(JOBS, NS, "k1-repro-g1"), what="the reproduction Job")
    for index, (code, why, report) in enumerate((node0, node1)):
        await cluster.finish_pod(NS, job, "reproduction", code, json.dumps(report) if report else "", reason=why,
                                 index=index)
    await cluster.job_condition(NS, "k1-repro-g1", "Failed", "BackoffLimitExceeded")

    await eventually(lambda: cluster.status(NS, "k1").get("phase") == "Failed", what="k1 Failed")
    failed = cluster.condition(NS, "k1", "FailureReproduced")
    assert (failed["status"], failed["reason"]) == ("False", reason) and detail in failed["message"]
    assert cluster.status(NS, "k1")["message"].startswith(f"reproduction failed: {reason}")
    await eventually(lambda: len(_events(cluster, reason)) == 1, what=f"the {reason} Event")

    # What follows cannot judge it again: a pod retried by the Job controller that writes a
    # verdict, and the Job's status written once more.
    mark = operator.mark()
    late = {"reproduced": True, "signature": "nan", "step": 1}
    await cluster.finish_pod(NS, job, "reproduction", 0, json.dumps(late), index=2)
    await cluster.job_condition(NS, "k1-repro-g1", "Failed", "BackoffLimitExceeded")
    await operator.handled("pod_changed", "k1-repro-g1-2", since=mark)
    await operator.handled("child_changed", "k1-repro-g1", since=mark)
    status = cluster.status(NS, "k1")
    assert status["phase"] == "Failed" and not status.get("reproduction")
    assert cluster.condition(NS, "k1", "FailureReproduced")["reason"] == reason
    assert len(_events(cluster, reason)) == 1 and not _events(cluster, "NaN")
