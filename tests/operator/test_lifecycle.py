"""Failures, bad input, restarts, spec changes, suspension, deletion: the operator against the
emulated API (kopf for real) and SeaweedFS."""

from __future__ import annotations

import base64
import json
import logging

import kmock
import pytest

from proxymodel_operator import rbac
from proxymodel_operator.handlers import RECHECK_ANNOTATION
from proxymodel_operator.resources import JOBS, PODS, PROXYMODELS, SECRETS, VOLCANO_JOBS

from .harness import ACCESS_KEY, QWEN3, SECRET_KEY, eventually, proxymodel

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
    # The pipeline's handler is done with it (its last step would have made the Job): none.
    done = await operator.handled("pipeline", "bad")
    assert done.message.startswith("Handler 'pipeline' refused the ProxyModel: " + reason), done.message
    assert cluster.names(JOBS, NS) == []
    await eventually(lambda: _warnings(cluster, "bad", reason), what="the Warning Event")  # posted from a queue
    await operator.events_posted()  # and any other still queued
    assert len(_warnings(cluster, "bad", reason)) == 1
    assert "wrong-secret-value" not in caplog.text + json.dumps(_everything(cluster))
    # Logs never call a refused ProxyModel a success.
    assert not [r.message for r in operator.records if r.name == "bad" and "succeeded" in r.message]


def _warnings(cluster, name: str, reason: str) -> list[dict]:
    return [e for e in cluster.objects_of("events", NS) if e.get("reason") == reason
            and e["involvedObject"]["name"] == name and e["type"] == "Warning"]


def _operator_calls(cluster, resource: str, verb: str) -> int:
    return sum(1 for c in list(cluster.emulator.calls) if (c.resource, c.verb, c.by_test) == (resource, verb, False))


async def test_missing_secret_waits_and_recovers(cluster, operator):
    await cluster.create(PROXYMODELS, NS, proxymodel("w1"))
    await eventually(lambda: cluster.condition(NS, "w1", "Accepted").get("reason") == "SecretNotFound")
    assert cluster.status(NS, "w1")["phase"] == "Pending" and cluster.names(JOBS, NS) == []
    assert "does not exist" in cluster.status(NS, "w1")["message"]
    # A temporary refusal is a refusal in the log too: kopf's report of the handler says so.
    done = await operator.handled("pipeline", "w1")
    assert done.message.startswith("Handler 'pipeline' refused the ProxyModel: SecretNotFound"), done.message
    # It waits: the Secret is looked for again (the back-off), quietly.
    reads = _operator_calls(cluster, "secrets", "get")
    await eventually(lambda: _operator_calls(cluster, "secrets", "get") >= reads + 3, what="three more looks")
    await eventually(lambda: _warnings(cluster, "w1", "SecretNotFound"), what="the Warning Event")
    assert cluster.names(JOBS, NS) == [] and len(_warnings(cluster, "w1", "SecretNotFound")) == 1
    # ... and recovers once the Secret exists, without a spec edit.
    await _secret(cluster)
    await eventually(lambda: cluster.get(JOBS, NS, "w1-transform-g1"), what="the Job once the Secret exists")
    await eventually(lambda: cluster.status(NS, "w1").get("phase") == "Transforming")
    assert cluster.condition(NS, "w1", "Accepted")["status"] == "True" and "refusal" not in cluster.status(NS, "w1")
    assert len(_warnings(cluster, "w1", "SecretNotFound")) == 1
    assert cluster.get(PROXYMODELS, NS, "w1")["metadata"]["generation"] == 1  # no spec edit


async def test_secret_without_the_keys_is_one_warning_and_a_condition(cluster, operator):
    await cluster.secret(NS, "s3-creds", token="not-an-aws-key")
    await cluster.create(PROXYMODELS, NS, proxymodel("k1"))
    await eventually(lambda: cluster.condition(NS, "k1", "Accepted").get("reason") == "SecretIncomplete")
    accepted = cluster.condition(NS, "k1", "Accepted")
    assert accepted["status"] == "False" and "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in accepted["message"]
    assert cluster.status(NS, "k1")["phase"] == "Pending"
    reads = _operator_calls(cluster, "secrets", "get")
    await eventually(lambda: _operator_calls(cluster, "secrets", "get") >= reads + 3, what="three more looks")
    await eventually(lambda: _warnings(cluster, "k1", "SecretIncomplete"), what="the Warning Event")
    (warning,) = _warnings(cluster, "k1", "SecretIncomplete")
    assert "lacks AWS_ACCESS_KEY_ID" in warning["message"]
    assert not operator.found("failed temporarily", "k1")  # no error repeated in the log
    assert not [r.message for r in operator.records if r.name == "k1" and "succeeded" in r.message]
    # The keys added: judged again, accepted, built.
    await cluster.patch(SECRETS, NS, "s3-creds", {"data": {k: base64.b64encode(v.encode()).decode() for k, v in (
        ("AWS_ACCESS_KEY_ID", ACCESS_KEY), ("AWS_SECRET_ACCESS_KEY", SECRET_KEY))}})
    await eventually(lambda: cluster.get(JOBS, NS, "k1-transform-g1"), what="the Job once the keys exist")
    assert len(_warnings(cluster, "k1", "SecretIncomplete")) == 1


async def test_a_refusal_is_not_judged_again_on_restart(cluster, operator):
    """Three operator starts: one judgment, one Warning Event; a restart only compares what the
    refusal depended on (settings, Secret, the source's config.json)."""
    await _secret(cluster)
    await cluster.create(PROXYMODELS, NS, proxymodel("o1", source={"uri": "s3://ckpt/llama"}))
    await eventually(lambda: cluster.condition(NS, "o1", "Accepted").get("reason") == "NotMoE")
    refusal = cluster.status(NS, "o1")["refusal"]
    assert (refusal["reason"], refusal["generation"], refusal["temporary"]) == ("NotMoE", 1, False)
    assert set(refusal["dependencies"]) == {"settings", "secret", "source"}
    # The refusal is in status after the pipeline's first step; the creation is handled once its
    # last step returns. Stopped before that, a restart finishes the creation (reason create,
    # not resume: nothing to compare), so wait for the first operator to be done with it.
    await operator.handled("pipeline", "o1")
    for _ in range(2):
        await operator.stop()
        mark = operator.mark()
        await operator.start()
        await operator.logged("not judged again", "o1", since=mark)
        await operator.handled("pipeline", "o1", since=mark)
    await eventually(lambda: _warnings(cluster, "o1", "NotMoE"), what="the Warning Event")
    await operator.events_posted()  # and any other still queued
    assert len(_warnings(cluster, "o1", "NotMoE")) == 1
    assert len(operator.found("refused: NotMoE", "o1")) == 1  # judged once, in the first operator
    assert cluster.status(NS, "o1")["refusal"] == refusal and cluster.names(JOBS, NS) == []
    assert not [r.message for r in operator.records if r.name == "o1" and "succeeded" in r.message]


async def test_a_refusal_recovers_when_its_source_appears(cluster, operator, s3):
    """The checkpoint was not uploaded yet: once its config.json is there, it is judged again."""
    await _secret(cluster)
    uri = "s3://ckpt/later/global_step_5"
    await cluster.create(PROXYMODELS, NS, proxymodel("l1", source={"uri": uri}))
    await eventually(lambda: cluster.condition(NS, "l1", "Accepted").get("reason") == "S3NoSuchKey")
    assert cluster.status(NS, "l1")["phase"] == "Failed"
    assert cluster.status(NS, "l1")["refusal"]["dependencies"]["source"] == "absent"
    # Judged again while it is still absent (a user asked): refused for the same reason, no new Warning.
    mark = operator.mark()
    await cluster.patch(PROXYMODELS, NS, "l1", {"metadata": {"annotations": {RECHECK_ANNOTATION: "now"}}})
    await operator.logged("refused: S3NoSuchKey", "l1", since=mark)
    s3.client().put_object(Bucket="ckpt", Key="later/global_step_5/config.json", Body=json.dumps(QWEN3).encode())
    await eventually(lambda: cluster.get(JOBS, NS, "l1-transform-g1"), what="the Job once config.json exists")
    await eventually(lambda: cluster.condition(NS, "l1", "Accepted").get("status") == "True")
    await operator.events_posted()  # kopf posts Events from a queue: count them once it is empty
    assert len(_warnings(cluster, "l1", "S3NoSuchKey")) == 1
    assert cluster.get(PROXYMODELS, NS, "l1")["metadata"]["generation"] == 1


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
    mark = operator.mark()
    await operator.start()  # and once more, with everything in place
    await operator.handled("pipeline", "r1", since=mark)  # the restarted operator resumed it
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
    await operator.handled("pipeline", "s1")
    assert cluster.names(JOBS, NS) == []

    await cluster.patch_spec(PROXYMODELS, NS, "s1", {"suspend": False})
    job = await eventually(lambda: cluster.get(JOBS, NS, "s1-transform-g2"), what="Job after resuming")
    await eventually(lambda: cluster.status(NS, "s1").get("phase") == "Transforming")

    # Suspended while transforming: the proxy is recorded, but no reproduction starts ...
    await cluster.patch_spec(PROXYMODELS, NS, "s1", {"suspend": True})
    await eventually(lambda: cluster.status(NS, "s1").get("phase") == "Suspended")
    mark = operator.mark()
    await cluster.transformer_succeeds(NS, job)
    await eventually(lambda: cluster.status(NS, "s1").get("proxy"), what="proxy recorded while suspended")
    # Both the Job's and its pod's handlers are done with what they saw.
    await operator.handled("child_changed", "s1-transform-g2", since=mark)
    await operator.handled("pod_changed", "s1-transform-g2-0", since=mark)
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


async def test_every_api_call_is_in_rbac_permissions(cluster, operator, monkeypatch):
    """The chart's ClusterRole is rbac.PERMISSIONS: nothing the operator does may fall outside it,
    neither the calls it sent nor those its own client refused before sending (kube.NotListed)."""
    refused, allowed = [], rbac.allowed

    def recording(*call):
        if not allowed(*call):
            refused.append(call)
            return False
        return True

    monkeypatch.setattr(rbac, "allowed", recording)  # kube.py asks rbac.allowed before each call
    await _secret(cluster)
    await cluster.create(PROXYMODELS, NS, proxymodel("p1", reproduction={"runtime": "AscendJob"}))
    job = await eventually(lambda: cluster.get(JOBS, NS, "p1-transform-g1"))
    await cluster.transformer_succeeds(NS, job)
    await eventually(lambda: cluster.status(NS, "p1").get("phase") == "Reproducing")
    mark = operator.mark()
    await cluster.patch_spec(PROXYMODELS, NS, "p1", {"pruning": {"experts": 32}})
    await eventually(lambda: cluster.get(JOBS, NS, "p1-transform-g2"))
    await operator.handled("spec_changed/spec", "p1", since=mark)  # done replacing the children
    assert not refused, f"calls the operator's client refused: {refused}"
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
