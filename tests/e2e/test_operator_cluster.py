"""The ProxyModel scenario on a real cluster (kind, k3d, ...), when a kubeconfig reaches one.

The operator runs here (kopf in a thread, logged in with the kubeconfig, as `kopf run` would);
the CRD is applied to the cluster; the Jobs run for real on its nodes. No accelerators and no
moe-proxy image are needed: the transformer and reproduction containers are `busybox` writing
the same termination messages the real ones write, and the "accelerator" is one CPU. So the
API server's schema validation, the Job controller, the kubelet's termination messages and
owner references are all real. SeaweedFS on 127.0.0.1 serves config.json to the operator's
preflight read. Skipped when no cluster answers. Everything lives in a fresh namespace that
the test deletes.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from pathlib import Path

import pytest
import yaml

from moe_proxy.demo.seaweed import SeaweedFS

from ..operator.harness import ACCESS_KEY, QWEN3, SECRET_KEY, TRANSFORMER_REPORT, Operator

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
GROUP, VERSION, PLURAL = "moeproxy.io", "v1alpha1", "proxymodels"
IMAGE = "busybox:1.36"


def _cluster():
    """The kubernetes client's ApiClient for the current kubeconfig, or skip."""
    kubernetes = pytest.importorskip("kubernetes")
    try:
        kubernetes.config.load_kube_config()
        client = kubernetes.client.ApiClient()
        kubernetes.client.VersionApi(client).get_code(_request_timeout=3)
    except Exception as exc:  # noqa: BLE001 - any failure means: no cluster here
        pytest.skip(f"no Kubernetes cluster reachable through the kubeconfig ({type(exc).__name__})")
    return kubernetes, client


@pytest.fixture(scope="module")
def cluster():
    kubernetes, client = _cluster()
    ext = kubernetes.client.ApiextensionsV1Api(client)
    crd = yaml.safe_load((ROOT / "crds" / "proxymodels.moeproxy.io.yaml").read_text())
    try:
        ext.create_custom_resource_definition(crd)
    except kubernetes.client.ApiException as exc:
        if exc.status != 409:
            raise
        ext.patch_custom_resource_definition(crd["metadata"]["name"], crd)
    deadline = time.monotonic() + 60
    while not any(c.type == "Established" and c.status == "True"
                  for c in ext.read_custom_resource_definition(crd["metadata"]["name"]).status.conditions or []):
        assert time.monotonic() < deadline, "the ProxyModel CRD was not established"
        time.sleep(1)
    namespace = f"moe-proxy-e2e-{uuid.uuid4().hex[:6]}"
    core = kubernetes.client.CoreV1Api(client)
    core.create_namespace({"metadata": {"name": namespace}})
    core.create_namespaced_secret(namespace, {"metadata": {"name": "s3-creds"}, "data": {
        "AWS_ACCESS_KEY_ID": base64.b64encode(ACCESS_KEY.encode()).decode(),
        "AWS_SECRET_ACCESS_KEY": base64.b64encode(SECRET_KEY.encode()).decode()}})
    yield kubernetes, client, namespace
    core.delete_namespace(namespace)


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with SeaweedFS(tmp_path_factory.mktemp("seaweed"), ACCESS_KEY, SECRET_KEY, buckets=["ckpt"]) as server:
        server.client().put_object(Bucket="ckpt", Key="qwen3/config.json", Body=json.dumps(QWEN3).encode())
        yield server


def _writes(report: dict) -> dict:
    """A busybox container that reports `report` as its termination message, like moe-proxy."""
    return {"image": IMAGE, "imagePullPolicy": "IfNotPresent", "command": ["sh", "-c"],
            "args": [f"echo '{json.dumps(report)}' > /dev/termination-log"]}


async def _wait(read, check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        obj = await asyncio.to_thread(read)
        if check(obj):
            return obj
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {json.dumps(obj.get('status'))[:2000]}"
        await asyncio.sleep(2)


async def test_proxymodel_on_a_real_cluster(cluster, s3, monkeypatch):
    kubernetes, client, namespace = cluster
    custom = kubernetes.client.CustomObjectsApi(client)
    batch = kubernetes.client.BatchV1Api(client)
    monkeypatch.setenv("MOEPROXY_S3_ENDPOINT", s3.endpoint_url)

    # The API server itself rejects a bad ProxyModel (schema and CEL rules).
    bad = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ProxyModel", "metadata": {"name": "bad"},
           "spec": {"source": {"uri": "s3://ckpt/qwen3"}, "pruning": {"experts": 16, "keepRatio": 0.5}}}
    with pytest.raises(kubernetes.client.ApiException) as rejected:
        custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, bad)
    assert rejected.value.status == 422 and "exactly one of experts or keepRatio" in rejected.value.body

    reproduced = {"reproduced": True, "signature": "overflow", "step": 3, "metrics": {"actor/grad_norm": "inf"}}
    pxm = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ProxyModel", "metadata": {"name": "qwen3"}, "spec": {
        "source": {"uri": "s3://ckpt/qwen3", "credentialsSecret": "s3-creds", "region": "us-east-1"},
        "pruning": {"experts": 16},
        "transformer": _writes(TRANSFORMER_REPORT),
        "reproduction": {**_writes(reproduced), "runtime": "Job", "failOn": {"signature": "overflow"},
                         "accelerator": {"resource": "cpu", "devices": 1, "devicesPerNode": 1}},
        "ttlSecondsAfterFinished": 600,
    }}
    operator = Operator(namespaces=[namespace])
    await operator.start()
    try:
        await asyncio.to_thread(custom.create_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL, pxm)

        def read():
            return custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "qwen3")

        done = await _wait(read, lambda o: (o.get("status") or {}).get("phase") in ("Reproduced", "Failed"),
                           300, "Reproduced")
        status = done["status"]
        assert status["phase"] == "Reproduced", status
        assert status["proxy"]["uri"] == TRANSFORMER_REPORT["proxy_uri"]
        assert status["reproduction"]["step"] == 3 and status["experts"] == "128->16"
        jobs = await asyncio.to_thread(batch.list_namespaced_job, namespace)
        names = sorted(j.metadata.name for j in jobs.items)
        assert names == ["qwen3-repro-g1", "qwen3-transform-g1"]
        for job in jobs.items:
            assert job.metadata.owner_references[0].uid == done["metadata"]["uid"]

        # What `kubectl get pxm` prints: the CRD's printer columns, as the API server renders them.
        table = await asyncio.to_thread(
            client.call_api, f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}", "GET",
            header_params={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"},
            auth_settings=["BearerToken"], response_type="object", _return_http_data_only=True)
        columns = [c["name"] for c in table["columnDefinitions"] if c.get("priority", 0) == 0]
        assert columns == ["Name", "Phase", "Experts", "Accelerators", "Reproduced", "Age"]
        row = table["rows"][0]["cells"]
        assert row[:5] == ["qwen3", "Reproduced", "128->16", f"{status['plan']['original']['devices']}->1", True]
    finally:
        await operator.stop()
