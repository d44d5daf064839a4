"""The operator image run once, as the chart's Deployment runs it, against kmock's emulated API
server: what it did (liveness, the Jobs it created, its exit code and log) for the tests of
both images (the transformer image runs the Job the operator created)."""

from __future__ import annotations

import asyncio
import importlib
import pkgutil
import time
import uuid
from dataclasses import dataclass, field

import kmock
import aiohttp

from moe_proxy.demo.seaweed import free_ports

from ..apiserver import stamp_created
from .conftest import ROOT, container_args, crd_resources, podman, secret

NAMESPACE = "team-a"
SECRET = "s3-creds"


class Emulator(kmock.KubernetesEmulator):
    """kmock's emulator that, like an API server, gives created objects a uid, a generation and
    a creation time (the operator's ownerReferences need the uid)."""

    async def _handle(self, request):
        if request.action == kmock.action.CREATE and isinstance(request.data, dict):
            stamp_created(request.data)
        return await super()._handle(request)


def operator_workloads() -> set[tuple[str, str, str, str]]:
    """(group, version, plural, kind) of the custom workloads the operator watches (Volcano Jobs,
    AscendJobs), found in its modules: a real cluster with those controllers serves them."""
    import proxymodel_operator

    found = set()
    for info in pkgutil.walk_packages(proxymodel_operator.__path__, "proxymodel_operator."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            fields = [getattr(value, a, None) for a in ("group", "version", "plural", "kind")]
            if all(isinstance(f, str) and f for f in fields) and "." in fields[0]:
                found.add(tuple(fields))
    return found


@dataclass
class OperatorRun:
    image: str
    healthy: bool = False
    jobs: list[dict] = field(default_factory=list)
    exit_code: int | None = None
    log: str = ""
    secrets: dict[str, dict] = field(default_factory=dict)
    pod_security: dict = field(default_factory=dict)


async def run_operator(images, seaweed, s3_source, tmp_path) -> OperatorRun:
    import helm_python as helm

    from tests.chart.conftest import kubeconfig_for, render_objects

    port = free_ports(1)[0]
    with helm.Chart.load(str(ROOT / "charts" / "moe-proxy")) as chart:
        # The chart's defaults (preflight on, JSON logs, cluster-wide, default images), on a
        # free liveness port: the container shares the host's network.
        objects = render_objects(chart, {"operator": {"livenessPort": port}})
    pod = next(o for o in objects if o["kind"] == "Deployment")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"] == images["operator"]
    mounts = {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])}
    writable = [mounts[v["name"]] for v in pod.get("volumes", []) if "emptyDir" in v]
    run = OperatorRun(image=container["image"], pod_security=pod["securityContext"],
                      secrets={SECRET: secret(SECRET, NAMESPACE)})

    async with Emulator() as emulator, kmock.Server(emulator):
        emulator.resources.load_bundled()
        for group, version, plural, kind, status in crd_resources():
            emulator.resources[f"{group}/{version}/{plural}"] = kmock.ResourceInfo(
                kind=kind, namespaced=True, verbs={"list", "watch", "get", "create", "patch", "delete"},
                subresources={"status"} if status else set())
        for group, version, plural, kind in operator_workloads():
            emulator.resources.setdefault(f"{group}/{version}/{plural}", kmock.ResourceInfo(
                kind=kind, namespaced=True, verbs={"list", "watch", "get", "create", "patch", "delete"}))
        for ns in (NAMESPACE, "moe-proxy"):
            emulator.objects["v1/namespaces", None, ns] = {"apiVersion": "v1", "kind": "Namespace",
                                                           "metadata": {"name": ns}}
        server = str(emulator.url).rstrip("/")
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(kubeconfig_for(server))
        kubeconfig.chmod(0o644)  # read by user 65532 through a read-only bind mount
        name = f"moe-proxy-operator-{uuid.uuid4().hex[:8]}"
        # What a pod gets from elsewhere: the kubeconfig instead of the in-cluster service
        # account, and Python's import log (stderr) to see which modules it loads.
        args = container_args(container, pod["securityContext"], {}, read_only=True, writable=writable,
                              extra_env={"KUBECONFIG": "/var/run/moe-proxy/kubeconfig", "PYTHONPROFILEIMPORTTIME": "1"},
                              binds=[f"{kubeconfig}:/var/run/moe-proxy/kubeconfig:ro"])
        podman("run", "--detach", "--name", name, *args)
        try:
            probe = container["livenessProbe"]["httpGet"]
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            url = f"http://127.0.0.1:{ports[probe['port']]}{probe['path']}"
            async with aiohttp.ClientSession(headers={"Authorization": "Bearer emulator-token"}) as session:
                deadline = time.monotonic() + 90
                while time.monotonic() < deadline and not run.healthy:
                    if podman("inspect", "--format", "{{.State.Running}}", name).stdout.strip() != "true":
                        break
                    try:
                        async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as response:
                            run.healthy = response.status == 200
                    except aiohttp.ClientError:
                        pass
                    await asyncio.sleep(0.5)
                if run.healthy:
                    for path, body in ((f"/api/v1/namespaces/{NAMESPACE}/secrets", run.secrets[SECRET]),
                                       (f"/apis/moeproxy.io/v1alpha1/namespaces/{NAMESPACE}/proxymodels",
                                        proxymodel(seaweed.endpoint_url, s3_source))):
                        async with session.post(server + path, json=body) as response:
                            assert response.status < 400, await response.text()
                    deadline = time.monotonic() + 60
                    while time.monotonic() < deadline and not run.jobs:
                        async with session.get(f"{server}/apis/batch/v1/namespaces/{NAMESPACE}/jobs") as response:
                            run.jobs = (await response.json()).get("items", [])
                        await asyncio.sleep(0.5)
        finally:
            # The kubelet's stop: SIGTERM, then SIGKILL after the grace period.
            podman("stop", "--time", "25", name, check=False, timeout=60)
            state = podman("inspect", "--format", "{{.State.ExitCode}}", name, check=False)
            run.exit_code = int(state.stdout.strip()) if state.returncode == 0 else None
            logs = podman("logs", name, check=False)
            run.log = logs.stdout + logs.stderr
            podman("rm", "--force", name, check=False)
    return run


def proxymodel(endpoint: str, source: str) -> dict:
    return {
        "apiVersion": "moeproxy.io/v1alpha1", "kind": "ProxyModel",
        "metadata": {"name": "qwen3-tiny", "namespace": NAMESPACE},
        "spec": {
            "source": {"uri": source, "endpoint": endpoint, "region": "us-east-1", "credentialsSecret": SECRET},
            "destination": {"uri": "s3://proxy/qwen3-tiny"},
            "pruning": {"experts": 4},
            "reproduction": {"enabled": False},
        },
    }
