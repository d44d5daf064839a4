"""The operator for real, against an emulated Kubernetes API and a real S3 server.

- `cluster`: kmock's KubernetesEmulator on 127.0.0.1 (CRUD, watch streams, finalizers), with the
  resources the operator uses declared, and a kubeconfig pointing at it (the operator logs in
  through kopf's own kubeconfig login, as it would outside a cluster).
- `s3`: SeaweedFS on 127.0.0.1 with source checkpoints' config.json.
- `operator`: kopf running the operator's handlers (a registry of this test's own, so no test
  depends on which modules another imported), failing the test at teardown if a handler raised
  an exception that kopf caught, unless the test declared it (`operator.expect_handler_errors`).
The emulator adds what an API server adds on writes (uid, generation, resourceVersion) and
enforces optimistic concurrency: a write carrying a stale metadata.resourceVersion gets 409.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import jsonpatch
import kmock
import kopf
import pytest
import pytest_asyncio

from moe_proxy.demo.seaweed import SeaweedFS
from proxymodel_operator import handlers  # noqa: F401 - registers the handlers

from .harness import ACCESS_KEY, BUCKET, DENSE, QWEN3, SECRET_KEY, Api, Operator, registry_copy


_versions = itertools.count(1)
VERBS = {"LIST": "list", "WATCH": "watch", "FETCH": "get", "CREATE": "create", "UPDATE": "patch", "DELETE": "delete"}


@dataclass(frozen=True)
class Call:
    """One API request: what RBAC would check, and whether the test (not the operator) made it."""

    group: str
    resource: str  # plural, with /subresource
    verb: str
    by_test: bool
    label_selector: str | None = None


class Emulator(kmock.KubernetesEmulator):
    """kmock's emulator plus what an API server adds on every write: a uid and creation time,
    a name for generateName, a resourceVersion bumped by every successful write (and checked:
    a write that carries a stale one gets 409 Conflict), and a generation bumped on spec
    changes (kopf and the operator rely on them)."""

    calls: list[Call]  # set per instance in __init__ below
    conflicts: list[Call]  # the writes answered 409 for a stale resourceVersion

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        object.__setattr__(self, "calls", [])
        object.__setattr__(self, "conflicts", [])
        # Check-and-write is atomic: one write at a time (reads and watch streams go on).
        object.__setattr__(self, "_write_lock", asyncio.Lock())

    async def _handle(self, request):
        # kmock matches each request against its whole request history (quadratic): keep only
        # the current one there, and our own light record of every API call for assertions.
        del self._requests[:-1]
        call = None
        if request.resource is not None and request.resource.plural and request.action is not None:
            call = Call(request.resource.group, request.resource.plural + (
                f"/{request.subresource}" if request.subresource else ""), VERBS[request.action.value],
                bool(request.headers.get("X-Test-Client")), request.params.get("labelSelector"))
            self.calls.append(call)
        if request.resource is None or request.action not in (kmock.action.CREATE, kmock.action.UPDATE,
                                                                kmock.action.DELETE):
            return await super()._handle(request)
        async with self._write_lock:
            conflict = self._stale(request)
            if conflict is not None:
                self.conflicts.append(call)
                return aiohttp.web.json_response(status=409, data=conflict)
            self._as_api_server(request)
            try:
                return await super()._handle(request)
            except jsonpatch.JsonPatchTestFailed as failed:
                # kopf's JSON patches open with a test of metadata.resourceVersion; an API server
                # answers a failed test 422 (kopf retries on its next cycle), kmock would say 500
                # (kopf then retries the same stale patch for minutes, handling nothing else).
                return aiohttp.web.json_response(status=422, data={
                    "kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Invalid",
                    "code": 422, "message": str(failed)})

    def _stored(self, request) -> dict | None:
        key = (request.resource, request.namespace, request.name)
        if request.name is None or key not in self.objects or self.objects[key].deleted:
            return None
        return dict(self.objects[key].raw)

    def _stale(self, request) -> dict | None:
        """The API server's answer to an update at a resourceVersion the object has left."""
        data = request.data
        wanted = ((data.get("metadata") or {}).get("resourceVersion") if isinstance(data, dict) else None)
        stored = self._stored(request) if request.action == kmock.action.UPDATE and wanted else None
        if stored is None or (stored.get("metadata") or {}).get("resourceVersion") == wanted:
            return None
        what = f"{request.resource.plural}.{request.resource.group}".rstrip(".")
        return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Conflict", "code": 409,
                "message": f'Operation cannot be fulfilled on {what} "{request.name}": the object has been '
                           "modified; please apply your changes to the latest version and try again"}

    def _as_api_server(self, request) -> None:
        data = request.data
        if isinstance(data, list) and request.action == kmock.action.UPDATE:  # a JSON patch
            data.append({"op": "add", "path": "/metadata/resourceVersion", "value": str(next(_versions))})
            return
        if not isinstance(data, dict) or request.action == kmock.action.DELETE:
            return
        meta = data.setdefault("metadata", {})
        meta["resourceVersion"] = str(next(_versions))
        if request.action == kmock.action.CREATE:
            if meta.get("generateName") and not meta.get("name"):
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("generation", 1)
            meta.setdefault("creationTimestamp", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        elif request.subresource is None and "spec" in data:
            old = self._stored(request)
            if old is not None and old.get("spec") != {**(old.get("spec") or {}), **data["spec"]}:
                meta["generation"] = (old.get("metadata") or {}).get("generation", 1) + 1


@pytest.fixture(scope="session")
def s3(tmp_path_factory) -> SeaweedFS:
    with SeaweedFS(tmp_path_factory.mktemp("seaweed"), ACCESS_KEY, SECRET_KEY, buckets=[BUCKET]) as server:
        client = server.client()
        client.put_object(Bucket=BUCKET, Key="qwen3-moe/global_step_100/config.json", Body=json.dumps(QWEN3).encode())
        client.put_object(Bucket=BUCKET, Key="llama/config.json", Body=json.dumps(DENSE).encode())
        client.put_object(Bucket=BUCKET, Key="broken/config.json", Body=b"{not json")
        yield server


@pytest.fixture()
def operator_env(monkeypatch, s3) -> dict[str, str]:
    env = {"MOEPROXY_S3_ENDPOINT": s3.endpoint_url, "MOEPROXY_TRANSFORMER_IMAGE": "registry.local/moe-proxy:test",
           "MOEPROXY_REPRO_IMAGE": "registry.local/moe-proxy-repro:test", "MOEPROXY_LOG_FORMAT": "plain",
           # A refused ProxyModel's dependencies (Secret, source) are looked at again this often.
           "MOEPROXY_RECHECK_INTERVAL": "0.5"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    # The operator pod has no AWS identity of its own: only the Secret's credentials work.
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(key, raising=False)
    return env


@pytest.fixture()
def checkpointwatch_resource(cluster):
    """The emulator serves CheckpointWatches too (asked for before the operator starts)."""
    cluster.emulator.resources["moeproxy.io/v1alpha1/checkpointwatches"] = kmock.ResourceInfo(
        kind="CheckpointWatch", subresources={"status"}, shortnames={"ckw"}, namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "delete"})


@pytest_asyncio.fixture()
async def cluster(tmp_path, monkeypatch) -> AsyncIterator[Api]:
    async with Emulator() as emulator, kmock.Server(emulator):
        emulator.resources.load_bundled()
        info = dict(namespaced=True, verbs={"get", "list", "watch", "create", "patch", "delete"})
        emulator.resources["moeproxy.io/v1alpha1/proxymodels"] = kmock.ResourceInfo(
            kind="ProxyModel", subresources={"status"}, shortnames={"pxm"}, **info)
        emulator.resources["moeproxy.io/v1alpha1/diagnoses"] = kmock.ResourceInfo(
            kind="Diagnosis", subresources={"status"}, shortnames={"pxd"}, **info)
        emulator.resources["batch.volcano.sh/v1alpha1/jobs"] = kmock.ResourceInfo(kind="Job", **info)
        emulator.resources["mindxdl.gitee.com/v1/ascendjobs"] = kmock.ResourceInfo(kind="AscendJob", **info)
        emulator.resources["ray.io/v1/rayjobs"] = kmock.ResourceInfo(kind="RayJob", subresources={"status"}, **info)
        emulator.resources["trainer.kubeflow.org/v1alpha1/trainjobs"] = kmock.ResourceInfo(
            kind="TrainJob", subresources={"status"}, **info)
        emulator.resources["jobset.x-k8s.io/v1alpha2/jobsets"] = kmock.ResourceInfo(
            kind="JobSet", subresources={"status"}, **info)
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
            "clusters": [{"name": "emulator", "cluster": {"server": str(emulator.url)}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tester",
                                                               "namespace": "default"}}],
            "users": [{"name": "tester", "user": {"token": "emulator-token"}}],
        }))
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        async with aiohttp.ClientSession(base_url=str(emulator.url).rstrip("/") + "/",
                                         headers={"X-Test-Client": "kubectl"}) as session:
            yield Api(emulator, session)


@pytest.fixture()
def registry() -> kopf.OperatorRegistry:
    """The handlers this test's operator runs: the ProxyModel handlers (handlers.py), in a
    registry of the test's own (test_checkpoint_watch.py adds the CheckpointWatch timer)."""
    return registry_copy()


@pytest_asyncio.fixture()
async def operator(cluster: Api, operator_env, registry) -> AsyncIterator[Operator]:
    running = Operator(registry=registry)
    await running.start()
    yield running
    await running.stop()
    running.check_handler_errors()
