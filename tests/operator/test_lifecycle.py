"""Failures, bad input, restarts, spec changes, suspension, deletion: the operator against the
emulated API (kopf for real) and SeaweedFS."""

from __future__ import annotations

import asyncio
import json
import logging

import kmock
import pytest

from proxymodel_operator import rbac
from proxymodel_operator.resources import JOBS, PODS, PROXYMODELS, VOLCANO_JOBS

from .harness import ACCESS_KEY, SECRET_KEY, eventually, proxymodel

NS = "team-b"


async def _secret(cluster, name: str = "s3-creds", key: str = ACCESS_KEY, secret: str = SECRET_KEY) -> None:
    await cluster.secret(NS, name, AWS_ACCESS_KEY_ID=key, AWS_SECRET_ACCESS_KEY=secret)


async def _failed_with(cluster, name: str, reason: str) -> dict:
    await eventually(lambda: cluster.status(NS, name).get("phase") == "Failed", what=f"{name} Failed")
    status = cluster.status(NS, name)
    assert reason in status["message"], status
    return status


@pytest.mark.parametrize("how, reason", [
    ("oom", "OOMKilled"),
    ("backoff", "BackoffLimitExceeded"),
    ("deadline", "DeadlineExceeded"),
    ("image", "ImagePullBackOff"),
    ("report", "S3AccessDenied"),
])
async def test_transformer_failures_carry_the_real_reason(cluster, operator, how, reason):
    await _secret(cluster)
    await cluster.create(PROXYMODELS, NS, proxymodel("f1"))
    job = await eventually(lambda: cluster.get(JOBS, NS, "f1-transform-g1"))
    if how == "oom":  # the Job only says BackoffLimitExceeded; the pod says why
        await cluster.finish_pod(NS, job, "transformer", 137, reason="OOMKilled")
        await cluster.job_condition(NS, "f1-transform-g1", "Failed", "BackoffLimitExceeded")
    elif how == "backoff":
        await cluster.finish_pod(NS, job, "transformer", 1)
        await cluster.job_condition(NS, "f1-transform-g1", "Failed", "BackoffLimitExceeded")
    elif how == "deadline":
        await cluster.job_condition(NS, "f1-transform-g1", "Failed", "DeadlineExceeded")
    elif how == "image":  # the Job never fails by itself: the pod waits forever
        await cluster.waiting_pod(NS, job, "transformer", "ImagePullBackOff")
    else:  # the transformer's own report in its termination message
        await cluster.finish_pod(NS, job, "transformer", 2, json.dumps(
            {"error": "S3AccessDenied", "message": "s3://ckpt/qwen3-moe: access denied for get_object"}))
        await cluster.job_condition(NS, "f1-transform-g1", "Failed", "PodFailurePolicy")
    await _failed_with(cluster, "f1", reason)
    ready = cluster.condition(NS, "f1", "ProxyReady")
    assert (ready["status"], ready["reason"]) == ("False", reason)
    assert cluster.names(JOBS, NS) == ["f1-transform-g1"]  # no reproduction after a failure


async def test_unschedulable_pod_is_reported_not_failed(cluster, operator):
    await _secret(cluster)
    await cluster.create(PROXYMODELS, NS, proxymodel("u1"))
    job = await eventually(lambda: cluster.get(JOBS, NS, "u1-transform-g1"))
    await cluster.create(PODS, NS, {
        "metadata": {"name": "u1-pod", "labels": job["spec"]["template"]["metadata"]["labels"]},
        "spec": {"containers": [{"name": "transformer", "image": "x"}]},
        "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False",
                                                        "reason": "Unschedulable",
                                                        "message": "0/3 nodes are available: 3 Insufficient memory."}]}})
    await eventually(lambda: cluster.condition(NS, "u1", "ProxyReady").get("reason") == "Unschedulable")
    assert "Insufficient memory" in cluster.condition(NS, "u1", "ProxyReady")["message"]
    assert cluster.status(NS, "u1")["phase"] == "Transforming"
    await eventually(lambda: any(e["reason"] == "Unschedulable" and e["type"] == "Warning"
                                 for e in cluster.objects_of("events", NS)), what="Unschedulable Event")


async def test_reproduction_failure_and_unschedulable_gang(cluster, operator):
    await _secret(cluster)
    await cluster.create(PROXYMODELS, NS, proxymodel("f2", reproduction={"runtime": "VolcanoJob"}))
    job = await eventually(lambda: cluster.get(JOBS, NS, "f2-transform-g1"))
    await cluster.transformer_succeeds(NS, job)
    await eventually(lambda: cluster.get(VOLCANO_JOBS, NS, "f2-repro-g1"))
    # The gang waits: a reason in the condition, not a failure.
    await cluster.patch(VOLCANO_JOBS, NS, "f2-repro-g1", {"status": {"state": {
        "phase": "Pending", "reason": "Unschedulable", "message": "gang unschedulable: 0/2 nodes have 8 NPUs"}}})
    await eventually(lambda: cluster.condition(NS, "f2", "FailureReproduced").get("reason") == "Unschedulable")
    assert cluster.status(NS, "f2")["phase"] == "Reproducing"
    await cluster.patch(VOLCANO_JOBS, NS, "f2-repro-g1", {"status": {"state": {"phase": "Aborted", "reason": ""}}})
    await _failed_with(cluster, "f2", "VolcanoJobAborted")


@pytest.mark.parametrize("change, reason, detail", [
    ({"pruning": {"experts": 200}}, "InvalidExpertCount", "128 routed experts"),
    ({"source": {"uri": "s3://ckpt/llama", "credentialsSecret": "s3-creds"}}, "NotMoE", "not a mixture-of-experts"),
    ({"source": {"uri": "s3://ckpt/missing", "credentialsSecret": "s3-creds"}}, "S3NoSuchKey", "does not exist"),
    ({"source": {"uri": "s3://ckpt/broken", "credentialsSecret": "s3-creds"}}, "CorruptCheckpoint", "not valid JSON"),
    ({"source": {"uri": "s3://ckpt/qwen3-moe/global_step_100", "credentialsSecret": "bad-creds"}},
     "S3AccessDenied", "access denied"),
    ({"destination": {"uri": "s3://ckpt/qwen3-moe/global_step_100/proxy"}}, "InvalidSpec", "overlaps the source"),
    ({"reproduction": {"accelerator": {"devices": 12, "devicesPerNode": 8}}}, "InvalidSpec", "whole nodes"),
])
async def test_bad_input_is_refused_before_any_job(cluster, operator, caplog, change, reason, detail):
    caplog.set_level(logging.DEBUG)
    await _secret(cluster)
    await _secret(cluster, "bad-creds", secret="wrong-secret-value-123456")
    await cluster.create(PROXYMODELS, NS, proxymodel("bad", **change))
    await eventually(lambda: cluster.condition(NS, "bad", "Accepted").get("status") == "False", what="refusal")
    accepted = cluster.condition(NS, "bad", "Accepted")
    assert accepted["reason"] == reason and detail in accepted["message"], accepted
    assert cluster.status(NS, "bad")["phase"] == "Failed"
    await asyncio.sleep(0.5)
    assert cluster.names(JOBS, NS) == []
    events = [e for e in cluster.objects_of("events", NS) if e.get("reason") == reason]
    assert events and events[0]["type"] == "Warning" and events[0]["involvedObject"]["name"] == "bad"
    assert "wrong-secret-value" not in caplog.text + json.dumps(_everything(cluster))


async def test_missing_secret_waits_and_recovers(cluster, operator):
    await cluster.create(PROXYMODELS, NS, proxymodel("w1"))
    await eventually(lambda: cluster.condition(NS, "w1", "Accepted").get("reason") == "SecretNotFound")
    assert cluster.status(NS, "w1")["phase"] == "Pending" and cluster.names(JOBS, NS) == []


async def test_restart_mid_pipeline_makes_no_duplicate(cluster, operator):
    await _secret(cluster)
    await cluster.create(PROXYMODELS, NS, proxymodel("r1"))
    job = await eventually(lambda: cluster.get(JOBS, NS, "r1-transform-g1"))
    await eventually(lambda: cluster.status(NS, "r1").get("phase") == "Transforming")
    await operator.stop()
    # While the operator is down, the transformer finishes.
    await cluster.transformer_succeeds(NS, job)
    posts_before = _job_posts(cluster)
    await operator.start()
    await eventually(lambda: cluster.get(JOBS, NS, "r1-repro-g1"), what="reproduction after restart")
    await operator.stop()
    await operator.start()  # and once more, with everything in place
    await asyncio.sleep(1.5)
    assert cluster.names(JOBS, NS) == ["r1-repro-g1", "r1-transform-g1"]
    assert _job_posts(cluster) - posts_before == 1  # only the reproduction Job was created
    assert cluster.status(NS, "r1")["phase"] == "Reproducing"


async def test_restart_creates_a_recorded_child_that_is_missing(cluster, operator):
    """Status records a child before creating it: a restart in between creates it then."""
    await _secret(cluster)
    await cluster.create(PROXYMODELS, NS, proxymodel("m1"))
    await eventually(lambda: cluster.get(JOBS, NS, "m1-transform-g1"))
    await eventually(lambda: cluster.status(NS, "m1").get("phase") == "Transforming")
    await operator.stop()
    await cluster.delete(JOBS, NS, "m1-transform-g1")  # as if the operator had stopped before creating it
    await operator.start()
    job = await eventually(lambda: cluster.get(JOBS, NS, "m1-transform-g1"), what="the recorded Job, created")
    await cluster.transformer_succeeds(NS, job)
    await eventually(lambda: cluster.get(JOBS, NS, "m1-repro-g1"))
    await operator.stop()
    await cluster.delete(JOBS, NS, "m1-repro-g1")
    await operator.start()
    await eventually(lambda: cluster.get(JOBS, NS, "m1-repro-g1"), what="the recorded reproduction, created")


async def test_spec_change_replaces_children(cluster, operator):
    await _secret(cluster)
    await cluster.create(PROXYMODELS, NS, proxymodel("c1"))
    job = await eventually(lambda: cluster.get(JOBS, NS, "c1-transform-g1"))
    await cluster.transformer_succeeds(NS, job)
    await eventually(lambda: cluster.get(JOBS, NS, "c1-repro-g1"))

    await cluster.patch_spec(PROXYMODELS, NS, "c1", {"pruning": {"experts": 32}})
    new = await eventually(lambda: cluster.get(JOBS, NS, "c1-transform-g2"), what="new generation's Job")
    await eventually(lambda: cluster.names(JOBS, NS) == ["c1-transform-g2"], what="old children gone")
    args = new["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--experts") + 1] == "32"
    await eventually(lambda: cluster.status(NS, "c1").get("phase") == "Transforming")
    status = cluster.status(NS, "c1")
    assert status["experts"] == "128->32" and "proxy" not in status and status["pipeline"]["generation"] == 2
    assert status["observedGeneration"] == 2


async def test_suspend_creates_nothing_new(cluster, operator):
    await _secret(cluster)
    await cluster.create(PROXYMODELS, NS, proxymodel("s1", suspend=True))
    await eventually(lambda: cluster.status(NS, "s1").get("phase") == "Suspended")
    await asyncio.sleep(0.5)
    assert cluster.names(JOBS, NS) == []

    await cluster.patch_spec(PROXYMODELS, NS, "s1", {"suspend": False})
    job = await eventually(lambda: cluster.get(JOBS, NS, "s1-transform-g2"), what="Job after resuming")
    await eventually(lambda: cluster.status(NS, "s1").get("phase") == "Transforming")

    # Suspended while transforming: the proxy is recorded, but no reproduction starts ...
    await cluster.patch_spec(PROXYMODELS, NS, "s1", {"suspend": True})
    await eventually(lambda: cluster.status(NS, "s1").get("phase") == "Suspended")
    await cluster.transformer_succeeds(NS, job)
    await eventually(lambda: cluster.status(NS, "s1").get("proxy"), what="proxy recorded while suspended")
    await asyncio.sleep(0.5)
    assert cluster.names(JOBS, NS) == ["s1-transform-g2"] and cluster.status(NS, "s1")["phase"] == "Suspended"
    # ... until it is resumed, with the same children (suspend alone is no new spec).
    await cluster.patch_spec(PROXYMODELS, NS, "s1", {"suspend": False})
    await eventually(lambda: cluster.get(JOBS, NS, "s1-repro-g2"), what="reproduction after resuming")
    assert cluster.names(JOBS, NS) == ["s1-repro-g2", "s1-transform-g2"]


async def test_deletion_cleans_the_proxy_only_when_asked(cluster, operator, s3):
    await _secret(cluster)
    client = s3.client()
    dest = "proxies/d2/"
    client.put_object(Bucket="ckpt", Key=f"{dest}proxy-manifest.json", Body=b"{}")
    await cluster.create(PROXYMODELS, NS, proxymodel("d1"))
    await cluster.create(PROXYMODELS, NS, proxymodel("d2", destination={"uri": f"s3://ckpt/{dest}"},
                                                     cleanup={"deleteProxy": True}))
    await eventually(lambda: cluster.get(JOBS, NS, "d2-transform-g1") and cluster.get(JOBS, NS, "d1-transform-g1"))
    finalizers = lambda n: (cluster.get(PROXYMODELS, NS, n) or {}).get("metadata", {}).get("finalizers") or []  # noqa: E731
    assert finalizers("d2") and not finalizers("d1")
    await cluster.delete(PROXYMODELS, NS, "d1")
    await cluster.delete(PROXYMODELS, NS, "d2")
    await eventually(lambda: cluster.get(PROXYMODELS, NS, "d2") is None, what="d2 released")
    assert cluster.get(PROXYMODELS, NS, "d1") is None
    assert client.list_objects_v2(Bucket="ckpt", Prefix=dest).get("KeyCount") == 0


async def test_every_api_call_is_in_rbac_permissions(cluster, operator):
    """The chart's ClusterRole is rbac.PERMISSIONS: nothing the operator does may fall outside it."""
    await _secret(cluster)
    await cluster.create(PROXYMODELS, NS, proxymodel("p1", reproduction={"runtime": "AscendJob"}))
    job = await eventually(lambda: cluster.get(JOBS, NS, "p1-transform-g1"))
    await cluster.transformer_succeeds(NS, job)
    await eventually(lambda: cluster.status(NS, "p1").get("phase") == "Reproducing")
    await cluster.patch_spec(PROXYMODELS, NS, "p1", {"pruning": {"experts": 32}})
    await eventually(lambda: cluster.get(JOBS, NS, "p1-transform-g2"))
    await asyncio.sleep(0.5)
    seen = {(c.group, c.resource, c.verb) for c in cluster.emulator.calls if not c.by_test}
    missing = [s for s in seen if not rbac.allowed(*s)]
    assert not missing, f"calls outside rbac.PERMISSIONS: {missing}"
    assert ("batch", "jobs", "create") in seen and ("moeproxy.io", "proxymodels/status", "patch") in seen
    assert ("mindxdl.gitee.com", "ascendjobs", "create") in seen and ("", "secrets", "get") in seen
    assert ("", "events", "create") in seen
    # Children and their pods are watched with a server-side selector, never cluster-wide in full.
    watches = {(c.group, c.resource): c.label_selector for c in cluster.emulator.calls
               if c.verb == "watch" and not c.by_test}
    for key in (("", "pods"), ("batch", "jobs"), ("batch.volcano.sh", "jobs"), ("mindxdl.gitee.com", "ascendjobs")):
        assert watches[key] == "moeproxy.io/proxymodel,moeproxy.io/role", (key, watches)


def _everything(cluster) -> list[dict]:
    return [dict(obj.raw) for obj in list(cluster.emulator.objects.values()) if not obj.deleted
            if obj.raw.get("kind") != "Secret"]


def _job_posts(cluster) -> int:
    return sum(1 for c in cluster.emulator.calls if (c.group, c.resource, c.verb, c.by_test) == ("batch", "jobs", "create", False))


async def test_a_refused_reproduction_create_fails_visibly(cluster, operator):
    # The API server refuses Volcano Jobs here (say, an admission webhook or a quota).
    cluster.emulator[kmock.action.CREATE, kmock.resource("batch.volcano.sh/v1alpha1/jobs")] << 403
    await _secret(cluster)
    await cluster.create(PROXYMODELS, NS, proxymodel("v1", reproduction={"runtime": "VolcanoJob"}))
    job = await eventually(lambda: cluster.get(JOBS, NS, "v1-transform-g1"))
    await cluster.transformer_succeeds(NS, job)
    await _failed_with(cluster, "v1", "CreateFailed")
    failed = cluster.condition(NS, "v1", "FailureReproduced")
    assert failed["status"] == "False" and "403" in failed["message"]
    assert cluster.status(NS, "v1")["proxy"]["uri"]  # the proxy itself is kept in status


async def test_without_preflight_devices_must_be_given(cluster, operator, monkeypatch):
    await operator.stop()
    monkeypatch.setenv("MOEPROXY_PREFLIGHT", "false")
    await operator.start()
    await cluster.create(PROXYMODELS, NS, proxymodel("n1"))  # devices: auto
    await eventually(lambda: cluster.condition(NS, "n1", "Accepted").get("status") == "False")
    assert "needs the preflight read" in cluster.condition(NS, "n1", "Accepted")["message"]
    await cluster.create(PROXYMODELS, NS, proxymodel("n2", reproduction={"accelerator": {"devices": 8}}))
    job = await eventually(lambda: cluster.get(JOBS, NS, "n2-transform-g1"))
    assert "plan" not in cluster.status(NS, "n2") and cluster.names(JOBS, NS) == ["n2-transform-g1"]
    await cluster.transformer_succeeds(NS, job)
    repro = await eventually(lambda: cluster.get(JOBS, NS, "n2-repro-g1"))
    assert repro["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["huawei.com/Ascend910"] == 8
