"""Kubeflow Trainer's TrainJob (trainer.kubeflow.org/v1alpha1) and the JobSet it runs on
(jobset.x-k8s.io/v1alpha2) as a reproduction's workload: built from the one pod template.

- JobSet: one replicated Job (`node`, one replica) that is the Indexed Job a batch/v1 runtime
  would be: a pod per node, the node rank its completion index, pods `<jobset>-node-0-<i>`
  under the JobSet's own headless Service `<jobset>` (its network.enableDNSHostnames), node 0
  the master. No restart: failurePolicy.maxRestarts 0.
- TrainJob: a ClusterTrainingRuntime (torch-distributed: its replicated Job `node`, container
  `node`) names the pods; the TrainJob gives the trainer's image, command, args, env and
  numNodes x numProcPerNode with the resources per node. The Trainer's torch plugin sets
  PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK (the completion index), PET_MASTER_ADDR
  (`<trainjob>-node-0-0.<trainjob>`) and PET_MASTER_PORT (29400) in the `node` container.
  The repro reads the proxy from S3 itself (no model initializer). The pod template's labels,
  volumes and placement reach the pods through a runtime patch (runtimePatches, manager
  moeproxy.io/operator).

Pure data and functions: no import of `runtimes` (whose table names them).
"""

from __future__ import annotations

import copy

from .spec_types import ProxyModelSpec

NODE = "node"  # the replicated Job's name (JobSet here, torch-distributed's for a TrainJob) and its container
TRAINER_GROUP = "trainer.kubeflow.org"
TRAINER_PORT = 29400  # the Trainer's constants.ContainerTrainerPort: PET_MASTER_PORT
PATCH_MANAGER = "moeproxy.io/operator"
_PATCHED_POD = ("affinity", "imagePullSecrets", "nodeSelector", "serviceAccountName", "tolerations", "volumes",
                "terminationGracePeriodSeconds", "securityContext")  # what a runtime patch may set on the pods


def _indexed(spec: ProxyModelSpec, pods: int, template: dict) -> dict:
    if spec.reproduction.scheduler_name:
        template["spec"]["schedulerName"] = spec.reproduction.scheduler_name
    job: dict = {"completionMode": "Indexed", "completions": pods, "parallelism": pods, "backoffLimit": 0,
                 "template": template}
    return {**job, **spec.reproduction.workload.deadline()}


def job_set(spec: ProxyModelSpec, pods: int, template: dict) -> dict:
    """A JobSet of one replicated Job: an Indexed Job of `pods` pods, none restarted."""
    out: dict = {
        "replicatedJobs": [{"name": NODE, "replicas": 1, "template": {"spec": _indexed(spec, pods, template)}}],
        "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},  # ranks meet before ready
        "failurePolicy": {"maxRestarts": 0},
        "successPolicy": {"operator": "All"},
    }
    if spec.ttl_seconds_after_finished is not None:
        out["ttlSecondsAfterFinished"] = spec.ttl_seconds_after_finished
    return {**out, **spec.admission()}


def job_set_templates(spec: dict) -> list[dict]:
    return [rj["template"]["spec"]["template"] for rj in spec["replicatedJobs"]]


def _runtime_patch(template: dict) -> dict:
    """The pod template's labels, volumes and placement on the runtime's `node` pods."""
    pod = template["spec"]
    patched = {k: copy.deepcopy(pod[k]) for k in _PATCHED_POD if pod.get(k)}
    mounts = pod["containers"][0].get("volumeMounts")
    if mounts:
        patched["containers"] = [{"name": NODE, "volumeMounts": copy.deepcopy(mounts)}]
    job_template = {"metadata": {"labels": dict(template["metadata"]["labels"])}, "spec": patched}
    return {"manager": PATCH_MANAGER, "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [
        {"name": NODE, "template": {"spec": {"template": job_template}}}]}}}}


def train_job(spec: ProxyModelSpec, pods: int, template: dict) -> dict:
    """A TrainJob on the ClusterTrainingRuntime spec.reproduction.trainingRuntime names."""
    r = spec.reproduction
    first = template["spec"]["containers"][0]
    trainer = {k: copy.deepcopy(first[k]) for k in ("image", "command", "args", "env") if first.get(k)}
    trainer.update(numNodes=pods, numProcPerNode=int(first["resources"]["limits"][r.accelerator.resource]),
                   resourcesPerNode=copy.deepcopy(first.get("resources") or {}))
    out: dict = {
        "runtimeRef": {"name": r.training_runtime, "apiGroup": TRAINER_GROUP, "kind": "ClusterTrainingRuntime"},
        "trainer": trainer,
        "runtimePatches": [_runtime_patch(template)],
    }
    return {**out, **r.workload.deadline(), **spec.admission()}


def train_job_templates(spec: dict) -> list[dict]:
    """The `node` pods as the runtime patch and the trainer make them (the runtime's own image
    and settings aside): the labels, the trainer container with its resources."""
    [patch] = [p for p in spec.get("runtimePatches") or [] if p.get("manager") == PATCH_MANAGER]
    [job] = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    pod = copy.deepcopy(job["template"]["spec"]["template"])
    trainer = spec["trainer"]
    container = {"name": NODE, **{k: trainer[k] for k in ("image", "command", "args", "env") if k in trainer},
                 "resources": trainer.get("resourcesPerNode") or {}}
    pod["spec"] = {k: v for k, v in pod["spec"].items() if k != "containers"} | {"containers": [container]}
    return [pod]
