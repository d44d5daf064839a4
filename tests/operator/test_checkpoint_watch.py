"""CheckpointWatch end to end: kopf for real against the emulated API, a training run's
checkpoints on SeaweedFS, and the ProxyModel pipeline running on what the watch makes.

Each test writes a run under its own prefix (verl layout: global_step_<N>/actor/huggingface),
applies a watch, and plays the training job (uploading checkpoints) and the Job controller.
The emulator does not apply the CRD's schema, so the watches here poll every second
(`pollInterval: 1`), which the real API server refuses (minimum 30): time runs faster here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import uuid

import aiohttp
import kmock
import kopf
import pytest

from proxymodel_operator import checkpoint_watch, rbac
from proxymodel_operator.checkpoint_watch import CHECKPOINT_WATCHES
from proxymodel_operator.resources import JOBS, PROXYMODELS, SECRETS

from ..checkpoints import synthetic
from .harness import ACCESS_KEY, BUCKET, QWEN3, SECRET_KEY, TRANSFORMER_REPORT, eventually

TICK = 0.25  # the watches' timer wakes this often here (30 s in a cluster)

NS = "rl-team"
HF = "actor/huggingface"
SHARD2 = "model-00002-of-00002.safetensors"
WATCH_EVENT_TIMEOUT = 20.0


@pytest.fixture(autouse=True)
def _checkpointwatches_served(checkpointwatch_resource):
    """Every test here: the emulator serves CheckpointWatches (conftest)."""


@pytest.fixture
def registry(registry: kopf.OperatorRegistry) -> kopf.OperatorRegistry:
    """This module's operators serve CheckpointWatches too (MOEPROXY_CHECKPOINT_WATCH=true), in
    the test's own registry: other tests' operators never run the watch's timer."""
    checkpoint_watch.register(TICK, registry)
    (timer,) = [h for h in registry._spawning.get_all_handlers() if h.id == "poll"]
    assert timer.interval == TICK
    return registry


@pytest.fixture
def run(s3) -> "Run":
    return Run(s3, f"runs/{uuid.uuid4().hex[:8]}")


class Run:
    """A training run writing checkpoints under s3://ckpt/<prefix>."""

    def __init__(self, s3, prefix: str):
        self.client, self.prefix = s3.client(), prefix
        self.uri = f"s3://{BUCKET}/{prefix}"
        self.files = synthetic.files(QWEN3, shapes=synthetic.QWEN3_TINY)  # Qwen3-30B-A3B's config.json

    def save(self, step: int, without: tuple[str, ...] = (), config: dict | None = None) -> None:
        content = synthetic.files(config) if config else self.files
        content = {k: v for k, v in content.items() if k not in without}
        synthetic.upload(self.client, BUCKET, f"{self.prefix}/global_step_{step}/{HF}", content)

    def checkpoint(self, step: int) -> str:
        return f"{self.uri}/global_step_{step}/{HF}"


def checkpoint_watch_manifest(name: str, run: Run, **spec) -> dict:
    body = {
        "source": {"uri": run.uri, "credentialsSecret": "s3-creds", "region": "us-east-1"},
        "pattern": "global_step_*/actor/huggingface",
        "pollInterval": 1,
        "template": {"metadata": {"labels": {"team": "rl"}},
                     "spec": {"pruning": {"experts": 16, "seed": 7}, "reproduction": {"enabled": False}}},
    }
    body.update(spec)
    return {"metadata": {"name": name}, "spec": body}


async def secret(cluster, name: str = "s3-creds", secret_key: str = SECRET_KEY) -> None:
    await cluster.secret(NS, name, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=secret_key)


def watch_status(cluster, name: str) -> dict:
    return (cluster.get(CHECKPOINT_WATCHES, NS, name) or {}).get("status") or {}


def watch_condition(cluster, name: str, kind: str) -> dict:
    return next((c for c in watch_status(cluster, name).get("conditions") or [] if c["type"] == kind), {})


def proxymodels(cluster) -> list[str]:
    return cluster.names(PROXYMODELS, NS)


def events(cluster, reason: str | None = None) -> list[dict]:
    out = [dict(o.raw) for (res, _, _), o in list(cluster.emulator.objects.items())
           if res.plural == "events" and not o.deleted]
    return [e for e in out if reason is None or e.get("reason") == reason]


def proxymodel_posts(cluster) -> int:
    """ProxyModels the operator (not the test) asked to create."""
    return sum(1 for c in list(cluster.emulator.calls)
               if (c.group, c.resource, c.verb) == ("moeproxy.io", "proxymodels", "create") and not c.by_test)


async def polls(cluster, name: str, count: int = 3) -> None:
    """Wait until the watch has listed the prefix `count` more times."""
    for _ in range(count):
        before = watch_status(cluster, name).get("lastPollTime")
        await asyncio.sleep(1.0)
        await eventually(lambda: watch_status(cluster, name).get("lastPollTime") != before, timeout=10,
                         what="another poll")


async def finish_transformer(cluster, pxm: str) -> None:
    """The transformer Job of `pxm` succeeds (the Job controller and kubelet's part)."""
    job = await eventually(lambda: cluster.get(JOBS, NS, f"{pxm}-transform-g1"), what=f"{pxm}'s transformer Job")
    await cluster.finish_pod(NS, job, "transformer", 0, json.dumps(TRANSFORMER_REPORT))
    await cluster.job_condition(NS, f"{pxm}-transform-g1", "Complete")


# --- the tests ------------------------------------------------------------------------------------------


async def test_a_proxymodel_for_each_complete_checkpoint(cluster, operator, run):
    run.save(100)
    run.save(200)
    run.save(300, without=(SHARD2,))  # still uploading
    await secret(cluster)
    await cluster.create(CHECKPOINT_WATCHES, NS, checkpoint_watch_manifest("grpo", run))

    await eventually(lambda: proxymodels(cluster) == ["grpo-step-100", "grpo-step-200"], what="two ProxyModels")
    await eventually(lambda: watch_status(cluster, "grpo").get("waiting"), what="step 300 waiting")
    status = watch_status(cluster, "grpo")
    assert status["lastSeenStep"] == 200 and status["proxies"] == 2
    assert status["waiting"][0]["step"] == 300 and SHARD2 in status["waiting"][0]["reason"]
    assert watch_condition(cluster, "grpo", "SourceReachable")["reason"] == "Listed"

    # What the watch made: the template, its checkpoint as source, labels, owned by the watch.
    watch = cluster.get(CHECKPOINT_WATCHES, NS, "grpo")
    pxm = cluster.get(PROXYMODELS, NS, "grpo-step-200")
    assert pxm["spec"]["source"] == {"uri": run.checkpoint(200), "region": "us-east-1",
                                     "credentialsSecret": "s3-creds"}
    assert pxm["spec"]["pruning"] == {"experts": 16, "seed": 7}
    labels = pxm["metadata"]["labels"]
    assert labels["moeproxy.io/checkpoint-watch"] == "grpo" and labels["moeproxy.io/step"] == "200"
    assert labels["team"] == "rl"
    assert pxm["metadata"]["annotations"]["moeproxy.io/checkpoint-uri"] == run.checkpoint(200)
    (owner,) = pxm["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == \
        ("CheckpointWatch", "grpo", watch["metadata"]["uid"], True)

    # The ProxyModels run their own pipeline (preflight on the checkpoint's config.json, Job).
    await eventually(lambda: cluster.get(JOBS, NS, "grpo-step-100-transform-g1"), what="transformer Job")
    await eventually(lambda: [p["phase"] for p in watch_status(cluster, "grpo").get("proxyModels", [])]
                     == ["Transforming", "Transforming"], what="phases in the watch's status")

    # Step 300 is never a ProxyModel while incomplete; once its last shard lands, it is.
    await polls(cluster, "grpo", 2)
    assert "grpo-step-300" not in proxymodels(cluster)
    run.save(300)
    await eventually(lambda: "grpo-step-300" in proxymodels(cluster), what="step 300's ProxyModel")
    await eventually(lambda: watch_status(cluster, "grpo").get("lastSeenStep") == 300)
    assert watch_status(cluster, "grpo")["waiting"] == []
    await eventually(lambda: len(events(cluster, "ProxyModelCreated")) == 3, what="three ProxyModelCreated Events")


async def test_keep_last_retires_the_oldest_and_its_data(cluster, operator, run, s3):
    run.save(100)
    run.save(200)
    await secret(cluster)
    await cluster.create(CHECKPOINT_WATCHES, NS, checkpoint_watch_manifest(
        "ret", run, keepLast=2, deleteProxyData=True))
    await eventually(lambda: proxymodels(cluster) == ["ret-step-100", "ret-step-200"])
    pxm = cluster.get(PROXYMODELS, NS, "ret-step-100")
    assert pxm["spec"]["cleanup"] == {"deleteProxy": True}
    # The proxy of step 100 as the transformer would leave it, at the ProxyModel's default destination.
    destination = f"{run.prefix}/global_step_100/{HF}-proxies/{NS}/ret-step-100/"
    client = s3.client()
    for name in ("config.json", "proxy-manifest.json"):
        client.put_object(Bucket=BUCKET, Key=destination + name, Body=b"{}")

    run.save(400)
    await eventually(lambda: proxymodels(cluster) == ["ret-step-200", "ret-step-400"], what="retention")
    await eventually(lambda: client.list_objects_v2(Bucket=BUCKET, Prefix=destination).get("KeyCount") == 0,
                     what="the retired proxy's objects deleted")
    await eventually(lambda: watch_status(cluster, "ret").get("retiredThrough") == 100)
    assert [p["step"] for p in watch_status(cluster, "ret")["proxyModels"]] == [200, 400]
    # A retired step is never made again, even though its checkpoint is still there.
    await polls(cluster, "ret", 2)
    assert proxymodels(cluster) == ["ret-step-200", "ret-step-400"]
    # One Event for it, in those polls too: kopf posts Events from a queue, so count once it is empty.
    await operator.events_posted()
    retired = [e["message"] for e in events(cluster, "ProxyModelRetired")]
    assert len(retired) == 1 and "ret-step-100" in retired[0], retired
    # The default destinations under the prefix (…/huggingface-proxies/…) are never taken as sources.
    assert not any("proxies" in p for p in proxymodels(cluster))


async def test_max_concurrent_leaves_the_rest_pending(cluster, operator, run):
    for step in (100, 200, 300):
        run.save(step)
    await secret(cluster)
    await cluster.create(CHECKPOINT_WATCHES, NS, checkpoint_watch_manifest("one", run, maxConcurrent=1))
    await eventually(lambda: watch_status(cluster, "one").get("pending") == [200, 300], what="pending steps")
    assert proxymodels(cluster) == ["one-step-100"]
    await polls(cluster, "one", 2)
    assert proxymodels(cluster) == ["one-step-100"]

    # step 100's proxy is built: its slot goes to step 200, and so on.
    await finish_transformer(cluster, "one-step-100")
    await eventually(lambda: proxymodels(cluster) == ["one-step-100", "one-step-200"], what="the next one")
    await eventually(lambda: watch_status(cluster, "one").get("pending") == [300])
    phases = {p["name"]: p["phase"] for p in watch_status(cluster, "one")["proxyModels"]}
    assert phases["one-step-100"] == "ProxyReady"
    await finish_transformer(cluster, "one-step-200")
    await eventually(lambda: "one-step-300" in proxymodels(cluster), what="the last one")
    await eventually(lambda: watch_status(cluster, "one").get("pending") == [])


async def test_unchanged_checkpoints_are_read_once(cluster, operator, run, monkeypatch):
    """A checkpoint still uploading, or pending, is not read again until its files change."""
    inspected: list[str] = []
    real = checkpoint_watch.inspect_all

    def counting(store, candidates, *args, **kwargs):
        inspected.extend(c.path for c in candidates)
        return real(store, candidates, *args, **kwargs)

    monkeypatch.setattr(checkpoint_watch, "inspect_all", counting)
    run.save(100, without=(SHARD2,))
    await secret(cluster)
    await cluster.create(CHECKPOINT_WATCHES, NS, checkpoint_watch_manifest("once", run))
    await eventually(lambda: watch_status(cluster, "once").get("waiting"), what="step 100 waiting")
    await polls(cluster, "once", 3)
    assert inspected == [f"global_step_100/{HF}"]
    run.save(100)  # the missing shard lands: the directory changed, so it is read again
    await eventually(lambda: proxymodels(cluster) == ["once-step-100"], what="its ProxyModel")
    assert inspected == [f"global_step_100/{HF}"] * 2


async def test_restart_makes_no_duplicate(cluster, operator, run):
    run.save(100)
    run.save(200)
    await secret(cluster)
    await cluster.create(CHECKPOINT_WATCHES, NS, checkpoint_watch_manifest("rs", run))
    await eventually(lambda: proxymodels(cluster) == ["rs-step-100", "rs-step-200"])
    # kopf posts Events from a queue: stopping before it has posted would lose them, not duplicate
    await eventually(lambda: len(events(cluster, "ProxyModelCreated")) == 2, what="the two creation Events")
    await operator.stop()
    await operator.start()
    await polls(cluster, "rs", 3)
    await operator.stop()
    await operator.start()
    await polls(cluster, "rs", 2)
    assert proxymodels(cluster) == ["rs-step-100", "rs-step-200"]
    assert proxymodel_posts(cluster) == 2
    assert len(events(cluster, "ProxyModelCreated")) == 2


async def test_suspend_makes_nothing_new(cluster, operator, run):
    run.save(100)
    await secret(cluster)
    await cluster.create(CHECKPOINT_WATCHES, NS, checkpoint_watch_manifest("sus", run, suspend=True))
    await eventually(lambda: watch_condition(cluster, "sus", "Suspended").get("status") == "True")
    await polls(cluster, "sus", 2)
    assert proxymodels(cluster) == [] and "SourceReachable" not in json.dumps(watch_status(cluster, "sus"))

    await cluster.patch_spec(CHECKPOINT_WATCHES, NS, "sus", {"suspend": False})
    await eventually(lambda: proxymodels(cluster) == ["sus-step-100"], what="a ProxyModel once resumed")
    await eventually(lambda: watch_condition(cluster, "sus", "Suspended")["status"] == "False")
    await cluster.patch_spec(CHECKPOINT_WATCHES, NS, "sus", {"suspend": True})
    await eventually(lambda: watch_condition(cluster, "sus", "Suspended").get("status") == "True")
    run.save(200)
    await polls(cluster, "sus", 2)
    assert proxymodels(cluster) == ["sus-step-100"]


async def test_listing_errors_are_conditions_and_recover(cluster, operator, run, caplog):
    caplog.set_level(logging.DEBUG)
    wrong = "wrong-secret-never-shown-0123456789"
    run.save(100)
    await secret(cluster, secret_key=wrong)
    manifest = checkpoint_watch_manifest("err", run)
    manifest["spec"]["source"]["endpoint"] = "http://127.0.0.1:9"  # nothing listens there
    await cluster.create(CHECKPOINT_WATCHES, NS, manifest)

    # The endpoint is down: a condition with the reason, and the watch keeps polling.
    await eventually(lambda: watch_condition(cluster, "err", "SourceReachable").get("reason") ==
                     "EndpointUnreachable", timeout=WATCH_EVENT_TIMEOUT, what="EndpointUnreachable")
    assert watch_condition(cluster, "err", "SourceReachable")["status"] == "False"
    await polls(cluster, "err", 1)

    # The endpoint fixed, the credentials still wrong.
    endpoint = os.environ["MOEPROXY_S3_ENDPOINT"]
    await cluster.patch_spec(CHECKPOINT_WATCHES, NS, "err", {"source": {**manifest["spec"]["source"],
                                                                        "endpoint": endpoint}})
    await eventually(lambda: watch_condition(cluster, "err", "SourceReachable").get("reason") == "S3AccessDenied",
                     timeout=WATCH_EVENT_TIMEOUT, what="S3AccessDenied")
    assert "signature" in watch_condition(cluster, "err", "SourceReachable")["message"].lower()
    assert proxymodels(cluster) == []
    await eventually(lambda: {e["reason"] for e in events(cluster) if e["type"] == "Warning"} >= {
        "EndpointUnreachable", "S3AccessDenied"}, what="both Warning Events")  # kopf posts Events from a queue

    # The Secret fixed: the next poll lists, and the checkpoint becomes a ProxyModel.
    await cluster.patch(SECRETS, NS, "s3-creds", {"data": {"AWS_SECRET_ACCESS_KEY": _b64(SECRET_KEY)}})
    await eventually(lambda: proxymodels(cluster) == ["err-step-100"], what="recovery")
    await eventually(lambda: watch_condition(cluster, "err", "SourceReachable")["status"] == "True")
    await eventually(lambda: events(cluster, "SourceReachable"), what="the recovery's Event")  # posted from a queue

    # No secret value anywhere: logs, statuses, Events, the objects the operator made.
    everything = json.dumps([dict(o.raw) for o in list(cluster.emulator.objects.values())
                             if not o.deleted and o.raw.get("kind") != "Secret"])
    for value in (wrong, SECRET_KEY):
        assert value not in caplog.text and value not in everything


async def test_a_refused_proxymodel_is_a_condition_not_a_crash(cluster, operator, run):
    """The API server applies the ProxyModel CRD's own rules (CEL) to what the template makes."""
    handle, refusing = cluster.emulator._handle, [True]

    async def refuse(request):
        if refusing[0] and request.action == kmock.action.CREATE and not request.headers.get("X-Test-Client") \
                and request.resource == kmock.resource("moeproxy.io/v1alpha1/proxymodels"):
            return aiohttp.web.json_response(status=422, data={
                "kind": "Status", "status": "Failure", "reason": "Invalid", "code": 422,
                "message": "ProxyModel.moeproxy.io \"bad-step-100\" is invalid: spec.pruning: Invalid value"})
        return await handle(request)

    object.__setattr__(cluster.emulator, "_handle", refuse)
    run.save(100)
    await secret(cluster)
    await cluster.create(CHECKPOINT_WATCHES, NS, checkpoint_watch_manifest("bad", run))
    await eventually(lambda: watch_condition(cluster, "bad", "Accepted").get("reason") == "ProxyModelRejected")
    assert "bad-step-100" in watch_condition(cluster, "bad", "Accepted")["message"]
    await eventually(lambda: watch_status(cluster, "bad").get("pending") == [100], what="step 100 still to make")
    await polls(cluster, "bad", 2)
    assert len(events(cluster, "ProxyModelRejected")) == 1 and proxymodels(cluster) == []
    refusing[0] = False  # the CRD (or the template) fixed
    await eventually(lambda: proxymodels(cluster) == ["bad-step-100"], what="created once accepted")
    await eventually(lambda: watch_condition(cluster, "bad", "Accepted").get("reason") == "SpecValid")


async def test_missing_secret_is_a_condition(cluster, operator, run):
    run.save(100)
    await cluster.create(CHECKPOINT_WATCHES, NS, checkpoint_watch_manifest("nos", run))
    await eventually(lambda: watch_condition(cluster, "nos", "SourceReachable").get("reason") == "SecretNotFound")
    await secret(cluster)
    await eventually(lambda: proxymodels(cluster) == ["nos-step-100"], what="recovery once the Secret exists")


async def test_a_dense_checkpoint_is_skipped_with_one_warning(cluster, operator, run):
    run.save(100, config=synthetic.DENSE_TINY)
    run.save(200)
    await secret(cluster)
    await cluster.create(CHECKPOINT_WATCHES, NS, checkpoint_watch_manifest("dn", run))
    await eventually(lambda: proxymodels(cluster) == ["dn-step-200"])
    await polls(cluster, "dn", 3)
    (warning,) = events(cluster, "CheckpointSkipped")
    assert warning["type"] == "Warning" and "step 100" in warning["message"]
    assert "not a mixture-of-experts" in warning["message"]
    assert watch_status(cluster, "dn")["skipped"] == [
        {"step": 100, "kind": "dense", "reason": "not a mixture-of-experts model (no routed experts)"}]
    assert proxymodels(cluster) == ["dn-step-200"]


async def test_every_api_call_is_in_rbac_permissions(cluster, operator, run):
    """What a watch does (list, create, retire, status) stays within rbac.PERMISSIONS."""
    run.save(100)
    await secret(cluster)
    await cluster.create(CHECKPOINT_WATCHES, NS, checkpoint_watch_manifest("rb", run, keepLast=1))
    await eventually(lambda: proxymodels(cluster) == ["rb-step-100"])
    run.save(200)
    await eventually(lambda: proxymodels(cluster) == ["rb-step-200"], what="retention to one")
    await polls(cluster, "rb", 1)
    seen = {(c.group, c.resource, c.verb) for c in list(cluster.emulator.calls) if not c.by_test}
    assert not [s for s in seen if not rbac.allowed(*s)], seen
    assert {("moeproxy.io", "proxymodels", "create"), ("moeproxy.io", "proxymodels", "delete"),
            ("moeproxy.io", "checkpointwatches/status", "patch"), ("", "secrets", "get")} <= seen
    # The Secret is read by name, never listed or watched.
    assert not {("", "secrets", "list"), ("", "secrets", "watch")} & seen


def _b64(text: str) -> str:
    import base64

    return base64.b64encode(text.encode()).decode()
