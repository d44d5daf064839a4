"""KubeRay's RayJob (ray.io/v1) as a reproduction's workload: built, and its status read.

The plan's pods become a Ray cluster: the head (node 0, with the watch sidecar) and one worker
group of the other pods, each pod holding one node's devices. Ray starts its own processes in
those pods (`ray start`), so the containers' own command and args are not run there: they are
the RayJob's `entrypoint` (verl's `python3 -m verl.trainer.main_ppo ...`, or `moe-proxy repro`),
which KubeRay submits to the head once the cluster is up (submissionMode K8sJobMode). The driver
and the processes Ray starts on every node inherit their pod's environment. `moe-proxy repro`
over more than one node runs through LAUNCHER: a Ray task per node runs that node's ranks.

verl keeps its TaskRunner (the process whose FileLogger writes the metrics) off the head node,
so on more than one node the metrics file is on a volume every pod mounts
(spec.reproduction.sharedVolumeClaim, a ReadWriteMany claim, mounted at /run/moe-proxy), where
the head's watcher reads it.

Pure data and functions: no import of `runtimes` (whose table names them).
"""

from __future__ import annotations

import copy
import json
import re
import shlex

from .spec_types import ProxyModelSpec

WORKER_GROUP = "workers"
HEAD, WORKER = "ray-head", "ray-worker"  # the Ray containers' names (KubeRay's samples')
# Seconds the cluster stays after the job ends (shutdownAfterJobFinishes) when the ProxyModel
# sets no ttlSecondsAfterFinished: the head's watcher is read before its pod goes.
VERDICT_GRACE_S = 300
NVIDIA = "nvidia.com/gpu"  # KubeRay counts these as Ray GPUs itself
_K8S_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _word(arg: str) -> str:
    """One argument for the shell, `$(VAR)` as `"${VAR}"` and the rest quoted as it is."""
    pieces = _K8S_VAR.split(arg)  # literal, name, literal, name, ...
    return "".join(f'"${{{p}}}"' if i % 2 else shlex.quote(p) if p else "" for i, p in enumerate(pieces)) or "''"


def entrypoint(container: dict) -> str:
    """A container's command and args as one shell command (what `ray job submit` runs on the
    head): Kubernetes' `$(VAR)` references become the shell's `${VAR}` (the driver has the head
    container's environment)."""
    return " ".join(_word(arg) for arg in [*(container.get("command") or []), *(container.get("args") or [])])


# `moe-proxy repro` over N nodes of a Ray cluster, as the RayJob's driver on the head: one Ray
# task per node (pinned to it, holding its devices), each running this node's share of the one
# torch.distributed run: `repro ... --nnodes N --node-rank I --master-addr HEAD --master-port P`,
# the head node rank 0 (its termination message is the verdict), the port MASTER_PORT of the head's
# env if set. Exits with the worst exit code.
LAUNCHER = """\
import json, os, subprocess, sys
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
nodes, resources, argv = int(sys.argv[1]), json.loads(sys.argv[3]), sys.argv[4:]
port = os.environ.get("MASTER_PORT") or sys.argv[2]
ray.init()
head = ray.util.get_node_ip_address()
alive = sorted((n for n in ray.nodes() if n["Alive"]), key=lambda n: n["NodeManagerAddress"] != head)
if len(alive) < nodes:
    sys.exit(f"{len(alive)} Ray nodes are up, {nodes} planned")
@ray.remote(num_cpus=0)
def node(rank):
    return subprocess.call([*argv, "--nnodes", str(nodes), "--node-rank", str(rank), "--master-addr", head,
                            "--master-port", port])
runs = [node.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False), **resources)
        .remote(rank) for rank, n in enumerate(alive[:nodes])]
sys.exit(max(ray.get(runs)))
"""


def _ray_resources(spec: ProxyModelSpec) -> dict:
    """What a node's task holds: all of its devices (Ray then makes them visible to it)."""
    per_pod = spec.reproduction.accelerator.devices_per_node
    if spec.reproduction.accelerator.resource == NVIDIA:
        return {"num_gpus": per_pod}
    return {"resources": {"NPU": per_pod}}


def _entrypoint(spec: ProxyModelSpec, pods: int, container: dict, master_port: int) -> str:
    """The first container's command as the driver, or for `moe-proxy repro` over more than one
    node, LAUNCHER running it on every node."""
    if spec.reproduction.template is not None or pods == 1:
        return entrypoint(container)
    argv = ["python3", "-c", LAUNCHER, str(pods), str(master_port), json.dumps(_ray_resources(spec)),
            *(container.get("command") or []), *(container.get("args") or [])]
    return entrypoint({"command": argv})


def _start_params(spec: ProxyModelSpec, head: bool) -> dict:
    params = {"dashboard-host": "0.0.0.0"} if head else {}
    resource = spec.reproduction.accelerator.resource
    if resource != NVIDIA:  # an NPU: Ray's resource of that name (verl asks for "NPU")
        per_pod = spec.reproduction.accelerator.devices_per_node
        params["resources"] = f'"{{\\"NPU\\": {per_pod}}}"'
    return params


def _ray_pod(template: dict, container_name: str, drop_init: str | None) -> dict:
    """The pod template Ray runs `ray start` in: the first container without its command and
    args (they are the entrypoint), named as KubeRay's samples name it."""
    pod = copy.deepcopy(template)
    first = pod["spec"]["containers"][0]
    first.pop("command", None)
    first.pop("args", None)
    first["name"] = container_name
    pod["spec"].pop("restartPolicy", None)  # KubeRay's: the cluster's pods restart
    if drop_init:
        inits = [c for c in pod["spec"].pop("initContainers", []) if c["name"] != drop_init]
        if inits:
            pod["spec"]["initContainers"] = inits
    return pod


def ray_job(spec: ProxyModelSpec, pods: int, template: dict, watcher: str, master_port: int) -> dict:
    """The RayJob's spec: the head (node 0, the watcher) and pods - 1 workers, the first
    container's command and args as the entrypoint, the cluster gone when the job ends."""
    r = spec.reproduction
    cluster: dict = {"headGroupSpec": {"rayStartParams": _start_params(spec, True),
                                       "template": _ray_pod(template, HEAD, None)}}
    if pods > 1:
        cluster["workerGroupSpecs"] = [{
            "groupName": WORKER_GROUP, "replicas": pods - 1, "minReplicas": pods - 1, "maxReplicas": pods - 1,
            "rayStartParams": _start_params(spec, False), "template": _ray_pod(template, WORKER, watcher)}]
    job: dict = {
        "entrypoint": _entrypoint(spec, pods, template["spec"]["containers"][0], master_port),
        "submissionMode": "K8sJobMode",
        "shutdownAfterJobFinishes": True,
        "ttlSecondsAfterFinished": spec.ttl_seconds_after_finished
        if spec.ttl_seconds_after_finished is not None else VERDICT_GRACE_S,
        "backoffLimit": 0,  # a retry is a new cluster: failures are signal, not noise
        "rayClusterSpec": cluster,
    }
    job.update(r.workload.deadline(), **spec.admission())
    return job


def pod_templates(spec: dict) -> list[dict]:
    cluster = spec["rayClusterSpec"]
    return [cluster["headGroupSpec"]["template"], *(g["template"] for g in cluster.get("workerGroupSpecs") or [])]


# jobDeploymentStatus (KubeRay's lifecycle) and jobStatus (the Ray job's own): `Complete` says
# the deployment finished, whether the job SUCCEEDED or FAILED (or was STOPPED).
DEPLOYMENT_DONE, DEPLOYMENT_FAILED = "Complete", "Failed"


def ray_state(obj: dict) -> tuple[str, str, str]:
    """(Running | Succeeded | Failed, reason, message) from a RayJob's status."""
    status = obj.get("status") or {}
    deployment, job = status.get("jobDeploymentStatus") or "", status.get("jobStatus") or ""
    message = status.get("message") or ""
    if deployment == DEPLOYMENT_DONE and job == "SUCCEEDED":
        return "Succeeded", "", ""
    if deployment == DEPLOYMENT_DONE:  # the Ray job FAILED or was STOPPED: the cluster did its part
        return "Failed", status.get("reason") or f"RayJob{job.title() or 'Failed'}", message
    if deployment == DEPLOYMENT_FAILED:
        return "Failed", status.get("reason") or "RayJobFailed", message
    return "Running", "", ""
