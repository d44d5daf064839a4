"""The reproduction workload: RL steps on the proxy, on the planned number of accelerators.

Three runtimes, one pod template:
- `Job` (batch/v1): one pod, or an Indexed Job with one pod per node;
- `VolcanoJob` (batch.volcano.sh/v1alpha1): a gang of one pod per node (minAvailable);
- `AscendJob` (mindxdl.gitee.com/v1, Ascend MindCluster): Master + Workers, container `ascend`.
By default the container runs `moe-proxy repro`; a user's own pod template (verl,
MindSpeed-RL...) is used as given, with the proxy's location injected as environment.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

from .children import (REPRODUCTION, TERMINATION_LOG, child_name, container_basics, labels, merge_env,
                       pod_spec_basics, s3_env)
from .resources import RUNTIMES
from .spec import ProxyModelSpec

RUN_DIR = "/run/moe-proxy"
ASCEND_RING_LABEL = "ring-controller.atlas"


@dataclass(frozen=True)
class Placement:
    devices: int  # total accelerators
    per_pod: int  # accelerators per pod (one pod per node)
    pods: int


def placement(devices: int, devices_per_node: int) -> Placement:
    per_pod = min(devices, devices_per_node)
    return Placement(devices, per_pod, math.ceil(devices / per_pod))


def repro_args(spec: ProxyModelSpec, proxy_uri: str) -> list[str]:
    r = spec.reproduction
    args = ["repro", proxy_uri, "--out", RUN_DIR, "--steps", str(r.max_steps), "--precision", r.precision]
    if r.fail_on:
        args += ["--fail-on", r.fail_on.cli()]
    return args + ["--termination-log", TERMINATION_LOG]


def proxy_env(spec: ProxyModelSpec, proxy_uri: str, manifest_sha256: str, where: Placement) -> list[dict]:
    """What any reproduction container learns about the proxy and the run it is part of."""
    r = spec.reproduction
    env = [
        {"name": "MOEPROXY_PROXY_URI", "value": proxy_uri},
        {"name": "MOEPROXY_PROXY_MANIFEST_SHA256", "value": manifest_sha256},
        {"name": "MOEPROXY_MAX_STEPS", "value": str(r.max_steps)},
        {"name": "MOEPROXY_DEVICES", "value": str(where.devices)},
        {"name": "MOEPROXY_NODES", "value": str(where.pods)},
    ]
    if r.fail_on:
        env.append({"name": "MOEPROXY_FAIL_ON", "value": r.fail_on.cli()})
    return env


def _accelerator_resources(existing: dict, resource: str, count: int) -> dict:
    out = copy.deepcopy(existing or {})
    for kind in ("limits", "requests"):  # extended resources: requests must equal limits
        out.setdefault(kind, {})[resource] = count
    return out


def pod_template(spec: ProxyModelSpec, proxy_uri: str, manifest_sha256: str, where: Placement,
                 pod_labels: dict[str, str], container_name: str) -> dict:
    r = spec.reproduction
    env = merge_env(s3_env(spec.source), proxy_env(spec, proxy_uri, manifest_sha256, where))
    if r.runtime == "AscendJob":
        env.append({"name": "ASCEND_VISIBLE_DEVICES", "valueFrom": {"fieldRef": {
            "fieldPath": f"metadata.annotations['{r.accelerator.resource}']"}}})
    if r.template is not None:  # the user's own RL framework
        template = copy.deepcopy(r.template)
        template.setdefault("metadata", {}).setdefault("labels", {}).update(pod_labels)
        pod = template["spec"]
        pod.setdefault("restartPolicy", "Never")
        for i, c in enumerate(pod["containers"]):
            c["env"] = merge_env(env, c.get("env") or [])
            if i == 0:
                c["resources"] = _accelerator_resources(c.get("resources"), r.accelerator.resource, where.per_pod)
                if r.runtime == "AscendJob":
                    c["name"] = "ascend"
        return template

    container = container_basics(r.workload, container_name)
    container["command"] = r.workload.command or ["moe-proxy"]
    container["args"] = r.workload.args or repro_args(spec, proxy_uri)
    container["env"] = merge_env(env, r.workload.env)
    container["resources"] = _accelerator_resources(r.workload.resources, r.accelerator.resource, where.per_pod)
    container["volumeMounts"] = [{"name": "run", "mountPath": RUN_DIR}]
    return {
        "metadata": {"labels": pod_labels},
        "spec": {**pod_spec_basics(r.workload), "containers": [container],
                 "volumes": [{"name": "run", "emptyDir": {}}]},
    }


def reproduction_workload(proxymodel: str, namespace: str, generation: int, spec: ProxyModelSpec,
                          proxy_uri: str, manifest_sha256: str, devices: int) -> dict:
    """The manifest for spec.reproduction.runtime, on `devices` accelerators in total."""
    r = spec.reproduction
    name = child_name(proxymodel, REPRODUCTION, generation)
    where = placement(devices, r.accelerator.devices_per_node)
    pod_labels = labels(proxymodel, REPRODUCTION, name, generation)
    metadata = {"name": name, "namespace": namespace,
                "labels": labels(proxymodel, REPRODUCTION, name, generation, spec, kueue=r.runtime == "Job")}
    resource = RUNTIMES[r.runtime]
    head = {"apiVersion": resource.api_version, "kind": resource.kind, "metadata": metadata}

    if r.runtime == "Job":
        template = pod_template(spec, proxy_uri, manifest_sha256, where, pod_labels, "reproduction")
        if r.scheduler_name:
            template["spec"]["schedulerName"] = r.scheduler_name
        job: dict = {"backoffLimit": r.workload.backoff_limit, "template": template}
        if where.pods > 1:
            job.update(completionMode="Indexed", completions=where.pods, parallelism=where.pods)
        if r.workload.active_deadline_seconds:
            job["activeDeadlineSeconds"] = r.workload.active_deadline_seconds
        if spec.ttl_seconds_after_finished is not None:
            job["ttlSecondsAfterFinished"] = spec.ttl_seconds_after_finished
        return {**head, "spec": job}

    if r.runtime == "VolcanoJob":
        template = pod_template(spec, proxy_uri, manifest_sha256, where, pod_labels, "reproduction")
        vc: dict = {
            "schedulerName": r.scheduler_name or "volcano",
            "minAvailable": where.pods,  # gang: all pods start together or none does
            "maxRetry": r.workload.backoff_limit,
            "plugins": {"env": [], "svc": []},
            "policies": [{"event": "PodFailed", "action": "AbortJob"}],
            "tasks": [{"name": "worker", "replicas": where.pods, "template": template}],
        }
        if r.volcano_queue:
            vc["queue"] = r.volcano_queue
        if spec.ttl_seconds_after_finished is not None:
            vc["ttlSecondsAfterFinished"] = spec.ttl_seconds_after_finished
        return {**head, "spec": vc}

    # AscendJob: the ring-controller label on the job and on every pod template.
    ring = "ascend-910b" if "910" in r.accelerator.resource else "ascend-npu"
    metadata["labels"].update({"framework": "pytorch", ASCEND_RING_LABEL: ring})
    pod_labels = {**pod_labels, ASCEND_RING_LABEL: ring}
    template = pod_template(spec, proxy_uri, manifest_sha256, where, pod_labels, "ascend")
    replicas = {"Master": {"replicas": 1, "restartPolicy": "Never", "template": template}}
    if where.pods > 1:
        replicas["Worker"] = {"replicas": where.pods - 1, "restartPolicy": "Never",
                              "template": copy.deepcopy(template)}
    policy: dict = {"minAvailable": where.pods}
    if r.volcano_queue:
        policy["queue"] = r.volcano_queue
    return {**head, "spec": {
        "schedulerName": r.scheduler_name or "volcano",
        "runPolicy": {"backoffLimit": r.workload.backoff_limit, "schedulingPolicy": policy},
        "successPolicy": "AllWorkers",
        "replicaSpecs": replicas,
    }}
