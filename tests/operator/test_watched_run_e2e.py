"""The closed loop end to end (issue 43): a training run appends its metrics to S3 step by step and
saves a checkpoint every 10 steps (3 tiny Qwen3-MoE checkpoints, the last, step 30, carrying a
planted dense-MLP activation beyond fp16's range, as tests/repro/test_bisect.py plants it), and
fails with an overflow at step 33. The CheckpointWatch that follows it makes a ProxyModel per
checkpoint and opens one incident, whose one Diagnosis bisects the checkpoints up to step 33 to the
first bad one (30), each probe on the watch's ProxyModel of its checkpoint (the same content key:
no proxy built twice), then runs the catalogue's candidates for overflow on that ProxyModel. The answer is in
the watch's status, its Events and report.json/report.md next to the run. Nothing is written by
hand after the watch: the test only plays the cluster (each build is the transformer's, each run a
local `moe-proxy repro` process through tests/operator/kubelet.py).
"""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest

from moe_proxy.investigate.catalogue import suggested
from proxymodel_operator import checkpoint_watch, diagnosis
from proxymodel_operator.checkpoint_watch import CHECKPOINT_WATCHES
from proxymodel_operator.resources import DIAGNOSES, PROXYMODELS

from ..repro.test_bisect import planted_run
from .harness import BUCKET, Operator, eventually, registry_copy
from .test_diagnosis_bisect import HF, NS, TEMPLATE, _run, _secret, _transform

TICK = 0.3
CLEAN = {"actor/pg_loss": 0.1, "actor/grad_norm": 1.0, "critic/rewards/mean": 0.5, "numerics/half_precision": 1}
OVERFLOW = {"numerics/nonfinite_activations": 7}
CLOSED = ("Fixed", "NoFix", "NoneBad", "NotReproduced", "BudgetSpent", "DiagnosisFailed", "NoCheckpoint",
          "TooFewCheckpoints")


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    return planted_run(tmp_path_factory.mktemp("loop-run"), (10, 20, 30), (30,))


@pytest.fixture
def registry():
    r = registry_copy()
    diagnosis.register(TICK, r)
    checkpoint_watch.register(TICK, r)
    return r


def _watch(cluster) -> dict:
    return (cluster.get(CHECKPOINT_WATCHES, NS, "run") or {}).get("status") or {}


def _unfinished(cluster, prefix: str) -> list[dict]:
    return [j for j in cluster.objects_of("jobs", NS) if j["metadata"]["name"].startswith(prefix) and not any(
        c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
        for c in (j.get("status") or {}).get("conditions") or [])]


async def _train(client, local_run, prefix: str, before_failure=None) -> None:
    """The training job: a metrics line per step, a checkpoint every 10 steps, an overflow at 33
    (after `before_failure()`, when given)."""
    lines = []
    for step in range(1, 34):
        if step == 33 and before_failure:
            await before_failure()
        lines.append(json.dumps({"step": step, "data": {**CLEAN, **(OVERFLOW if step == 33 else {})}}))
        client.put_object(Bucket=BUCKET, Key=f"{prefix}/metrics.jsonl", Body="".join(f"{x}\n" for x in lines).encode())
        if step % 10 == 0:
            root = local_run / f"global_step_{step}"
            for path in sorted(root.rglob("*"), key=lambda p: p.name == "config.json"):  # config.json last
                if path.is_file():
                    client.put_object(Bucket=BUCKET, Key=f"{prefix}/{path.relative_to(local_run)}",
                                      Body=path.read_bytes())
        await asyncio.sleep(0.05)


async def _play(cluster, prefix: str, local_run, tmp_path) -> None:
    """Be the cluster for the incident's workloads until the incident is answered."""
    while (_watch(cluster).get("incident") or {}).get("state") not in CLOSED:
        jobs = await eventually(lambda: _unfinished(cluster, prefix) or (
            (_watch(cluster).get("incident") or {}).get("state") in CLOSED), 90, "the next workload")
        for job in jobs if isinstance(jobs, list) else []:
            if job["metadata"]["name"].endswith("-transform-g1"):
                await _transform(cluster, job, local_run, tmp_path / "proxies")
            else:
                await _run(cluster, job, tmp_path / "node")


@pytest.mark.slow
async def test_a_watched_run_reports_the_first_bad_checkpoint_and_the_cure(cluster, checkpointwatch_resource, s3,
                                                                         operator_env, registry, local_run, tmp_path):
    client, prefix = s3.client(), f"loop-e2e/{uuid.uuid4().hex[:8]}"
    uri = f"s3://{BUCKET}/{prefix}"
    await _secret(cluster)
    await cluster.create(CHECKPOINT_WATCHES, NS, {"metadata": {"name": "run"}, "spec": {
        "source": {"uri": uri, "credentialsSecret": "s3-creds", "region": "us-east-1"},
        "pattern": f"global_step_*/{HF}", "pollInterval": 1,  # a ProxyModel per checkpoint, its reproduction off
        "template": {"spec": {**TEMPLATE["spec"], "reproduction": {**TEMPLATE["spec"]["reproduction"],
                                                                   "enabled": False}}},
        "metrics": {"uri": f"{uri}/metrics.jsonl"}, "onFailure": {"failOn": ["overflow", "nan"]}}})
    operator = Operator(registry=registry)
    await operator.start()
    try:
        await _train(client, local_run, prefix, lambda: eventually(  # the watch has made the last one
            lambda: cluster.get(PROXYMODELS, NS, "run-step-30"), 30, "the watch's ProxyModel of step 30"))
        await _play(cluster, "run-", local_run, tmp_path)  # the watch's builds and the incident's runs
        await eventually(lambda: {"FailureSeen", "IncidentDiagnosisStarted", "FirstBadFound", "FixedBy"} <= set(
            cluster.event_reasons(NS, "run")), 30, lambda: f"the Events, not {cluster.event_reasons(NS, 'run')}")
    finally:
        await operator.stop()
    operator.check_handler_errors()

    incident = _watch(cluster)["incident"]
    assert (incident["step"], incident["signature"], incident["state"]) == (33, "overflow", "Fixed"), incident
    assert incident["firstBad"] == 30 and incident["firstBadCheckpoint"] == f"{uri}/global_step_30/{HF}"
    fixed = [c.strip() for c in incident["fixedBy"].split(",")]
    assert {"bf16", "fp32"} <= set(fixed) and "loss-scaling" not in fixed  # bf16/fp32 have the range; scaling does not
    assert incident["candidates"] == [s.name for s in suggested("overflow")]
    assert cluster.names(DIAGNOSES, NS) == ["run-incident-33"]
    d = cluster.get(DIAGNOSES, NS, "run-incident-33")["status"]
    assert d["candidatesOn"] == {"proxyModel": "run-step-30", "step": 30}
    # the proxies built once each, by the watch: every probe reused its checkpoint's (same content
    # key), none was made for the incident, and the candidates ran on the first bad one's
    watchs = [f"run-step-{s}" for s in (10, 20, 30)]
    assert sorted(cluster.names(PROXYMODELS, NS)) == watchs
    assert sorted((p["step"], p["reused"]) for p in d["probes"]) == [(int(n.split("-")[-1]), n) for n in watchs]
    assert d["builds"] == 0 and "ProbeReused" in cluster.event_reasons(NS, "run-incident-33")
    report = json.loads(client.get_object(Bucket=BUCKET, Key=f"{prefix}/moe-proxy/incident-33/report.json")["Body"]
                        .read())
    assert (report["failing_step"], report["signature"], report["first_bad"]) == (33, "overflow", 30)
    assert set(report["fixed_by"]) == set(fixed) and report["cost"]["runs"] == incident["spentRuns"]
    assert report["reused_proxy_models"] == watchs == incident["reusedProxyModels"]
    md = client.get_object(Bucket=BUCKET, Key=f"{prefix}/moe-proxy/incident-33/report.md")["Body"].read().decode()
    assert "| first bad checkpoint | 30 |" in md
    healthy = next(c for c in _watch(cluster)["conditions"] if c["type"] == "RunHealthy")
    assert (healthy["status"], healthy["reason"]) == ("True", "Fixed")
