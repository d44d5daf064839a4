"""The reproduction workload: RL steps on the proxy, on the planned number of accelerators.

One pod template, wrapped by the runtime spec.reproduction.runtime names (`runtimes.py`: a
batch/v1 Job, a Volcano gang or an Ascend MindCluster AscendJob). By default the container runs
`moe-proxy repro`; a user's own pod template (verl, MindSpeed-RL...) is used as given, with the
proxy's location injected as environment.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

from .children import (REPRODUCTION, TERMINATION_LOG, child_name, container_basics, labels, merge_env,
                       pod_spec_basics, s3_env)
from .runtimes import RUNTIMES, Runtime
from .spec import ProxyModelSpec

RUN_DIR = "/run/moe-proxy"
DEFAULT_CONTAINER = "reproduction"


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
                 pod_labels: dict[str, str], runtime: Runtime) -> dict:
    r = spec.reproduction
    env = merge_env(s3_env(spec.source), proxy_env(spec, proxy_uri, manifest_sha256, where)) + runtime.pod_env(spec)
    if r.template is not None:  # the user's own RL framework
        template = copy.deepcopy(r.template)
        template.setdefault("metadata", {}).setdefault("labels", {}).update(pod_labels)
        pod = template["spec"]
        pod.setdefault("restartPolicy", "Never")
        for i, c in enumerate(pod["containers"]):
            c["env"] = merge_env(env, c.get("env") or [])
            if i == 0:
                c["resources"] = _accelerator_resources(c.get("resources"), r.accelerator.resource, where.per_pod)
                if runtime.container:
                    c["name"] = runtime.container
        return template

    container = container_basics(r.workload, runtime.container or DEFAULT_CONTAINER)
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
    runtime = RUNTIMES[r.runtime]
    name = child_name(proxymodel, REPRODUCTION, generation)
    where = placement(devices, r.accelerator.devices_per_node)
    pod_labels = {**labels(proxymodel, REPRODUCTION, name, generation), **runtime.pod_labels(spec)}
    workload_labels = {**labels(proxymodel, REPRODUCTION, name, generation, spec, kueue=runtime.kueue),
                       **runtime.labels(spec)}
    template = pod_template(spec, proxy_uri, manifest_sha256, where, pod_labels, runtime)
    return {"apiVersion": runtime.resource.api_version, "kind": runtime.resource.kind,
            "metadata": {"name": name, "namespace": namespace, "labels": workload_labels},
            "spec": runtime.build(spec, where.pods, template)}
