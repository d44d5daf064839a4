"""RayJob, TrainJob and JobSet through kopf and the API emulator, their controllers played by
`controllers.py` (statuses as the upstream controllers write them, checked against their CRDs in
test_upstream_crds.py):

- a ProxyModel with each runtime: its workload is what the upstream CRD accepts, labelled with its
  Kueue queue and created suspended; running, then succeeded with the pods' verdict, reaches the
  status; a failed workload (a RayJob `Complete` whose Ray job FAILED among them) fails it with the
  controller's reason;
- a Diagnosis with each runtime: its runs are that runtime's workloads (with the Diagnosis's queue),
  judged as the Job's are;
- a runtime whose CRD the cluster does not serve: a clear condition naming what to install, once,
  no retry;
- a CheckpointWatch's template with a queue name: the ProxyModels it makes carry it to their Jobs.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import kmock
import pytest

from proxymodel_operator import diagnosis
from proxymodel_operator.diagnosis_runs import LABEL_DIAGNOSIS
from proxymodel_operator.resources import DIAGNOSES, JOBS, KUEUE_QUEUE_LABEL, PODS, PROXYMODELS
from proxymodel_operator.runtimes import RUNTIME_MISSING, RUNTIMES

from .controllers import CONTROLLERS, STATUSES
from .harness import ACCESS_KEY, SECRET_KEY, eventually, proxymodel, registry_copy
from .test_upstream_crds import VERL, upstream_errors

NS = "team-rt"
TICK = 0.3
NEW = ("RayJob", "TrainJob", "JobSet")
# One node for a RayJob's `moe-proxy repro` (the driver on the head); two for the others.
SIZES = {"RayJob": {"devices": 8, "devicesPerNode": 8}, "TrainJob": {"devices": 16, "devicesPerNode": 8},
         "JobSet": {"devices": 16, "devicesPerNode": 8}}


@pytest.fixture()
def registry():
    """The ProxyModel handlers and the Diagnosis timer."""
    registry = registry_copy()
    diagnosis.register(TICK, registry)
    return registry


def _report(reproduced: bool, step: int | None = None) -> str:
    return json.dumps({"reproduced": reproduced, "signature": "nan" if reproduced else None, "step": step,
                       "metrics": {}})


async def _built(cluster, name: str, runtime: str, **spec) -> dict:
    """The ProxyModel `name` on `runtime`, its proxy built: its reproduction workload."""
    await cluster.secret(NS, "s3-creds", AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    reproduction = {"runtime": runtime, "maxSteps": 5, "failOn": {"signature": "nan"},
                    "accelerator": SIZES[runtime], **spec.pop("reproduction", {})}
    await cluster.create(PROXYMODELS, NS, proxymodel(name, reproduction=reproduction, **spec))
    transformer = await eventually(lambda: cluster.get(JOBS, NS, f"{name}-transform-g1"), 30, "transformer Job")
    await cluster.transformer_succeeds(NS, transformer)
    resource = RUNTIMES[runtime].resource
    return await eventually(lambda: cluster.get(resource, NS, f"{name}-repro-g1"), 30, f"the {runtime}")


async def _pods_end(cluster, runtime: str, workload: dict, message: str, exit_code: int = 0) -> None:
    """The controller's pods, ended as the kubelet would report them: node 0's reproduction
    container (or watcher) with `message`, the others with none."""
    started = await CONTROLLERS[runtime].start(cluster, NS, workload)
    for i, pod in enumerate(started.pods):
        await cluster.create(PODS, NS, {
            "metadata": {"name": pod.name, "labels": pod.labels, "annotations": pod.annotations},
            "spec": {"containers": [{"name": started.container, "image": "x"}]},
            "status": {"phase": "Succeeded" if exit_code == 0 else "Failed", "containerStatuses": [{
                "name": started.container, "state": {"terminated": {
                    "exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error",
                    "message": message if i == 0 else ""}}}]}})


async def _status(cluster, runtime: str, workload: dict, phase: str) -> None:
    await cluster.patch_status(RUNTIMES[runtime].resource, NS, workload["metadata"]["name"],
                               STATUSES[runtime][phase][0])


@pytest.mark.parametrize("runtime", NEW)
async def test_a_proxymodel_runs_on_each_runtime_and_its_verdict_is_read(cluster, operator, runtime):
    name = f"ok-{runtime.lower()}"
    workload = await _built(cluster, name, runtime, queueName="team-queue")
    assert upstream_errors(runtime, workload) == []
    assert workload["metadata"]["labels"][KUEUE_QUEUE_LABEL] == "team-queue" and workload["spec"]["suspend"] is True
    transformer = cluster.get(JOBS, NS, f"{name}-transform-g1")  # the build too waits for Kueue
    assert transformer["metadata"]["labels"][KUEUE_QUEUE_LABEL] == "team-queue"
    assert transformer["spec"]["suspend"] is True

    await _status(cluster, runtime, workload, "running")  # Kueue admitted it; it runs
    await asyncio.sleep(1)
    assert cluster.status(NS, name)["phase"] == "Reproducing"
    await _pods_end(cluster, runtime, workload, _report(True, 3))
    await _status(cluster, runtime, workload, "succeeded")
    await eventually(lambda: cluster.status(NS, name).get("phase") == "Reproduced", 30, "the verdict in status")
    result = cluster.status(NS, name)["reproduction"]
    assert (result["signature"], result["step"]) == ("nan", 3)


FAILURES = [("RayJob", "complete but FAILED", "AppFailed"), ("RayJob", "failed", "DeadlineExceeded"),
            ("TrainJob", "failed", "FailedJobs"), ("JobSet", "failed", "FailedJobs")]


@pytest.mark.parametrize("runtime, phase, reason", FAILURES)
async def test_a_failed_workload_fails_the_proxymodel_with_its_reason(cluster, operator, runtime, phase, reason):
    name = f"bad-{runtime.lower()}-{phase.split()[0]}"
    workload = await _built(cluster, name, runtime)
    await _status(cluster, runtime, workload, "running")
    await _pods_end(cluster, runtime, workload, "", exit_code=1)
    await _status(cluster, runtime, workload, phase)
    await eventually(lambda: cluster.status(NS, name).get("phase") == "Failed", 30, "the failure in status")
    assert reason in json.dumps(cluster.status(NS, name)["conditions"])


async def test_a_frameworks_rayjob_takes_the_watchers_verdict_from_the_head(cluster, operator):
    """verl on a RayJob: the watcher on the head says `nan` at step 3, while the Ray job FAILED (verl
    raised on the NaN): the verdict is the watcher's."""
    workload = await _built(cluster, "verl", "RayJob", reproduction={"template": VERL})
    head = workload["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    assert [c["name"] for c in head["initContainers"]] == ["moe-proxy-watch"]
    assert workload["spec"]["entrypoint"].startswith("python3 -m verl.trainer.main_ppo")
    started = await CONTROLLERS["RayJob"].start(cluster, NS, workload)
    head_pod = started.pods[0]
    await cluster.create(PODS, NS, {
        "metadata": {"name": head_pod.name, "labels": head_pod.labels},
        "spec": {"containers": [{"name": "ray-head", "image": "x"}]},
        "status": {"phase": "Succeeded", "containerStatuses": [
            {"name": "moe-proxy-watch", "state": {"terminated": {"exitCode": 0, "reason": "Completed",
                                                                 "message": _report(True, 3)}}},
            {"name": "ray-head", "state": {"terminated": {"exitCode": 0, "reason": "Completed", "message": ""}}}]}})
    await _status(cluster, "RayJob", workload, "complete but FAILED")
    await eventually(lambda: cluster.status(NS, "verl").get("phase") == "Reproduced", 30, "the watcher's verdict")


@pytest.mark.parametrize("runtime", NEW)
async def test_a_diagnosis_runs_its_matrix_on_each_runtime(cluster, operator, runtime):
    resource = RUNTIMES[runtime].resource
    await _built(cluster, "pm", runtime)
    await cluster.create(DIAGNOSES, NS, {"metadata": {"name": "dx"}, "spec": {
        "proxyModel": "pm", "seeds": 1, "parallelism": 2, "candidates": ["lower-lr"], "queueName": "diag-queue"}})
    for variant in ("baseline", "lower-lr"):  # the baseline first: candidates once it reproduced
        run = await eventually(lambda v=variant: cluster.get(resource, NS, f"dx-{v}-s0"), 30, variant)
        assert run["metadata"]["labels"][LABEL_DIAGNOSIS] == "dx"
        assert run["metadata"]["labels"][KUEUE_QUEUE_LABEL] == "diag-queue" and run["spec"]["suspend"] is True
        assert upstream_errors(runtime, run) == []
        await _status(cluster, runtime, run, "running")
        await _pods_end(cluster, runtime, run, _report(variant == "baseline", 2 if variant == "baseline" else None))
        await _status(cluster, runtime, run, "succeeded")
    await eventually(lambda: ((cluster.get(DIAGNOSES, NS, "dx") or {}).get("status") or {}).get("phase")
                     == "Complete", 30, "the diagnosis complete")
    status = cluster.get(DIAGNOSES, NS, "dx")["status"]
    assert {c["name"]: c["verdict"] for c in status["candidates"]} == {"lower-lr": "fixed"}


def not_served(cluster, plural: str) -> list:
    """The emulator answers for `plural` as an API server without its CRD does (404 NotFound);
    the creates tried on it, listed."""
    handle, creates = cluster.emulator._handle, []

    async def answer(request):
        if request.resource is not None and request.resource.plural == plural:
            creates.extend([request.action] if request.action == kmock.action.CREATE else [])
            return aiohttp.web.json_response(status=404, data={
                "kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404,
                "message": "the server could not find the requested resource"})
        return await handle(request)

    object.__setattr__(cluster.emulator, "_handle", answer)
    return creates


async def test_a_runtime_the_cluster_does_not_serve_is_a_clear_condition(cluster, operator):
    """KubeRay not installed: the API answers 404 for rayjobs; the ProxyModel fails once with
    RuntimeNotInstalled naming KubeRay, and nothing is tried again."""
    creates = not_served(cluster, "rayjobs")  # KubeRay not installed
    await cluster.secret(NS, "s3-creds", AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    await cluster.create(PROXYMODELS, NS, proxymodel("noray", reproduction={
        "runtime": "RayJob", "accelerator": SIZES["RayJob"], "failOn": {"signature": "nan"}}))
    transformer = await eventually(lambda: cluster.get(JOBS, NS, "noray-transform-g1"), 30, "transformer Job")
    await cluster.transformer_succeeds(NS, transformer)
    await eventually(lambda: cluster.status(NS, "noray").get("phase") == "Failed", 30, "the refusal")
    [cond] = [c for c in cluster.status(NS, "noray")["conditions"] if c.get("reason") == RUNTIME_MISSING]
    assert cond["status"] == "False" and "KubeRay" in cond["message"] and "rayjobs.ray.io/v1" in cond["message"]
    await asyncio.sleep(2)
    assert len(creates) == 1  # tried once: no retry, no crash loop


async def test_a_diagnosis_on_a_runtime_the_cluster_does_not_serve_says_what_to_install(cluster, operator):
    not_served(cluster, "jobsets")  # no JobSet controller: its CRD is not there
    await cluster.secret(NS, "s3-creds", AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    await cluster.create(PROXYMODELS, NS, proxymodel("pj", reproduction={
        "runtime": "JobSet", "accelerator": SIZES["JobSet"], "failOn": {"signature": "nan"}}))
    transformer = await eventually(lambda: cluster.get(JOBS, NS, "pj-transform-g1"), 30, "transformer Job")
    await cluster.transformer_succeeds(NS, transformer)
    await cluster.create(DIAGNOSES, NS, {"metadata": {"name": "dj"}, "spec": {
        "proxyModel": "pj", "seeds": 1, "candidates": ["lower-lr"]}})

    def refused() -> str:
        status = (cluster.get(DIAGNOSES, NS, "dj") or {}).get("status") or {}
        return json.dumps(status) if status.get("phase") == "Failed" else ""

    status = await eventually(refused, 30, "the diagnosis failed, naming JobSet")
    assert "install JobSet" in status and "jobsets.jobset.x-k8s.io/v1alpha2" in status  # no retry, no crash


async def test_a_rayjob_that_ended_waits_for_its_heads_verdict(cluster, operator):
    """KubeRay says the job ended while the head pod (its watcher holding the verdict) still runs,
    until the cluster is shut down ttlSecondsAfterFinished later: the verdict waits for the pod's
    end, taken from its last state even as the pod is deleted."""
    workload = await _built(cluster, "late", "RayJob", reproduction={"template": VERL})
    assert workload["spec"]["ttlSecondsAfterFinished"] == 300 and workload["spec"]["shutdownAfterJobFinishes"]
    head = (await CONTROLLERS["RayJob"].start(cluster, NS, workload)).pods[0]
    running = {"phase": "Running", "containerStatuses": [
        {"name": "moe-proxy-watch", "state": {"running": {"startedAt": "2026-12-06T08:00:00Z"}}},
        {"name": "ray-head", "state": {"running": {"startedAt": "2026-12-06T08:00:00Z"}}}]}
    await cluster.create(PODS, NS, {"metadata": {"name": head.name, "labels": head.labels},
                                    "spec": {"containers": [{"name": "ray-head", "image": "x"}]}, "status": running})
    await _status(cluster, "RayJob", workload, "succeeded")
    await eventually(lambda: cluster.condition(NS, "late", "FailureReproduced").get("reason") == "WaitingForVerdict",
                     30, "waiting for the head's verdict")
    assert cluster.status(NS, "late")["phase"] == "Reproducing"
    # the cluster is shut down: the watcher writes its verdict as the pod ends, and the pod goes
    ended = {"phase": "Succeeded", "containerStatuses": [
        {"name": "moe-proxy-watch", "state": {"terminated": {"exitCode": 0, "reason": "Completed",
                                                             "message": _report(True, 4)}}},
        {"name": "ray-head", "state": {"terminated": {"exitCode": 143, "reason": "Error", "message": ""}}}]}
    await cluster.patch_status(PODS, NS, head.name, ended)
    await cluster.delete(PODS, NS, head.name)
    await eventually(lambda: cluster.status(NS, "late").get("phase") == "Reproduced", 30, "the head's verdict")
    assert cluster.status(NS, "late")["reproduction"]["step"] == 4
