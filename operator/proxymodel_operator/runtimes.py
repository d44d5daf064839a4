"""The workload kinds a reproduction runs as (spec.reproduction.runtime), as one table.

Each entry says what differs between them: the API resource, how its spec is built around
the one pod template (`reproduction.pod_template`), what its controller needs on that
template, how its status says it finished, and where its pod templates sit. Everything else
(the pod template, placement, naming, labels, reading pods) is shared.

The table is the one place: `rbac.PERMISSIONS` grants each entry's resource, the handlers
watch and delete each one, and tests check that the CRD's `spec.reproduction.runtime` enum
names exactly these. A new runtime is one entry here, plus the enum and its chart value
(`feature`: runtimes.<feature>.enabled grants its RBAC and has the operator serve it).
Pure data and functions: the batch/v1 Job is also the transformer's workload.

Each entry also says how its pods find each other (`Rendezvous`): one pod per node, node 0
the master, the node rank from the completion index (batch/v1 Job, with a headless Service
the operator creates; a JobSet's replicated Job, with the JobSet's Service), Volcano's task
index (its `env` and `svc` plugins), the Ascend operator's own environment (RANK,
MASTER_ADDR, MASTER_PORT), the Kubeflow Trainer's PET_* variables (TrainJob), or Ray's own
cluster (RayJob: the head is node 0). The newer runtimes' builders live in runtimes_ray.py
(RayJob) and runtimes_kubeflow.py (TrainJob, JobSet).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

from functools import partial

from . import runtimes_kubeflow as kubeflow
from . import runtimes_ray as ray
from .resources import ASCEND_JOBS, JOB_SETS, JOBS, RAY_JOBS, SERVICES, TRAIN_JOBS, VOLCANO_JOBS, Resource
from .spec_types import ProxyModelSpec

ASCEND_RING_LABEL = "ring-controller.atlas"
JOB_COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"  # an Indexed Job pod's annotation
VOLCANO_TASK = "worker"  # the one task of a reproduction's Volcano Job
WATCHER = "moe-proxy-watch"  # the init container (native sidecar) that judges a user's framework
MASTER_PORT = 29500  # torch.distributed's usual port (the Ascend operator sets its own)
RUNTIME_MISSING = "RuntimeNotInstalled"  # the reason when the cluster does not serve a runtime's resource


@dataclass(frozen=True)
class Conditions:
    """Finished when a condition of one of these types is True (batch/v1 Job, AscendJob)."""

    succeeded: str
    failed: str


@dataclass(frozen=True)
class Phase:
    """Finished by a phase field (Volcano: status.state.phase); its reason and message sit beside it."""

    path: tuple[str, ...]  # under status
    succeeded: tuple[str, ...]
    failed: tuple[str, ...]
    pending: tuple[str, ...] = ()  # with a reason, still running but worth reporting (gang unschedulable)


@dataclass(frozen=True)
class Fields:
    """Finished as a function of the whole object says (RayJob: jobDeploymentStatus and jobStatus
    together): (Running | Succeeded | Failed, reason, message)."""

    read: Callable[[dict], tuple[str, str, str]]


def _nothing(spec: ProxyModelSpec) -> dict:
    return {}


def _no_env(spec: ProxyModelSpec) -> list[dict]:
    return []


@dataclass(frozen=True)
class Rendezvous:
    """How a runtime's pods (one per node) find each other for one torch.distributed run."""

    # The variable that holds the pod's node rank when its containers run: NODE_RANK where the
    # operator declares it from a pod field (`node_rank_field`), else the runtime's own, which
    # its controller appends to the containers' env (after ours, so `$(VAR)` in our env cannot
    # name it; in command and args it can).
    node_rank: str
    # (workload name, pods) -> node 0's host name; None: the runtime injects MASTER_ADDR.
    master: Callable[[str, int], str] | None
    # The pods' host names: `<workload><suffix><index>` (a DNS label: at most 63 characters).
    hostname_suffix: str
    service: bool = False  # the operator creates the headless Service the pods' host names need
    # Variables the runtime sets with other meanings than torchrun's: unset before our launcher.
    clears: tuple[str, ...] = ()
    # The node rank in an init container (the watch sidecar); None: only node 0's pod has one.
    init_node_rank: str | None = None
    node_rank_field: str | None = None  # the downward API path NODE_RANK is declared from
    # The variables holding node 0's address and port when the runtime sets its own (`master` None).
    master_addr: str = "MASTER_ADDR"
    master_port: str = "MASTER_PORT"
    # False: the runtime starts its own processes on every node (Ray): one command, on node 0.
    per_node: bool = True


@dataclass(frozen=True)
class Runtime:
    name: str  # the spec.reproduction.runtime value
    resource: Resource
    why: str  # the reason its RBAC permission gives
    state: Conditions | Phase | Fields
    # (spec, pods: one per node, the pod template) -> the workload's `spec`
    build: Callable[[ProxyModelSpec, int, dict], dict]
    pod_templates: Callable[[dict], list[dict]]  # the workload's spec -> its pod templates, the first pod's first
    container: str | None = None  # a first-container name its device plugin requires (a user's is renamed)
    kueue: bool = False  # Kueue admits it by the queue-name label
    labels: Callable[[ProxyModelSpec], dict] = _nothing  # on the workload, for its controller
    pod_labels: Callable[[ProxyModelSpec], dict] = _nothing  # on its pods
    pod_env: Callable[[ProxyModelSpec], list[dict]] = _no_env  # for its containers
    rendezvous: Rendezvous = Rendezvous("NODE_RANK", None, "-")
    # What to install when the cluster does not serve `resource` (the API answers 404 for it).
    install: str = ""
    # The chart value (runtimes.<feature>) that turns it on, its RBAC with it; empty: always on.
    feature: str = ""
    # Its pods outlive the workload's end (a RayJob's cluster goes ttlSecondsAfterFinished later):
    # the verdict, a termination message, is there only once they end, so it is waited for.
    pods_outlive: bool = False


# --- batch/v1 Job: one pod, or an Indexed Job of one pod per node --------------------------------


def _job(spec: ProxyModelSpec, pods: int, template: dict) -> dict:
    r = spec.reproduction
    if r.scheduler_name:
        template["spec"]["schedulerName"] = r.scheduler_name
    job: dict = {"backoffLimit": r.workload.backoff_limit, "template": template, **spec.admission()}
    if pods > 1:  # pods <job>-<index>: the completion index is the node rank
        job.update(completionMode="Indexed", completions=pods, parallelism=pods)
    job.update(r.workload.deadline())
    if spec.ttl_seconds_after_finished is not None:
        job["ttlSecondsAfterFinished"] = spec.ttl_seconds_after_finished
    return job


# --- Volcano Job: a gang of one pod per node -----------------------------------------------------


def _volcano_job(spec: ProxyModelSpec, pods: int, template: dict) -> dict:
    r = spec.reproduction
    vc: dict = {
        "schedulerName": r.scheduler_name or "volcano",
        "minAvailable": pods,  # gang: all pods start together or none does
        "maxRetry": r.workload.backoff_limit,
        # env: VC_TASK_INDEX; svc: host name <job>-worker-<i>, subdomain <job>, its headless
        # Service, VC_WORKER_HOSTS (published before the pods are ready: the ranks meet at start)
        "plugins": {"env": [], "svc": ["--publish-not-ready-addresses"]},
        "policies": [{"event": "PodFailed", "action": "AbortJob"}],
        "tasks": [{"name": VOLCANO_TASK, "replicas": pods, "template": template}],
    }
    if r.volcano_queue:
        vc["queue"] = r.volcano_queue
    if spec.ttl_seconds_after_finished is not None:
        vc["ttlSecondsAfterFinished"] = spec.ttl_seconds_after_finished
    return vc


# --- Ascend MindCluster AscendJob: Master + Workers, container `ascend` ----------------------------


def _ring(spec: ProxyModelSpec) -> dict:
    """The ring-controller label its controller wants on the job and on every pod template."""
    return {ASCEND_RING_LABEL: "ascend-910b" if "910" in spec.reproduction.accelerator.resource else "ascend-npu"}


def _ascend_env(spec: ProxyModelSpec) -> list[dict]:
    return [{"name": "ASCEND_VISIBLE_DEVICES", "valueFrom": {"fieldRef": {
        "fieldPath": f"metadata.annotations['{spec.reproduction.accelerator.resource}']"}}}]


def _ascend_job(spec: ProxyModelSpec, pods: int, template: dict) -> dict:
    r = spec.reproduction
    replicas = {"Master": {"replicas": 1, "restartPolicy": "Never", "template": template}}
    if pods > 1:  # the Master is node rank 0: only its pod holds the metrics, and a watcher
        worker = copy.deepcopy(template)
        inits = [c for c in worker["spec"].pop("initContainers", []) if c["name"] != WATCHER]
        if inits:
            worker["spec"]["initContainers"] = inits
        replicas["Worker"] = {"replicas": pods - 1, "restartPolicy": "Never", "template": worker}
    policy: dict = {"minAvailable": pods}
    if r.volcano_queue:
        policy["queue"] = r.volcano_queue
    return {
        "schedulerName": r.scheduler_name or "volcano",
        "runPolicy": {"backoffLimit": r.workload.backoff_limit, "schedulingPolicy": policy},
        "successPolicy": "AllWorkers",
        "replicaSpecs": replicas,
    }


RUNTIMES: dict[str, Runtime] = {r.name: r for r in (
    Runtime("Job", JOBS, "transformer Job and batch/v1 reproduction Job", Conditions("Complete", "Failed"),
            _job, lambda spec: [spec["template"]], kueue=True,
            rendezvous=Rendezvous("NODE_RANK", lambda job, pods: f"{job}-0.{job}", "-", service=True,
                                  init_node_rank="NODE_RANK",
                                  node_rank_field=f"metadata.annotations['{JOB_COMPLETION_INDEX}']")),
    Runtime("VolcanoJob", VOLCANO_JOBS, "reproduction as a Volcano Job (gang scheduling)",
            Phase(("state", "phase"), ("Completed",), ("Failed", "Aborted", "Terminated"), ("Pending",)),
            _volcano_job, lambda spec: [t["template"] for t in spec["tasks"]],
            # the svc plugin's first host of VC_WORKER_HOSTS
            rendezvous=Rendezvous("VC_TASK_INDEX", lambda job, pods: f"{job}-{VOLCANO_TASK}-0.{job}",
                                  f"-{VOLCANO_TASK}-", init_node_rank="VC_TASK_INDEX"),
            install="Volcano (batch.volcano.sh/v1alpha1 Job): https://volcano.sh/en/docs/installation/",
            feature="volcanoJob"),
    Runtime("AscendJob", ASCEND_JOBS, "reproduction as an Ascend MindCluster AscendJob",
            Conditions("Succeeded", "Failed"), _ascend_job,
            lambda spec: [r["template"] for r in spec["replicaSpecs"].values()], container="ascend",
            labels=lambda spec: {"framework": "pytorch", **_ring(spec)}, pod_labels=_ring, pod_env=_ascend_env,
            # framework pytorch: RANK = the pod's node rank, WORLD_SIZE = all NPUs, LOCAL_RANK a list
            rendezvous=Rendezvous("RANK", None, "-worker-",
                                  clears=("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")),
            install="Ascend MindCluster's ascend-operator (mindxdl.gitee.com/v1 AscendJob): "
                    "https://www.hiascend.com/document/detail/zh/mindcluster/",
            feature="ascendJob"),
    Runtime("RayJob", RAY_JOBS, "reproduction as a KubeRay RayJob (verl on Ray)", Fields(ray.ray_state),
            partial(ray.ray_job, watcher=WATCHER, master_port=MASTER_PORT), ray.pod_templates, container=ray.HEAD,
            kueue=True,
            # Ray's own cluster: the head is node 0 (the watcher's), the entrypoint runs once there
            rendezvous=Rendezvous("NODE_RANK", None, "-", per_node=False), pods_outlive=True,
            install="the KubeRay operator (ray.io/v1 RayJob), e.g. `helm install kuberay-operator "
                    "kuberay/kuberay-operator`: https://docs.ray.io/en/latest/cluster/kubernetes/",
            feature="rayJob"),
    Runtime("TrainJob", TRAIN_JOBS, "reproduction as a Kubeflow Trainer TrainJob", Conditions("Complete", "Failed"),
            kubeflow.train_job, kubeflow.train_job_templates, container=kubeflow.NODE, kueue=True,
            # the Trainer's torch plugin: PET_NODE_RANK (the completion index), PET_MASTER_ADDR/PORT
            rendezvous=Rendezvous("PET_NODE_RANK", None, f"-{kubeflow.NODE}-0-", master_addr="PET_MASTER_ADDR",
                                  master_port="PET_MASTER_PORT"),
            install="Kubeflow Trainer v2 (trainer.kubeflow.org/v1alpha1 TrainJob) and its torch-distributed "
                    "ClusterTrainingRuntime: https://www.kubeflow.org/docs/components/trainer/",
            feature="trainJob"),
    Runtime("JobSet", JOB_SETS, "reproduction as a JobSet (one replicated Indexed Job)",
            Conditions("Completed", "Failed"), kubeflow.job_set, kubeflow.job_set_templates, kueue=True,
            # pods <jobset>-node-0-<i> under the JobSet's headless Service <jobset>
            rendezvous=Rendezvous("NODE_RANK", lambda js, pods: f"{js}-{kubeflow.NODE}-0-0.{js}",
                                  f"-{kubeflow.NODE}-0-", init_node_rank="NODE_RANK",
                                  node_rank_field=f"metadata.annotations['{JOB_COMPLETION_INDEX}']"),
            install="JobSet (jobset.x-k8s.io/v1alpha2): https://jobset.sigs.k8s.io/docs/installation/",
            feature="jobSet"),
)}

# Every workload resource the operator creates, follows and deletes (the transformer's Jobs included).
WORKLOADS: tuple[Resource, ...] = tuple(dict.fromkeys(r.resource for r in RUNTIMES.values()))
# What a generation's children are: the workloads and the headless Services of multi-node Jobs
# (created and deleted with them, never followed).
CHILDREN: tuple[Resource, ...] = (*WORKLOADS, SERVICES)


def runtime_of(resource) -> Runtime | None:
    """The runtime whose workloads are `resource` (ours or kopf's: group, version and plural decide)."""
    key = (resource.group, resource.version, resource.plural)
    return next((r for r in RUNTIMES.values() if (r.resource.group, r.resource.version, r.resource.plural) == key),
                None)


def missing(resource: Resource) -> str:
    """What a 404 for `resource` means: its CRD is not installed, and what to install."""
    runtime = runtime_of(resource)
    what = f"{resource.plural}.{resource.group}/{resource.version}".replace("./", "/")
    hint = f": install {runtime.install}" if runtime is not None and runtime.install else ""
    return f"the cluster does not serve {what} (its CustomResourceDefinition is not installed){hint}"
