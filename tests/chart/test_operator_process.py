"""The rendered Deployment run for real: its command and exactly its environment start the
operator against an emulated API server (kmock). The liveness probe's port and path answer,
every API call the operator makes is one the rendered RBAC grants (in namespaced mode: only
in the watched namespace), and SIGTERM stops it cleanly, as the kubelet would."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import pytest

from proxymodel_operator.resources import PROXYMODELS
from proxymodel_operator.runtimes import WORKLOADS

from moe_proxy.demo.seaweed import free_ports

from ..apiserver import stamp_created
from ..promised import require
from .conftest import ROOT, grants, kubeconfig_for, one, render_objects

kmock = require("kmock", "kmock")
aiohttp = require("aiohttp", "kopf (which depends on aiohttp)")

WATCHED = "team-a"
VERBS = {"LIST": "list", "WATCH": "watch", "FETCH": "get", "CREATE": "create", "UPDATE": "patch",
         "DELETE": "delete"}
PROXYMODEL = {
    "apiVersion": "moeproxy.io/v1alpha1", "kind": "ProxyModel",
    "metadata": {"name": "qwen3-step100", "namespace": WATCHED},
    "spec": {"source": {"uri": "s3://ckpt/qwen3-moe/global_step_100"}, "pruning": {"experts": 8},
             "reproduction": {"enabled": False}},
}


class RecordingEmulator(kmock.KubernetesEmulator):
    """kmock's emulator that records each call as (verb, group, resource, namespace) and, like
    an API server, gives created objects a uid, a generation and a creation time."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[str, str, str, str | None]] = []

    async def _handle(self, request):
        if request.headers.get("X-Test-Client"):  # the test's own calls, not the operator's
            return await super()._handle(request)
        if request.resource is not None and request.resource.plural and request.action is not None:
            plural = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
            self.calls.append((VERBS[request.action.name], request.resource.group or "", plural, request.namespace))
            if request.action == kmock.action.CREATE and isinstance(request.data, dict):
                stamp_created(request.data)
        return await super()._handle(request)


@pytest.fixture()
def namespaces_listable(monkeypatch):
    """kmock 0.8 cannot parse /api/v1/namespaces (it reads `namespaces` as the start of a
    namespaced path), which kopf lists in namespaced mode: route it as the cluster-scoped
    `namespaces` resource it is."""
    from kmock._internal import parsing

    original = parsing.parse_path

    def parse_path(path: str):
        parts = path.strip("/").split("/")
        if parts[:3] == ["api", "v1", "namespaces"] and len(parts) <= 4:
            return parsing.ParsedPath("", "v1", "namespaces", None, parts[3] if len(parts) == 4 else None, None)
        return original(path)

    monkeypatch.setattr(parsing, "parse_path", parse_path)


async def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = await predicate()
        if result:
            return result
        await asyncio.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}")


@pytest.mark.parametrize("mode", ["namespaced", "cluster-wide", "checkpoint-watch"])
async def test_rendered_deployment_runs_within_its_rbac(chart, tmp_path, mode, namespaces_listable):
    port = free_ports(1)[0]
    values = {"operator": {"livenessPort": port, "preflight": False, "logFormat": "plain"},
              "jobs": {"transformerImage": "registry.local/moe-proxy:test"}}
    if mode == "namespaced":
        values["watchNamespaces"] = [WATCHED]
    if mode == "checkpoint-watch":
        values["checkpointWatch"] = {"enabled": True}
    objects = render_objects(chart, values)
    container = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    roles = [o for o in objects if o["kind"] in ("Role", "ClusterRole")]

    def granted(verb: str, group: str, resource: str, namespace: str | None) -> bool:
        for role in roles:
            if role["kind"] == "Role" and role["metadata"]["namespace"] != namespace:
                continue
            if (group, resource, verb) in grants(role["rules"]):
                return True
        return False

    async with RecordingEmulator() as emulator, kmock.Server(emulator):
        emulator.resources.load_bundled()
        for resource in (PROXYMODELS, *WORKLOADS):  # what the operator's handlers serve
            emulator.resources[f"{resource.group}/{resource.version}/{resource.plural}"] = kmock.ResourceInfo(
                kind=resource.kind, namespaced=True, verbs=set(VERBS.values()),
                subresources={"status"} if resource is PROXYMODELS else set())
        emulator.resources[f"{PROXYMODELS.group}/{PROXYMODELS.version}/checkpointwatches"] = kmock.ResourceInfo(
            kind="CheckpointWatch", namespaced=True, verbs=set(VERBS.values()), subresources={"status"})
        emulator.resources[f"{PROXYMODELS.group}/{PROXYMODELS.version}/diagnoses"] = kmock.ResourceInfo(
            kind="Diagnosis", namespaced=True, verbs=set(VERBS.values()), subresources={"status"})
        for ns in (WATCHED, "other"):
            emulator.objects["v1/namespaces", None, ns] = {"apiVersion": "v1", "kind": "Namespace",
                                                           "metadata": {"name": ns}}
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(kubeconfig_for(str(emulator.url)))
        # Exactly the rendered environment; what a pod gets from elsewhere: PATH (the image's
        # Python first), HOME on the writable /tmp, and the kubeconfig instead of the
        # in-cluster service account.
        env = {e["name"]: e["value"] for e in container["env"]}
        env.update(PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
                   HOME=str(tmp_path), KUBECONFIG=str(kubeconfig),
                   PYTHONPATH=os.pathsep.join([str(ROOT / "operator"), str(ROOT / "src")]))
        log = open(tmp_path / "operator.log", "wb")
        process = await asyncio.create_subprocess_exec(*container["command"], env=env, stdout=log, stderr=log)
        try:
            probe = container["livenessProbe"]["httpGet"]
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            url = f"http://127.0.0.1:{ports[probe['port']]}{probe['path']}"

            async with aiohttp.ClientSession() as session:
                async def healthy():
                    if process.returncode is not None:
                        pytest.fail(f"the operator exited {process.returncode}: "
                                    f"{(tmp_path / 'operator.log').read_text()[-3000:]}")
                    try:
                        async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as response:
                            return response.status == 200
                    except aiohttp.ClientError:
                        return False

                await wait_for(healthy, 60, f"the liveness probe {url}")

                # A ProxyModel: the operator handles it and creates the transformer Job.
                async with session.post(f"{str(emulator.url).rstrip('/')}/apis/moeproxy.io/v1alpha1/namespaces/{WATCHED}/proxymodels",
                                        json=PROXYMODEL, headers={"X-Test-Client": "kubectl"}) as response:
                    assert response.status < 400, await response.text()

                async def job_created():
                    return any(v == "create" and r == "jobs" for v, _, r, _ in emulator.calls)

                await wait_for(job_created, 30, "the transformer Job; operator log:\n"
                               + (tmp_path / "operator.log").read_text()[-4000:]
                               + f"\ncalls: {sorted(set(emulator.calls), key=str)}")
        finally:
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
            try:
                code = await asyncio.wait_for(process.wait(), 25)
            except asyncio.TimeoutError:
                process.kill()
                await process.wait()
                pytest.fail("the operator did not stop on SIGTERM within 25 s")
            log.close()
        assert code == 0, (tmp_path / "operator.log").read_text()[-3000:]

    calls = set(emulator.calls)
    watched = {resource for verb, _, resource, _ in calls if verb == "watch"}
    assert "proxymodels" in watched
    # CheckpointWatches are served only when the chart enables them.
    assert ("checkpointwatches" in watched) == (mode == "checkpoint-watch")
    assert "diagnoses" in watched  # Diagnoses are always served
    denied = sorted({c for c in calls if not granted(*c)}, key=str)
    assert denied == [], f"calls the rendered RBAC does not allow: {denied}"
    if mode == "namespaced":
        namespaced = {c for c in calls if c[2].split("/")[0] not in ("namespaces", "customresourcedefinitions")}
        assert {ns for *_, ns in namespaced} == {WATCHED}
    # Preflight is off: the operator touched no Secret, and the chart granted none unless a
    # CheckpointWatch may need one (`get` only).
    assert not any(resource == "secrets" for _, _, resource, _ in calls)
    secret_grants = {(r, v) for role in roles for _, r, v in grants(role["rules"]) if r == "secrets"}
    assert secret_grants == ({("secrets", "get")} if mode == "checkpoint-watch" else set())
