"""spec.transformer.parallelism: the build as an Indexed Job of W workers, then one finalize Job
(and, with calibration, one calibrate Job before the workers). The Jobs against the Kubernetes
schema and their arguments against the real `moe-proxy` parsers; then the operator for real
against the emulated API, playing the Job controller (Job status, pods)."""

from __future__ import annotations

import argparse
import importlib
import json
import re

import kubernetes_validate
import pytest

from proxymodel_operator import rbac
from proxymodel_operator.children import MAX_NAME
from proxymodel_operator.outcome import count_indexes
from proxymodel_operator.resources import JOBS, PODS, PROXYMODELS
from proxymodel_operator.settings import Settings
from proxymodel_operator.spec import InvalidSpec, parse
from proxymodel_operator.transformer_job import (build_args, calibrate_job, finalize_job, step_job, steps,
                                                 transformer_job)

from ..checkpoints.crd_schema import ROOT, errors, load_crd
from .harness import ACCESS_KEY, SECRET_KEY, TRANSFORMER_REPORT, eventually, proxymodel

K8S = "1.31.0"
NS = "team-s"
SPEC = {
    "source": {"uri": "s3://ckpt/dsv3/step-800", "endpoint": "https://s3.internal", "credentialsSecret": "creds"},
    "pruning": {"experts": 32, "seed": 3, "pin": ["3:17"]},
    "transformer": {"parallelism": 4, "backoffLimit": 2, "resources": {"limits": {"memory": "64Gi"}}},
}
CALIBRATED = {**SPEC, "pruning": {"experts": 32, "method": "saliency"}, "calibration": {"samples": 16}}
INDEX_ANNOTATION = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def _spec(spec: dict = SPEC):
    return parse(spec, "ns", "pm", Settings())


def _cli(module: str, args: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    importlib.import_module(f"moe_proxy.commands.{module}").add_parser(parser.add_subparsers())
    return parser.parse_args(args)


def _container(job: dict) -> dict:
    return job["spec"]["template"]["spec"]["containers"][0]


def _expand(container: dict, values: dict[str, str]) -> list[str]:
    """The args as the kubelet runs them: `$(VAR)` expands only for variables the container
    declares in its env (anything else stays literally `$(VAR)`)."""
    declared = {e["name"] for e in container.get("env", [])}
    return [re.sub(r"\$\((\w+)\)", lambda m: values[m[1]] if m[1] in declared else m[0], a) for a in container["args"]]


# --- the Jobs --------------------------------------------------------------------------------


def test_workers_are_an_indexed_job_each_building_its_own_share():
    spec = _spec()
    job = transformer_job("pm", "ns", 1, spec)
    kubernetes_validate.validate(job, K8S, strict=True)
    s = job["spec"]
    assert (s["completionMode"], s["completions"], s["parallelism"]) == ("Indexed", 4, 4)
    # A failed pod is retried for its own index only; an index out of retries fails the Job.
    assert (s["backoffLimitPerIndex"], s["maxFailedIndexes"]) == (2, 0) and "backoffLimit" not in s
    assert s["podFailurePolicy"]["rules"][0]["action"] == "FailJob"  # bad input: no worker retries
    container = _container(job)
    index_env = [e for e in container["env"] if e["name"] == "JOB_COMPLETION_INDEX"]
    assert index_env == [{"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {"fieldPath": INDEX_ANNOTATION}}}]
    assert container["resources"] == {"limits": {"memory": "64Gi"}}
    single = _cli("build", build_args(_spec({**SPEC, "transformer": {}})))
    for index in range(4):
        worker = _cli("build", _expand(container, {"JOB_COMPLETION_INDEX": str(index)}))
        assert (worker.worker, worker.workers, worker.finalize) == (index, 4, False)
        # Everything else is the single build's: the same plan, so the same build id and output.
        assert {**vars(worker), "worker": None, "workers": 1} == vars(single)


def test_finalize_runs_once_with_the_same_build_options():
    spec = _spec()
    job = finalize_job("pm", "ns", 1, spec)
    kubernetes_validate.validate(job, K8S, strict=True)
    assert job["metadata"]["name"] == "pm-finalize-g1" and "completionMode" not in job["spec"]
    assert (job["spec"]["backoffLimit"], job["metadata"]["labels"]["moeproxy.io/role"]) == (2, "transformer")
    args = _cli("build", _container(job)["args"])
    assert (args.finalize, args.workers, args.worker, args.termination_log) == (True, 4, None, "/dev/termination-log")
    single = _cli("build", build_args(_spec({**SPEC, "transformer": {}})))
    assert {**vars(args), "finalize": False, "workers": 1} == vars(single)
    assert step_job("finalize", "pm", "ns", 1, spec) == job


def test_calibration_runs_once_before_the_workers():
    spec = _spec(CALIBRATED)
    assert steps(spec) == ("calibrate", "fit", "workers", "finalize")  # saliency + calibration: reconstructs
    calibrate = calibrate_job("pm", "ns", 1, spec)
    kubernetes_validate.validate(calibrate, K8S, strict=True)
    assert calibrate["metadata"]["name"] == "pm-calibrate-g1" and "completionMode" not in calibrate["spec"]
    stats = _cli("calibrate", _container(calibrate)["args"])
    assert (stats.out, stats.samples) == (spec.calibration_uri, 16)
    for job in (transformer_job("pm", "ns", 1, spec), finalize_job("pm", "ns", 1, spec)):
        kubernetes_validate.validate(job, K8S, strict=True)
        assert "initContainers" not in job["spec"]["template"]["spec"]  # nobody else calibrates
        assert _cli("build", _expand(_container(job), {"JOB_COMPLETION_INDEX": "1"})).calibration == \
            spec.calibration_uri


def test_one_worker_is_the_single_build():
    one, default = _spec({**SPEC, "transformer": {"parallelism": 1}}), _spec({**SPEC, "transformer": {}})
    assert steps(one) == steps(default) == ("build",)
    assert transformer_job("pm", "ns", 1, one) == transformer_job("pm", "ns", 1, default)
    assert "completionMode" not in transformer_job("pm", "ns", 1, one)["spec"]
    assert steps(_spec({**CALIBRATED, "transformer": {}})) == ("build",)  # calibrates in its init container


def test_long_names_leave_room_for_the_worker_index():
    long = "p" * 60
    job = transformer_job(long, "ns", 12, _spec({**SPEC, "transformer": {"parallelism": 64}}))
    assert len(job["metadata"]["name"]) + len("-63") <= MAX_NAME
    assert len(finalize_job(long, "ns", 12, _spec())["metadata"]["name"]) <= MAX_NAME


@pytest.mark.parametrize("transformer, message", [
    ({"parallelism": 0}, "from 1 to 64"),
    ({"parallelism": 65}, "from 1 to 64"),
    ({"parallelism": "4"}, "from 1 to 64"),
    ({"parallelism": True}, "from 1 to 64"),
    ({"parallelism": 2, "args": ["build", "x", "y"]}, "remove spec.transformer.args"),
])
def test_parallelism_that_cannot_work_names_the_field(transformer, message):
    with pytest.raises(InvalidSpec, match=message) as error:
        _spec({**SPEC, "transformer": transformer})
    assert "spec.transformer.parallelism" in str(error.value)


@pytest.mark.parametrize("value, accepted", [(1, True), (8, True), (64, True), (0, False), (-2, False),
                                             (65, False), ("8", False)])
def test_crd_schema_bounds_parallelism(value, accepted):
    obj = {"apiVersion": "moeproxy.io/v1alpha1", "kind": "ProxyModel", "metadata": {"name": "pm", "namespace": "ns"},
           "spec": {**SPEC, "transformer": {"parallelism": value}}}
    found = errors(load_crd("proxymodels.moeproxy.io"), obj)
    assert (found == []) == accepted, found
    assert accepted or any("parallelism" in e for e in found)


def test_an_example_builds_with_several_workers():
    import yaml

    examples = [yaml.safe_load(p.read_text()) for p in sorted((ROOT / "examples").glob("proxymodel-*.yaml"))]
    assert any((e["spec"].get("transformer") or {}).get("parallelism", 1) > 1 for e in examples)


def test_count_indexes():
    assert [count_indexes(x) for x in (None, "", "3", "0-2,5", "0-63")] == [0, 0, 1, 4, 64]


# --- the operator ------------------------------------------------------------------------------


async def _apply(cluster, name: str, **overrides) -> None:
    await cluster.secret(NS, "s3-creds", AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    await cluster.create(PROXYMODELS, NS, proxymodel(name, **overrides))


async def _workers_report(cluster, job: dict, done: list[int], workers: int, complete: bool = False) -> None:
    """Worker pods `done` succeeded (each with its worker report), as the Job controller counts them."""
    for index in done:
        if cluster.get(PODS, NS, f"{job['metadata']['name']}-{index}") is None:  # not reported before
            await cluster.finish_pod(NS, job, "transformer", 0, json.dumps({"worker": index, "workers": workers,
                                                                           "files": 1}), index=index)
    status: dict = {"active": workers - len(done), "succeeded": len(done),
                    "completedIndexes": ",".join(map(str, done))}
    if complete:
        status.update(active=0, conditions=[{"type": "Complete", "status": "True", "reason": "", "message": ""}])
    await cluster.patch(JOBS, NS, job["metadata"]["name"], {"status": status})


async def _judged(operator, job: dict, indexes: list[int], since: int) -> None:
    """The operator's handlers are done with what they saw of `job` and its pods since `since`:
    whatever they were to create, they have (the absence checks that follow are meaningful)."""
    name = job["metadata"]["name"]
    await operator.handled("child_changed", name, since=since)
    for index in indexes:
        await operator.handled("pod_changed", f"{name}-{index}", since=since)


async def test_workers_then_finalize_then_reproduction(cluster, operator):
    await _apply(cluster, "sx", transformer={"parallelism": 3})
    job = await eventually(lambda: cluster.get(JOBS, NS, "sx-transform-g1"), what="the workers' Indexed Job")
    pxm = cluster.get(PROXYMODELS, NS, "sx")
    assert (job["spec"]["completionMode"], job["spec"]["completions"], job["spec"]["parallelism"]) == ("Indexed", 3, 3)
    args = _container(job)["args"]
    assert args[args.index("--worker") + 1] == "$(JOB_COMPLETION_INDEX)" and args[args.index("--workers") + 1] == "3"
    assert job["metadata"]["ownerReferences"][0]["uid"] == pxm["metadata"]["uid"]
    kubernetes_validate.validate({k: v for k, v in job.items() if k != "status"}, K8S, strict=True)
    await eventually(lambda: cluster.status(NS, "sx").get("workers") == "0/3", what="0/3 workers")
    status = cluster.status(NS, "sx")
    assert (status["phase"], status["pipeline"]["transformerStep"]) == ("Transforming", "workers")
    assert cluster.condition(NS, "sx", "ProxyReady")["reason"] == "WorkersRunning"

    # Two of three indexes done: progress, and no finalize Job yet.
    mark = operator.mark()
    await _workers_report(cluster, job, [0, 2], 3)
    await eventually(lambda: cluster.status(NS, "sx").get("workers") == "2/3", what="2/3 workers")
    await _judged(operator, job, [0, 2], mark)
    assert cluster.names(JOBS, NS) == ["sx-transform-g1"] and cluster.status(NS, "sx")["phase"] == "Transforming"

    # All three: the finalize Job, owned like the others.
    await _workers_report(cluster, job, [0, 1, 2], 3, complete=True)
    final = await eventually(lambda: cluster.get(JOBS, NS, "sx-finalize-g1"), what="the finalize Job")
    assert final["metadata"]["ownerReferences"][0]["uid"] == pxm["metadata"]["uid"]
    kubernetes_validate.validate({k: v for k, v in final.items() if k != "status"}, K8S, strict=True)
    finalize_args = _cli("build", _container(final)["args"])
    assert (finalize_args.finalize, finalize_args.workers, finalize_args.worker) == (True, 3, None)
    status = cluster.status(NS, "sx")
    ran = status["pipeline"]
    assert (ran["transformerJob"], ran["transformerStep"]) == ("sx-finalize-g1", "finalize")
    assert status["workers"] == "3/3" and cluster.condition(NS, "sx", "ProxyReady")["reason"] == "Finalizing"
    assert status["phase"] == "Transforming" and "proxy" not in status

    # Finalize reports the proxy: from here on, as after a single build.
    await cluster.finish_pod(NS, final, "finalize", 0, json.dumps(TRANSFORMER_REPORT))
    await cluster.job_condition(NS, "sx-finalize-g1", "Complete")
    await eventually(lambda: cluster.get(JOBS, NS, "sx-repro-g1"), what="the reproduction Job")
    status = cluster.status(NS, "sx")
    assert status["phase"] == "Reproducing" and status["proxy"]["uri"] == TRANSFORMER_REPORT["proxy_uri"]
    assert cluster.condition(NS, "sx", "ProxyReady")["reason"] == "ProxyBuilt"
    expected = ["WorkersCreated", "FinalizeCreated", "ProxyReady", "ReproductionCreated"]
    await eventually(lambda: cluster.event_reasons(NS, "sx") == expected, what=lambda: f"Events {expected}, not "
                     f"{cluster.event_reasons(NS, 'sx')}")  # kopf posts Events from a queue

    # A new spec replaces every child of the old one, the finalize Job included.
    await cluster.patch_spec(PROXYMODELS, NS, "sx", {"transformer": {"parallelism": 2}})
    await eventually(lambda: cluster.names(JOBS, NS) == ["sx-transform-g2"], what="only the new workers' Job")
    assert cluster.get(JOBS, NS, "sx-transform-g2")["spec"]["completions"] == 2
    await eventually(lambda: cluster.status(NS, "sx").get("workers") == "0/2", what="0/2 workers")
    seen = {(c.group, c.resource, c.verb) for c in cluster.emulator.calls if not c.by_test}
    assert not [s for s in seen if not rbac.allowed(*s)]


async def test_a_failed_worker_fails_the_build_naming_the_step(cluster, operator):
    await _apply(cluster, "wf", transformer={"parallelism": 2})
    job = await eventually(lambda: cluster.get(JOBS, NS, "wf-transform-g1"))
    mark = operator.mark()
    await _workers_report(cluster, job, [0], 2)
    await cluster.finish_pod(NS, job, "transformer", 137, reason="OOMKilled", index=1)
    failed = {"type": "Failed", "status": "True", "reason": "MaxFailedIndexesExceeded"}
    await cluster.patch(JOBS, NS, "wf-transform-g1", {"status": {"active": 0, "failed": 1, "failedIndexes": "1",
                                                                 "conditions": [failed]}})
    await eventually(lambda: cluster.status(NS, "wf").get("phase") == "Failed", what="Failed")
    status = cluster.status(NS, "wf")
    assert status["message"].startswith("transformer workers failed: OOMKilled"), status["message"]
    ready = cluster.condition(NS, "wf", "ProxyReady")
    assert (ready["status"], ready["reason"]) == ("False", "OOMKilled") and "worker index(es) 1" in ready["message"]
    warning = await eventually(lambda: [e for e in cluster.objects_of("events", NS) if e["reason"] == "OOMKilled"],
                               what="the OOMKilled Event")  # kopf posts Events from a queue
    assert warning[0]["type"] == "Warning" and "transformer workers failed" in warning[0]["message"]
    await _judged(operator, job, [0, 1], mark)
    assert cluster.names(JOBS, NS) == ["wf-transform-g1"]  # no finalize, no reproduction


async def test_a_failed_finalize_fails_the_build_naming_the_step(cluster, operator):
    await _apply(cluster, "ff", transformer={"parallelism": 2})
    job = await eventually(lambda: cluster.get(JOBS, NS, "ff-transform-g1"))
    await _workers_report(cluster, job, [0, 1], 2, complete=True)
    final = await eventually(lambda: cluster.get(JOBS, NS, "ff-finalize-g1"))
    missing = "worker 1's shard model-00002.safetensors is missing; rerun worker 1"
    mark = operator.mark()
    await cluster.finish_pod(NS, final, "finalize", 2, json.dumps({"error": "CorruptCheckpoint", "message": missing}))
    await cluster.job_condition(NS, "ff-finalize-g1", "Failed", "PodFailurePolicy")
    await eventually(lambda: cluster.status(NS, "ff").get("phase") == "Failed", what="Failed")
    assert cluster.status(NS, "ff")["message"].startswith("finalize failed: CorruptCheckpoint: worker 1's shard")
    assert cluster.condition(NS, "ff", "ProxyReady")["reason"] == "CorruptCheckpoint"
    await _judged(operator, final, [0], mark)
    assert cluster.names(JOBS, NS) == ["ff-finalize-g1", "ff-transform-g1"]  # no reproduction


async def test_calibration_job_before_the_workers(cluster, operator):
    await _apply(cluster, "cx", transformer={"parallelism": 2}, calibration={"samples": 8},
                 pruning={"experts": 16, "method": "saliency"})
    calibrate = await eventually(lambda: cluster.get(JOBS, NS, "cx-calibrate-g1"), what="the calibrate Job")
    await eventually(lambda: cluster.condition(NS, "cx", "ProxyReady").get("reason") == "Calibrating")
    assert _container(calibrate)["args"][0] == "calibrate" and cluster.names(JOBS, NS) == ["cx-calibrate-g1"]
    await cluster.finish_pod(NS, calibrate, "calibrate", 0)
    await cluster.job_condition(NS, "cx-calibrate-g1", "Complete")
    fit = await eventually(lambda: cluster.get(JOBS, NS, "cx-fit-g1"), what="the fit Job after calibration")
    assert "--fit" in _container(fit)["args"] and "--reconstruct" in _container(fit)["args"]
    await eventually(lambda: cluster.condition(NS, "cx", "ProxyReady").get("reason") == "Fitting")
    await cluster.finish_pod(NS, fit, "fit", 0)
    await cluster.job_condition(NS, "cx-fit-g1", "Complete")
    workers = await eventually(lambda: cluster.get(JOBS, NS, "cx-transform-g1"), what="the workers after the fit")
    assert "--calibration" in _container(workers)["args"]
    assert "initContainers" not in workers["spec"]["template"]["spec"]
    assert cluster.status(NS, "cx")["pipeline"]["transformerStep"] == "workers"


async def test_a_failed_calibration_fails_before_any_worker(cluster, operator):
    await _apply(cluster, "cf", transformer={"parallelism": 2}, calibration={}, pruning={"experts": 16, "heal": True})
    calibrate = await eventually(lambda: cluster.get(JOBS, NS, "cf-calibrate-g1"))
    mark = operator.mark()
    await cluster.finish_pod(NS, calibrate, "calibrate", 137, reason="OOMKilled")
    await cluster.job_condition(NS, "cf-calibrate-g1", "Failed", "BackoffLimitExceeded")
    await eventually(lambda: cluster.status(NS, "cf").get("phase") == "Failed", what="Failed")
    assert cluster.status(NS, "cf")["message"].startswith("calibration failed: OOMKilled")
    await _judged(operator, calibrate, [0], mark)
    assert cluster.names(JOBS, NS) == ["cf-calibrate-g1"]


async def test_workers_done_while_suspended_finalize_on_resume(cluster, operator):
    await _apply(cluster, "sp", transformer={"parallelism": 2})
    job = await eventually(lambda: cluster.get(JOBS, NS, "sp-transform-g1"))
    await eventually(lambda: cluster.status(NS, "sp").get("phase") == "Transforming")
    await cluster.patch_spec(PROXYMODELS, NS, "sp", {"suspend": True})
    await eventually(lambda: cluster.status(NS, "sp").get("phase") == "Suspended")
    mark = operator.mark()
    await _workers_report(cluster, job, [0, 1], 2, complete=True)
    await eventually(lambda: cluster.status(NS, "sp").get("workers") == "2/2", what="2/2 while suspended")
    await _judged(operator, job, [0, 1], mark)
    assert cluster.names(JOBS, NS) == ["sp-transform-g1"]  # no new child while suspended
    await cluster.patch_spec(PROXYMODELS, NS, "sp", {"suspend": False})
    await eventually(lambda: cluster.get(JOBS, NS, "sp-finalize-g1"), what="finalize after resuming")
    await eventually(lambda: cluster.condition(NS, "sp", "ProxyReady").get("reason") == "Finalizing")
    assert cluster.status(NS, "sp")["phase"] == "Transforming"
    assert cluster.condition(NS, "sp", "Suspended")["status"] == "False"


async def test_restart_finds_finished_workers_and_a_missing_finalize(cluster, operator):
    await _apply(cluster, "rs", transformer={"parallelism": 2})
    job = await eventually(lambda: cluster.get(JOBS, NS, "rs-transform-g1"))
    await eventually(lambda: cluster.status(NS, "rs").get("phase") == "Transforming")
    await operator.stop()
    await _workers_report(cluster, job, [0, 1], 2, complete=True)  # while the operator is down
    await operator.start()
    await eventually(lambda: cluster.get(JOBS, NS, "rs-finalize-g1"), what="finalize after a restart")
    await operator.stop()
    await cluster.delete(JOBS, NS, "rs-finalize-g1")  # as if the operator had stopped before creating it
    await operator.start()
    await eventually(lambda: cluster.get(JOBS, NS, "rs-finalize-g1"), what="the recorded finalize, created")
    assert cluster.names(JOBS, NS) == ["rs-finalize-g1", "rs-transform-g1"]
