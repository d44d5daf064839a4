"""The workload kinds a reproduction runs as (spec.reproduction.runtime), as one table.

Each entry says what differs between them: the API resource, how its spec is built around
the one pod template (`reproduction.pod_template`), what its controller needs on that
template, how its status says it finished, and where its pod templates sit. Everything else
(the pod template, placement, naming, labels, reading pods) is shared.

The table is the one place: `rbac.PERMISSIONS` grants each entry's resource, the handlers
watch and delete each one, and tests check that the CRD's `spec.reproduction.runtime` enum
names exactly these. A new runtime (KubeRay's RayJob, say) is one entry here, plus the enum.
Pure data and functions: the batch/v1 Job is also the transformer's workload.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .resources import ASCEND_JOBS, JOBS, VOLCANO_JOBS, Resource

if TYPE_CHECKING:  # the spec's types only: spec.py validates runtime names against this table
    from .spec import ProxyModelSpec

ASCEND_RING_LABEL = "ring-controller.atlas"


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


def _nothing(spec: ProxyModelSpec) -> dict:
    return {}


def _no_env(spec: ProxyModelSpec) -> list[dict]:
    return []


@dataclass(frozen=True)
class Runtime:
    name: str  # the spec.reproduction.runtime value
    resource: Resource
    why: str  # the reason its RBAC permission gives
    state: Conditions | Phase
    # (spec, pods: one per node, the pod template) -> the workload's `spec`
    build: Callable[[ProxyModelSpec, int, dict], dict]
    pod_templates: Callable[[dict], list[dict]]  # the workload's spec -> its pod templates, the first pod's first
    container: str | None = None  # a first-container name its device plugin requires (a user's is renamed)
    kueue: bool = False  # Kueue admits it by the queue-name label
    labels: Callable[[ProxyModelSpec], dict] = _nothing  # on the workload, for its controller
    pod_labels: Callable[[ProxyModelSpec], dict] = _nothing  # on its pods
    pod_env: Callable[[ProxyModelSpec], list[dict]] = _no_env  # for its containers


# --- batch/v1 Job: one pod, or an Indexed Job of one pod per node --------------------------------


def _job(spec: ProxyModelSpec, pods: int, template: dict) -> dict:
    r = spec.reproduction
    if r.scheduler_name:
        template["spec"]["schedulerName"] = r.scheduler_name
    job: dict = {"backoffLimit": r.workload.backoff_limit, "template": template}
    if pods > 1:
        job.update(completionMode="Indexed", completions=pods, parallelism=pods)
    if r.workload.active_deadline_seconds:
        job["activeDeadlineSeconds"] = r.workload.active_deadline_seconds
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
        "plugins": {"env": [], "svc": []},
        "policies": [{"event": "PodFailed", "action": "AbortJob"}],
        "tasks": [{"name": "worker", "replicas": pods, "template": template}],
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
    if pods > 1:
        replicas["Worker"] = {"replicas": pods - 1, "restartPolicy": "Never", "template": copy.deepcopy(template)}
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
            _job, lambda spec: [spec["template"]], kueue=True),
    Runtime("VolcanoJob", VOLCANO_JOBS, "reproduction as a Volcano Job (gang scheduling)",
            Phase(("state", "phase"), ("Completed",), ("Failed", "Aborted", "Terminated"), ("Pending",)),
            _volcano_job, lambda spec: [t["template"] for t in spec["tasks"]]),
    Runtime("AscendJob", ASCEND_JOBS, "reproduction as an Ascend MindCluster AscendJob",
            Conditions("Succeeded", "Failed"), _ascend_job,
            lambda spec: [r["template"] for r in spec["replicaSpecs"].values()], container="ascend",
            labels=lambda spec: {"framework": "pytorch", **_ring(spec)}, pod_labels=_ring, pod_env=_ascend_env),
)}

# Every workload resource the operator creates, follows and deletes (the transformer's Jobs included).
WORKLOADS: tuple[Resource, ...] = tuple(dict.fromkeys(r.resource for r in RUNTIMES.values()))


def runtime_of(resource) -> Runtime | None:
    """The runtime whose workloads are `resource` (ours or kopf's: group, version and plural decide)."""
    key = (resource.group, resource.version, resource.plural)
    return next((r for r in RUNTIMES.values() if (r.resource.group, r.resource.version, r.resource.plural) == key),
                None)
