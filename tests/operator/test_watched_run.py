"""The watched run through kopf, the emulated API and SeaweedFS (issue 43): a CheckpointWatch with
spec.metrics and spec.onFailure follows a training run's metrics as they are appended to S3, and a
watched failure opens an incident with exactly one Diagnosis (named after the incident, owned by
the watch); a restart, a re-poll or another signature of the same incident makes no second one; a
later failure of a resumed run makes a new one, linked to the previous. And the clear statuses:
a failure before any complete checkpoint (or with checkpoints that never complete), a run that
recovers by itself, metrics without a step, metrics that shrink, a webhook that refuses.

The checkpoints here are synthetic (headers, no weights: the listing reads nothing else) and the
Diagnosis is not run (its timer is not registered), except where a test plays its end by patching
its status; tests/operator/test_watched_run_e2e.py runs a planted run's incident to its answer.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import kopf
import pytest
from aiohttp import web

from proxymodel_operator import checkpoint_watch
from proxymodel_operator.checkpoint_watch import CHECKPOINT_WATCHES
from proxymodel_operator.incident import ANNOTATION_PREVIOUS, LABEL_INCIDENT
from proxymodel_operator.resources import DIAGNOSES

from ..checkpoints import synthetic
from .harness import ACCESS_KEY, BUCKET, QWEN3, SECRET_KEY, Operator, eventually

TICK = 0.25
NS = "rl-loop"
HF = "actor/huggingface"
SHARD2 = "model-00002-of-00002.safetensors"
CLEAN = {"actor/pg_loss": 0.1, "actor/grad_norm": 1.0, "critic/rewards/mean": 0.5}


@pytest.fixture(autouse=True)
def _checkpointwatches_served(checkpointwatch_resource):
    """Every test here: the emulator serves CheckpointWatches (conftest)."""


@pytest.fixture
def registry(registry: kopf.OperatorRegistry) -> kopf.OperatorRegistry:
    checkpoint_watch.register(TICK, registry)
    return registry


class TrainingRun:
    """A run writing checkpoints and a metrics.jsonl (verl's FileLogger) under s3://ckpt/<prefix>."""

    def __init__(self, s3):
        self.client, self.prefix = s3.client(), f"loop/{uuid.uuid4().hex[:8]}"
        self.uri = f"s3://{BUCKET}/{self.prefix}"
        self.files = synthetic.files(QWEN3, shapes=synthetic.QWEN3_TINY)
        self.lines: list[str] = []

    def save(self, step: int, without: tuple[str, ...] = ()) -> None:
        content = {k: v for k, v in self.files.items() if k not in without}
        synthetic.upload(self.client, BUCKET, f"{self.prefix}/global_step_{step}/{HF}", content)

    def train(self, steps: range, every: int = 4) -> None:
        """Log each step clean, and save a checkpoint every `every` steps."""
        for step in steps:
            self.log(step)
            if step % every == 0:
                self.save(step)

    def log(self, step: int, **values) -> None:
        self.lines.append(json.dumps({"step": step, "data": {**CLEAN, **values}}))
        self.put()

    def put(self, text: str | None = None) -> None:
        body = text if text is not None else "".join(line + "\n" for line in self.lines)
        self.client.put_object(Bucket=BUCKET, Key=f"{self.prefix}/metrics.jsonl", Body=body.encode())

    def object(self, key: str) -> bytes | None:
        try:
            return self.client.get_object(Bucket=BUCKET, Key=f"{self.prefix}/{key}")["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None


@pytest.fixture
def run(s3) -> TrainingRun:
    return TrainingRun(s3)


def watch_manifest(name: str, run: TrainingRun, **on_failure) -> dict:
    return {"metadata": {"name": name}, "spec": {
        "source": {"uri": run.uri, "credentialsSecret": "s3-creds", "region": "us-east-1"},
        "pattern": f"global_step_*/{HF}", "pollInterval": 1,
        "proxyPerCheckpoint": False,  # the incidents are the subject
        "template": {"spec": {"pruning": {"experts": 4}, "reproduction": {"enabled": False}}},
        "metrics": {"uri": f"{run.uri}/metrics.jsonl"},
        "onFailure": {"failOn": ["nan", "overflow"], **on_failure}}}


async def secret(cluster) -> None:
    await cluster.secret(NS, "s3-creds", AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)


def status(cluster, name: str) -> dict:
    return (cluster.get(CHECKPOINT_WATCHES, NS, name) or {}).get("status") or {}


def incident(cluster, name: str) -> dict:
    return status(cluster, name).get("incident") or {}


def condition(cluster, name: str, kind: str) -> dict:
    return next((c for c in status(cluster, name).get("conditions") or [] if c["type"] == kind), {})


def diagnoses_made(cluster) -> int:
    return sum(c.verb == "create" and c.resource == "diagnoses" and not c.by_test for c in cluster.emulator.calls)


def nan_step(step: int, run: TrainingRun) -> None:
    run.log(step, **{"actor/pg_loss": None})


async def test_a_failure_opens_one_diagnosis_and_nothing_makes_a_second(cluster, s3, operator_env, registry, run):
    run.train(range(1, 10))
    await secret(cluster)
    await cluster.create(CHECKPOINT_WATCHES, NS, watch_manifest("w", run))
    first = Operator(registry=registry)
    await first.start()
    try:
        await eventually(lambda: condition(cluster, "w", "MetricsReadable").get("reason") == "Read", 20, "metrics read")
        assert cluster.names(DIAGNOSES, NS) == [] and condition(cluster, "w", "RunHealthy")["status"] == "True"
        nan_step(10, run)  # the failure, after checkpoints 4 and 8
        d = await eventually(lambda: cluster.get(DIAGNOSES, NS, "w-incident-10"), 20, "the incident's Diagnosis")
        run.log(11, **{"numerics/nonfinite_activations": 3, "numerics/half_precision": 1})  # another signature
        nan_step(12, run)
        run.save(12)
        await asyncio.sleep(6 * TICK + 2)
    finally:
        await first.stop()
    first.check_handler_errors()
    assert d["spec"]["checkpoints"] == {"watch": "w", "bad": 8}
    assert d["spec"]["failOn"] == {"signature": "nan"} and d["metadata"]["labels"][LABEL_INCIDENT] == "10"
    assert [o["kind"] for o in d["metadata"]["ownerReferences"]] == ["CheckpointWatch"]
    inc = incident(cluster, "w")
    assert (inc["step"], inc["signature"], inc["state"], inc["diagnosis"]) == (10, "nan", "Diagnosing", "w-incident-10")
    # priced by the plan of checkpoint 8 (device-hours per step x steps): spent nothing yet, all left
    assert inc["budget"]["spent"] == {"runs": 0, "deviceHours": "0"} and inc["budget"]["left"]["runs"] == 20
    assert inc["runHours"] > 0 and inc["candidates"] and not inc["leftOut"]
    report = json.loads(run.object("moe-proxy/incident-10/report.json"))
    assert (report["failing_step"], report["signature"], report["first_bad"]) == (10, "nan", None)
    assert {"FailureSeen", "IncidentDiagnosisStarted"} <= set(cluster.event_reasons(NS, "w"))

    polled = status(cluster, "w")["lastPollTime"]
    second = Operator(registry=registry)  # a restart: the watcher reads the metrics from the start again
    await second.start()
    try:
        await eventually(lambda: status(cluster, "w")["lastPollTime"] != polled, 20, "a poll after the restart")
        await asyncio.sleep(8 * TICK + 2)
    finally:
        await second.stop()
    second.check_handler_errors()
    assert cluster.names(DIAGNOSES, NS) == ["w-incident-10"] and diagnoses_made(cluster) == 1
    assert incident(cluster, "w")["step"] == 10


async def test_a_later_failure_after_a_fix_is_a_new_incident_linked_to_the_first(cluster, s3, operator, registry, run):
    run.train(range(1, 9))
    nan_step(9, run)
    await secret(cluster)
    await cluster.create(CHECKPOINT_WATCHES, NS, watch_manifest("w", run))
    await eventually(lambda: cluster.get(DIAGNOSES, NS, "w-incident-9"), 20, "the first incident's Diagnosis")
    # the Diagnosis's answer (played here: tests/operator/test_watched_run_e2e.py runs one)
    await cluster.patch_status(DIAGNOSES, NS, "w-incident-9", {
        "phase": "Complete", "firstBad": {"step": 8, "checkpoint": f"{run.uri}/global_step_8/{HF}"},
        "fixedBy": "bf16", "conditions": [{"type": "Complete", "status": "True", "reason": "FixFound"}]})
    await eventually(lambda: incident(cluster, "w").get("state") == "Fixed", 20, "the fix seen")
    assert incident(cluster, "w")["fixedBy"] == "bf16" and incident(cluster, "w")["firstBad"] == 8
    # the run resumes from checkpoint 8 with the fix: clean steps, a checkpoint, then a new failure
    for step in range(9, 14):
        run.log(step)
    run.save(12)
    nan_step(14, run)
    d = await eventually(lambda: cluster.get(DIAGNOSES, NS, "w-incident-14"), 20, "the second incident's Diagnosis")
    assert d["metadata"]["annotations"][ANNOTATION_PREVIOUS] == "w-incident-9"
    assert d["spec"]["checkpoints"]["bad"] == 12
    await eventually(lambda: incident(cluster, "w").get("previous") == "w-incident-9", 20, "the link in status")
    second = incident(cluster, "w")
    assert (second["step"], second["state"], second.get("fixedBy"), second.get("firstBad")) == (
        14, "Diagnosing", None, None)  # nothing of the first incident's answer left on the second
    assert [i["step"] for i in status(cluster, "w")["incidents"]] == [9]
    assert sorted(cluster.names(DIAGNOSES, NS)) == ["w-incident-14", "w-incident-9"]
    assert {"FixedBy", "FirstBadFound"} <= set(cluster.event_reasons(NS, "w"))


async def test_a_run_that_recovers_by_itself_makes_no_diagnosis(cluster, s3, operator, run):
    run.train(range(1, 9))
    nan_step(9, run)
    await secret(cluster)
    await cluster.create(CHECKPOINT_WATCHES, NS, watch_manifest("w", run, confirmSteps=2))
    await eventually(lambda: incident(cluster, "w").get("state") == "Confirming", 20, "waiting to confirm")
    run.log(10)
    run.log(11)
    await eventually(lambda: incident(cluster, "w").get("state") == "Recovered", 20, "recovered")
    assert cluster.names(DIAGNOSES, NS) == [] and condition(cluster, "w", "RunHealthy")["reason"] == "Recovered"
    await eventually(lambda: "RunRecovered" in cluster.event_reasons(NS, "w"), 20, "the Event")


class Receiver:
    """A webhook receiver on 127.0.0.1 that refuses (HTTP 503) until told to accept."""

    def __init__(self):
        self.accept, self.bodies, self.refused = False, [], 0

    async def handle(self, request: web.Request) -> web.Response:
        if not self.accept:
            self.refused += 1
            return web.Response(status=503)
        self.bodies.append(await request.json())
        return web.Response(status=200)


@pytest.fixture
async def receiver():
    r = Receiver()
    app = web.Application()
    app.router.add_post("/hooks/T000/secret-token", r.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    r.url = f"http://127.0.0.1:{runner.addresses[0][1]}/hooks/T000/secret-token"
    yield r
    await runner.cleanup()


async def test_a_failure_before_any_complete_checkpoint_and_a_refusing_webhook(cluster, s3, operator, run, receiver):
    """Checkpoint 4 never completes (a shard missing); the failure at 6 has nothing to bisect:
    NoCheckpoint, said once, no Diagnosis; the webhook refuses, then takes the answer."""
    for step in range(1, 6):
        run.log(step)
    run.save(4, without=(SHARD2,))
    nan_step(6, run)
    await secret(cluster)
    await cluster.secret(NS, "hook", url=receiver.url)
    await cluster.create(CHECKPOINT_WATCHES, NS, watch_manifest(
        "w", run, webhook={"secretRef": {"name": "hook", "key": "url"}}))
    await eventually(lambda: incident(cluster, "w").get("state") == "NoCheckpoint", 20, "no checkpoint")
    refused = await eventually(lambda: condition(cluster, "w", "WebhookDelivered").get("reason") == "WebhookRefused"
                               and condition(cluster, "w", "WebhookDelivered"), 20, "the refusal")
    assert refused["status"] == "False" and "HTTP 503" in refused["message"]
    await eventually(lambda: receiver.refused >= 2, 20, "tried again")
    receiver.accept = True
    await eventually(lambda: receiver.bodies, 20, "the answer posted")
    await eventually(lambda: condition(cluster, "w", "WebhookDelivered").get("status") == "True", 20, "delivered")
    await asyncio.sleep(4 * TICK + 1)
    assert len(receiver.bodies) == 1  # delivered once: no loop
    body = receiver.bodies[0]
    assert "nan at step 6" in body["text"] and "no complete checkpoint" in body["text"]
    assert body["alerts"][0]["labels"]["state"] == "NoCheckpoint"
    assert cluster.names(DIAGNOSES, NS) == []
    assert cluster.event_reasons(NS, "w").count("NoCompleteCheckpoint") == 1
    # the URL is in no status, Event or log line
    assert "secret-token" not in json.dumps(status(cluster, "w")) + json.dumps(cluster.objects_of("events", NS))


async def test_metrics_without_a_step_then_shrinking_metrics(cluster, s3, operator, run):
    await secret(cluster)
    run.put('{"data": {"actor/pg_loss": 0.1}}\n')
    await cluster.create(CHECKPOINT_WATCHES, NS, watch_manifest("w", run))
    bad = await eventually(lambda: condition(cluster, "w", "MetricsReadable").get("reason") == "MetricsMalformed"
                           and condition(cluster, "w", "MetricsReadable"), 20, "the refusal")
    assert "step" in bad["message"] and bad["status"] == "False"
    run.train(range(1, 9))
    nan_step(9, run)
    await eventually(lambda: cluster.get(DIAGNOSES, NS, "w-incident-9"), 20, "the incident's Diagnosis")
    run.lines = run.lines[:3]  # the run started over: its metrics file is shorter
    run.put()
    await eventually(lambda: "MetricsRewound" in cluster.event_reasons(NS, "w"), 20, "the rewind said")
    for step in range(4, 10):
        run.log(step)  # ... and it fails at the same step again: the same incident
    nan_step(9, run)
    await asyncio.sleep(6 * TICK + 2)
    assert cluster.names(DIAGNOSES, NS) == ["w-incident-9"] and diagnoses_made(cluster) == 1
    assert condition(cluster, "w", "MetricsReadable")["reason"] == "Read"


async def test_a_budget_too_small_for_the_bisection_is_its_own_status(cluster, s3, operator, run):
    run.train(range(1, 13))
    nan_step(13, run)
    await secret(cluster)
    await cluster.create(CHECKPOINT_WATCHES, NS, watch_manifest("w", run, budget={"probes": 2}))
    spent = await eventually(lambda: incident(cluster, "w").get("state") == "BudgetSpent" and incident(cluster, "w"),
                             20, "the budget said")
    assert "3 checkpoints needs up to 3 runs" in spent["budgetRefused"] and "the budget is 2 runs" in spent[
        "budgetRefused"]
    assert spent["leftOut"] and spent["candidates"] == []
    assert cluster.names(DIAGNOSES, NS) == [] and condition(cluster, "w", "RunHealthy")["reason"] == "BudgetSpent"
    await eventually(lambda: "BudgetSpent" in cluster.event_reasons(NS, "w"), 20, "the Event")
    assert "budget spent" in json.loads(run.object("moe-proxy/incident-13/report.json"))["summary"]


async def test_a_diagnosis_that_starts_more_runs_than_the_budget_is_stopped(cluster, s3, operator, run):
    """A bisection stepping around inconclusive probes can pass log2(n) + 3: the watch stops it."""
    run.train(range(1, 9))
    nan_step(9, run)
    await secret(cluster)
    await cluster.create(CHECKPOINT_WATCHES, NS, watch_manifest("w", run, budget={"probes": 6}))
    await eventually(lambda: cluster.get(DIAGNOSES, NS, "w-incident-9"), 20, "the incident's Diagnosis")
    await cluster.patch_status(DIAGNOSES, NS, "w-incident-9", {  # as its timer would write it (played here)
        "phase": "Running", "firstBad": {"step": 8, "checkpoint": f"{run.uri}/global_step_8/{HF}"},
        "probes": [{"step": 8, "phase": "Succeeded", "deviceHours": "0.5"}] * 3,
        "baseline": {"runs": [{"phase": "Succeeded", "deviceHours": "0.25"}]},
        "candidates": [{"runs": [{"phase": "Running"}]}, {"runs": [{"phase": "Running"}]},
                       {"runs": [{"phase": "Running"}]}, {"runs": [{"phase": "Pending"}]}]})
    spent = await eventually(lambda: incident(cluster, "w").get("state") == "BudgetSpent" and incident(cluster, "w"),
                             20, "the budget spent")
    assert spent["budgetRefused"] == "stopped: 7 runs started, the budget is 6" and spent["firstBad"] == 8
    assert spent["budget"]["spent"]["runs"] == 7 and spent["budget"]["left"]["runs"] == 0
    assert spent["budget"]["spent"]["deviceHours"] == "1.75"  # what the 4 finished runs cost, not 4 x planned
    await eventually(lambda: cluster.names(DIAGNOSES, NS) == [], 20, "the Diagnosis stopped")
    await asyncio.sleep(4 * TICK + 1)
    assert diagnoses_made(cluster) == 1 and incident(cluster, "w")["state"] == "BudgetSpent"
