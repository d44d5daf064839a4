"""The runtimes' controllers, as far as a reproduction's rendezvous depends on them.

For each runtime the operator can create a reproduction as, what its controller does with the
workload: the pods it creates from the templates (names, labels, host names, and the env and
volumes it adds to the containers), the objects it creates beside them, and the status it gives
the workload once the pods have ended. The pods are then run by `kubelet.Kubelet`. Kept small:
only what the pods' rendezvous and the operator's verdict read; each injected value cites the
controller code or documentation it comes from.

- batch/v1 Indexed Job (Kubernetes' Job controller);
- Volcano Job with its `env` and `svc` plugins (volcano-sh/volcano, pkg/controllers/job/plugins);
- Ascend MindCluster AscendJob, framework pytorch (Ascend/mind-cluster, component/ascend-operator);
- JobSet (kubernetes-sigs/jobset), KubeRay's RayJob (ray-project/kuberay) and Kubeflow Trainer's
  TrainJob on the torch-distributed runtime (kubeflow/trainer): what they make of the workload,
  and (`STATUSES`) the statuses they write, checked against their published CRDs in
  test_upstream_crds.py. No cluster with these controllers was available: each cites the code
  it follows.
"""

from __future__ import annotations

import copy
import shlex
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from proxymodel_operator.outcome import FAILED, RUNNING, SUCCEEDED
from proxymodel_operator.resources import ASCEND_JOBS, JOB_SETS, RAY_JOBS, SERVICES, TRAIN_JOBS, VOLCANO_JOBS
from proxymodel_operator.runtimes import JOB_COMPLETION_INDEX

from .kubelet import CONFIGMAPS, Pod

ASCEND_MASTER_IP = "10.96.0.20"  # the clusterIP the API server would give the Master's Service


@dataclass
class Started:
    """What a controller made of a workload: its pods, node rank 0's first."""

    pods: list[Pod]
    hosts: list[str]  # the names and addresses the pods reach each other by (127.0.0.1 here)
    container: str  # the reproduction's container


@dataclass(frozen=True)
class Controller:
    start: Callable[[object, str, dict], Awaitable[Started]]  # (api, namespace, workload)
    finish: Callable[[object, str, dict, bool], Awaitable[None]]  # (api, namespace, workload, all pods ok)


def _append_env(container: dict, env: list[dict]) -> None:
    """The controllers append to the template's env: ours comes first, so `$(VAR)` in our env
    cannot name theirs (command and args can)."""
    container["env"] = [*(container.get("env") or []), *env]


# --- batch/v1 Indexed Job ------------------------------------------------------------------------


async def _start_job(api, namespace: str, job: dict) -> Started:
    """Kubernetes' Job controller, completionMode Indexed (kubernetes.io/docs/concepts/workloads/
    controllers/job/#completion-mode): a pod per index, annotated and labelled with it
    (`batch.kubernetes.io/job-completion-index`), `job-name` label, and with a subdomain, the
    hostname `<job>-<index>`. (Its pods' names carry a random suffix: the hostname is what counts.)"""
    name, spec = job["metadata"]["name"], job["spec"]
    template = spec["template"]
    subdomain = template["spec"].get("subdomain", "")
    pods = [Pod(f"{name}-{i}", template, annotations={JOB_COMPLETION_INDEX: str(i)},
                labels={**template["metadata"]["labels"], "job-name": name, JOB_COMPLETION_INDEX: str(i)},
                hostname=f"{name}-{i}", subdomain=subdomain)
            for i in range(spec.get("completions") or 1)]
    hosts = [f"{p.hostname}.{subdomain}" for p in pods] if subdomain else []
    return Started(pods, hosts, template["spec"]["containers"][0]["name"])


async def _finish_job(api, namespace: str, job: dict, ok: bool) -> None:
    await api.job_condition(namespace, job["metadata"]["name"], "Complete" if ok else "Failed",
                            "" if ok else "BackoffLimitExceeded")


# --- Volcano Job, plugins env and svc -------------------------------------------------------------


async def _start_volcano(api, namespace: str, job: dict) -> Started:
    """Volcano's job controller and its plugins, for each task and replica index i:

    - pod name `<job>-<task>-<i>` (helpers.MakePodName), labels `volcano.sh/job-name` and
      `volcano.sh/job-namespace`, annotation `volcano.sh/task-spec` (job_controller_util.createJobPod);
    - env plugin: VK_TASK_INDEX and VC_TASK_INDEX, both i, appended to every container and init
      container (plugins/env/env.go OnPodCreate; i from the pod name, helpers.GetPodIndexUnderTask);
    - svc plugin (plugins/svc/svc.go): ConfigMap `<job>-svc` with, per task, `<task>.host` (the
      hosts one per line), VC_<TASK>_HOSTS (comma-separated) and VC_<TASK>_NUM (GenerateHosts: host
      `<job>-<task>-<i>.<job>`); every container and init container gets VC_<TASK>_HOSTS and
      VC_<TASK>_NUM from it by configMapKeyRef and the ConfigMap mounted at /etc/volcano
      (mountConfigmap); hostname = pod name, subdomain = job name; the headless Service `<job>`
      (createServiceIfNotExist; here its host names point at 127.0.0.1)."""
    name = job["metadata"]["name"]
    config = f"{name}-svc"
    hosts_of = {t["name"]: [f"{name}-{t['name']}-{i}.{name}" for i in range(t["replicas"])]
                for t in job["spec"]["tasks"]}
    data: dict[str, str] = {}
    for task, hosts in hosts_of.items():
        key = task.replace("-", "_")
        data.update({f"{key}.host": "\n".join(hosts), f"VC_{key.upper()}_HOSTS": ",".join(hosts),
                     f"VC_{key.upper()}_NUM": str(len(hosts))})
    await api.create(CONFIGMAPS, namespace, {"metadata": {"name": config}, "data": data})
    from_config = [{"name": key, "valueFrom": {"configMapKeyRef": {"name": config, "key": key}}}
                   for key in data if key.startswith("VC_")]
    pods = []
    for task in job["spec"]["tasks"]:
        for i in range(task["replicas"]):
            pod = copy.deepcopy(task["template"])
            spec = pod["spec"]
            index = [{"name": "VK_TASK_INDEX", "value": str(i)}, {"name": "VC_TASK_INDEX", "value": str(i)}]
            for container in [*spec["containers"], *(spec.get("initContainers") or [])]:
                _append_env(container, index + from_config)
                container.setdefault("volumeMounts", []).append({"name": config, "mountPath": "/etc/volcano"})
            spec.setdefault("volumes", []).append({"name": config, "configMap": {"name": config}})
            pod_name = f"{name}-{task['name']}-{i}"
            spec.setdefault("hostname", pod_name)
            spec.setdefault("subdomain", name)
            pods.append(Pod(pod_name, pod, annotations={"volcano.sh/task-spec": task["name"]},
                            labels={**pod["metadata"]["labels"], "volcano.sh/job-name": name,
                                    "volcano.sh/job-namespace": namespace},
                            hostname=spec["hostname"], subdomain=spec["subdomain"]))
    first = job["spec"]["tasks"][0]["template"]["spec"]["containers"][0]["name"]
    return Started(pods, [h for hosts in hosts_of.values() for h in hosts], first)


async def _finish_volcano(api, namespace: str, job: dict, ok: bool) -> None:
    # policies: PodFailed -> AbortJob (the operator's), so a failed pod aborts the job
    phase = "Completed" if ok else "Aborted"
    await api.patch(VOLCANO_JOBS, namespace, job["metadata"]["name"], {"status": {"state": {"phase": phase}}})


# --- Ascend MindCluster AscendJob, framework pytorch ------------------------------------------------


async def _start_ascend(api, namespace: str, job: dict) -> Started:
    """The ascend-operator (component/ascend-operator/pkg/controllers/v1):

    - the Master's Service `<job>-master-0` (service.go genService), whose clusterIP and port named
      `ascendjob-port` (2222 by default, when the container declares none) are every pod's
      MASTER_ADDR and MASTER_PORT (getMngSvcIpAndPort);
    - pods `<job>-<replica type>-<index>` (pod.go createPodSpec, GenGeneralName);
    - with chips on the Master too (annotation nonWorkerPodMountChipStatus=true, set by
      syncReplicas), the pod rank is the Master's 0 and a Worker's index + 1 (createPodSpec), and
      the NPU replicas are all pods (utils.go getTotalNpuReplicas);
    - appended to the `ascend` container only (env.go setPytorchEnv): LOCAL_WORLD_SIZE = its
      chips, WORLD_SIZE = chips x NPU replicas, LOCAL_RANK = "0,1,..." (utils.go localRankStr),
      MASTER_ADDR, MASTER_PORT, RANK = the pod rank."""
    name, replicas = job["metadata"]["name"], job["spec"]["replicaSpecs"]
    ascend = next(c for c in replicas["Master"]["template"]["spec"]["containers"] if c["name"] == "ascend")
    port = next((p["containerPort"] for p in ascend.get("ports") or [] if p.get("name") == "ascendjob-port"), 2222)
    await api.create(SERVICES, namespace, {
        "metadata": {"name": f"{name}-master-0"},
        "spec": {"clusterIP": ASCEND_MASTER_IP, "ports": [{"name": "ascendjob-port", "port": port}]}})
    chips = int(next(iter(ascend["resources"]["limits"].values())))
    npu_replicas = sum(r["replicas"] for r in replicas.values())
    pods = []
    for rtype, rank_offset in (("Master", 0), ("Worker", 1)):
        for i in range(replicas.get(rtype, {}).get("replicas", 0)):
            pod = copy.deepcopy(replicas[rtype]["template"])
            for container in pod["spec"]["containers"]:
                if container["name"] == "ascend":
                    _append_env(container, [
                        {"name": "LOCAL_WORLD_SIZE", "value": str(chips)},
                        {"name": "WORLD_SIZE", "value": str(chips * npu_replicas)},
                        {"name": "LOCAL_RANK", "value": ",".join(map(str, range(chips)))},
                        {"name": "MASTER_ADDR", "value": ASCEND_MASTER_IP},
                        {"name": "MASTER_PORT", "value": str(port)},
                        {"name": "RANK", "value": str(i + rank_offset)}])
            pod_name = f"{name}-{rtype.lower()}-{i}"
            pods.append(Pod(pod_name, pod, labels={**pod["metadata"]["labels"],
                                                   "training.kubeflow.org/replica-type": rtype.lower(),
                                                   "training.kubeflow.org/replica-index": str(i)},
                            hostname=pod_name))
    return Started(pods, [ASCEND_MASTER_IP], "ascend")


async def _finish_ascend(api, namespace: str, job: dict, ok: bool) -> None:
    cond = {"type": "Succeeded" if ok else "Failed", "status": "True", "reason": "" if ok else "JobFailed",
            "message": ""}
    await api.patch(ASCEND_JOBS, namespace, job["metadata"]["name"], {"status": {"conditions": [cond]}})


CONTROLLERS: dict[str, Controller] = {
    "Job": Controller(_start_job, _finish_job),
    "VolcanoJob": Controller(_start_volcano, _finish_volcano),
    "AscendJob": Controller(_start_ascend, _finish_ascend),
}


# --- JobSet, TrainJob, RayJob -----------------------------------------------------------------------

WHEN = "2026-12-06T08:00:00Z"


def condition(kind: str, reason: str, message: str) -> dict:
    """A metav1.Condition, as JobSet's and the Trainer's controllers write them (all five fields)."""
    return {"type": kind, "status": "True", "reason": reason, "message": message, "lastTransitionTime": WHEN}


# (status, the verdict it means) per runtime and phase: what each controller writes.
STATUSES: dict[str, dict[str, tuple[dict, str]]] = {
    # jobset pkg/constants: AllJobsCompleted, FailedJobs (failurePolicy.maxRestarts 0: no restart first)
    "JobSet": {
        "running": ({"restarts": 0, "replicatedJobsStatus": [
            {"name": "node", "ready": 1, "active": 1, "succeeded": 0, "failed": 0, "suspended": 0}]}, RUNNING),
        "succeeded": ({"restarts": 0, "terminalState": "Completed", "conditions": [
            condition("Completed", "AllJobsCompleted", "jobset completed successfully")]}, SUCCEEDED),
        "failed": ({"restarts": 0, "terminalState": "Failed", "conditions": [
            condition("Failed", "FailedJobs", "jobset failed due to one or more job failures")]}, FAILED),
    },
    # trainer pkg/runtime/framework/plugins/jobset (the JobSet's Completed/Failed, renamed Complete/Failed)
    "TrainJob": {
        "running": ({"jobsStatus": [{"name": "node", "ready": 1, "active": 1, "succeeded": 0, "failed": 0,
                                     "suspended": 0}]}, RUNNING),
        "succeeded": ({"conditions": [condition("Complete", "AllJobsCompleted", "jobset completed successfully")]},
                      SUCCEEDED),
        "failed": ({"conditions": [condition("Failed", "FailedJobs", "jobset failed due to one or more job "
                                             "failures")]}, FAILED),
    },
    # kuberay apis/ray/v1/rayjob_types.go: jobDeploymentStatus Complete whatever the Ray job's end
    "RayJob": {
        "running": ({"jobDeploymentStatus": "Running", "jobStatus": "RUNNING", "jobId": "raysubmit-1",
                     "rayClusterName": "c"}, RUNNING),
        "succeeded": ({"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED", "jobId": "raysubmit-1",
                       "message": "Job finished successfully."}, SUCCEEDED),
        "failed": ({"jobDeploymentStatus": "Failed", "jobStatus": "", "reason": "DeadlineExceeded",
                    "message": "The RayJob has passed the activeDeadlineSeconds."}, FAILED),
        "complete but FAILED": ({"jobDeploymentStatus": "Complete", "jobStatus": "FAILED", "reason": "AppFailed",
                                 "jobId": "raysubmit-1", "message": "Job entrypoint command failed with exit "
                                 "code 1"}, FAILED),
    },
}


def _indexed_pods(name: str, template: dict, count: int, labels: dict) -> list[Pod]:
    """A JobSet's replicated Job `node` (index 0): pods `<jobset>-node-0-<i>`, hostname that, subdomain
    the JobSet (jobset pkg/controllers/pod_controller, jobset_controller constructJob: the Job
    `<jobset>-node-0`, Indexed; with network.enableDNSHostnames the pod subdomain is the JobSet)."""
    return [Pod(f"{name}-node-0-{i}", template, annotations={JOB_COMPLETION_INDEX: str(i)},
                labels={**template["metadata"]["labels"], **labels, JOB_COMPLETION_INDEX: str(i)},
                hostname=f"{name}-node-0-{i}", subdomain=name)
            for i in range(count)]


async def _start_jobset(api, namespace: str, js: dict) -> Started:
    name = js["metadata"]["name"]
    [rj] = js["spec"]["replicatedJobs"]
    template = rj["template"]["spec"]["template"]
    pods = _indexed_pods(name, template, rj["template"]["spec"]["completions"],
                         {"jobset.sigs.k8s.io/jobset-name": name, "jobset.sigs.k8s.io/replicatedjob-name": "node"})
    return Started(pods, [f"{p.hostname}.{name}" for p in pods], template["spec"]["containers"][0]["name"])


async def _finish_jobset(api, namespace: str, js: dict, ok: bool) -> None:
    await api.patch_status(JOB_SETS, namespace, js["metadata"]["name"],
                           STATUSES["JobSet"]["succeeded" if ok else "failed"][0])


async def _start_trainjob(api, namespace: str, tj: dict) -> Started:
    """The Trainer's torch plugin on the torch-distributed runtime (plugins/torch/torch.go): the
    trainer's image, command, args, env and resourcesPerNode on the `node` container of the
    runtime's replicated Job `node`, then PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK (the
    completion index), PET_MASTER_ADDR `<trainjob>-node-0-0.<trainjob>`, PET_MASTER_PORT 29400;
    the runtime patches (our labels, volumes) merged in; the JobSet has the TrainJob's name."""
    name, spec = tj["metadata"]["name"], tj["spec"]
    [patch] = spec["runtimePatches"]
    [job] = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    pod = copy.deepcopy(job["template"]["spec"]["template"])
    trainer = spec["trainer"]
    mounts = next((c.get("volumeMounts") for c in pod["spec"].pop("containers", []) if c["name"] == "node"), None)
    container = {"name": "node", "image": trainer.get("image", "pytorch"), "command": trainer.get("command"),
                 "args": trainer.get("args"), "env": copy.deepcopy(trainer.get("env") or []),
                 "resources": trainer.get("resourcesPerNode") or {}, "volumeMounts": mounts or []}
    _append_env(container, [
        {"name": "PET_NNODES", "value": str(trainer["numNodes"])},
        {"name": "PET_NPROC_PER_NODE", "value": str(trainer["numProcPerNode"])},
        {"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {
            "fieldPath": f"metadata.annotations['{JOB_COMPLETION_INDEX}']"}}},
        {"name": "PET_MASTER_ADDR", "value": f"{name}-node-0-0.{name}"},
        {"name": "PET_MASTER_PORT", "value": "29400"}])
    pod["spec"]["containers"] = [container]
    pods = _indexed_pods(name, pod, trainer["numNodes"], {"jobset.sigs.k8s.io/jobset-name": name})
    return Started(pods, [f"{p.hostname}.{name}" for p in pods], "node")


async def _finish_trainjob(api, namespace: str, tj: dict, ok: bool) -> None:
    await api.patch_status(TRAIN_JOBS, namespace, tj["metadata"]["name"],
                           STATUSES["TrainJob"]["succeeded" if ok else "failed"][0])


async def _start_rayjob(api, namespace: str, rj: dict) -> Started:
    """KubeRay: a RayCluster `<rayjob>-<random>` with the head pod and the workers' pods (`ray start`
    in their first container), then the submitter (K8sJobMode) runs `ray job submit -- ENTRYPOINT`,
    whose driver runs on the head. Here the head's container runs the entrypoint itself (standing in
    for `ray start` and the driver on it), the workers' containers nothing."""
    name, cluster = rj["metadata"]["name"], rj["spec"]["rayClusterSpec"]
    head = copy.deepcopy(cluster["headGroupSpec"]["template"])
    entry = rj["spec"]["entrypoint"]
    # A plain command line runs as its words (the test kubelet then finds python3 and moe-proxy here);
    # one with shell variables through the shell. MASTER_PORT: the port the kubelet gives it.
    head["spec"]["containers"][0]["command"] = shlex.split(entry) if "$" not in entry else ["/bin/sh", "-c", entry]
    _append_env(head["spec"]["containers"][0], [{"name": "MASTER_PORT", "value": "29500"}])
    pods = [Pod(f"{name}-head", head, labels={**head["metadata"]["labels"], "ray.io/node-type": "head"},
                hostname=f"{name}-head")]
    for group in cluster.get("workerGroupSpecs") or []:
        worker = copy.deepcopy(group["template"])
        worker["spec"]["containers"][0]["command"] = ["/bin/sh", "-c", "true"]
        pods += [Pod(f"{name}-{group['groupName']}-{i}", worker,
                     labels={**worker["metadata"]["labels"], "ray.io/node-type": "worker"})
                 for i in range(group["replicas"])]
    return Started(pods, [], head["spec"]["containers"][0]["name"])


async def _finish_rayjob(api, namespace: str, rj: dict, ok: bool) -> None:
    await api.patch_status(RAY_JOBS, namespace, rj["metadata"]["name"],
                           STATUSES["RayJob"]["succeeded" if ok else "complete but FAILED"][0])


CONTROLLERS.update({
    "JobSet": Controller(_start_jobset, _finish_jobset),
    "TrainJob": Controller(_start_trainjob, _finish_trainjob),
    "RayJob": Controller(_start_rayjob, _finish_rayjob),
})
