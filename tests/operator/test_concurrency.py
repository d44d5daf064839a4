"""Optimistic concurrency, as an API server enforces it: the emulator answers a write at a stale
resourceVersion with 409, and the operator, which writes a child's verdict only at the version
it read, reads again, decides again and loses nothing of what another writer wrote meanwhile."""

from __future__ import annotations

import json

import kmock

from proxymodel_operator.resources import JOBS, PROXYMODELS

from .harness import ACCESS_KEY, SECRET_KEY, TRANSFORMER_REPORT, eventually, proxymodel

NS = "team-c"


async def test_a_stale_resource_version_gets_409_and_each_write_bumps_it(cluster):
    created = await cluster.create(PROXYMODELS, NS, proxymodel("v1"))
    first = created["metadata"]["resourceVersion"]
    written = await cluster.patch_status(PROXYMODELS, NS, "v1", {"phase": "Pending"}, resource_version=first)
    second = written["metadata"]["resourceVersion"]
    assert int(second) > int(first)
    # The object left `first` behind: a write at it is refused, and changes nothing.
    async with cluster.session.patch(PROXYMODELS.path(NS, "v1", "status").lstrip("/"),
                                     json={"metadata": {"resourceVersion": first}, "status": {"phase": "Failed"}},
                                     headers={"Content-Type": "application/merge-patch+json"}) as response:
        body = await response.json(content_type=None)
    assert response.status == 409 and (body["reason"], body["code"]) == ("Conflict", 409), body
    stored = cluster.get(PROXYMODELS, NS, "v1")
    assert stored["status"]["phase"] == "Pending" and stored["metadata"]["resourceVersion"] == second
    assert len(cluster.emulator.conflicts) == 1
    # A write without a resourceVersion is unconditional, as with kubectl's merge patches.
    unconditional = await cluster.patch(PROXYMODELS, NS, "v1", {"metadata": {"labels": {"a": "b"}}})
    assert int(unconditional["metadata"]["resourceVersion"]) > int(second)


async def test_a_json_patch_bumps_the_version_and_a_failed_test_is_422(cluster):
    """kopf writes finalizers by JSON patch opening with a test of metadata.resourceVersion: as an
    API server, the emulator bumps the version on such a patch and answers a stale test 422 (kopf
    then tries again on its next cycle; a 500 would have it retry the stale patch for minutes)."""
    created = await cluster.create(PROXYMODELS, NS, proxymodel("j1"))
    first = created["metadata"]["resourceVersion"]

    async def json_patch(version: str) -> tuple[int, dict]:
        ops = [{"op": "test", "path": "/metadata/resourceVersion", "value": version},
               {"op": "add", "path": "/metadata/finalizers", "value": ["moeproxy.io/test"]}]
        async with cluster.session.patch(PROXYMODELS.path(NS, "j1").lstrip("/"), json=ops,
                                         headers={"Content-Type": "application/json-patch+json"}) as response:
            return response.status, await response.json(content_type=None)

    status, body = await json_patch(first)
    assert status == 200 and body["metadata"]["finalizers"] == ["moeproxy.io/test"], body
    second = cluster.get(PROXYMODELS, NS, "j1")["metadata"]["resourceVersion"]
    assert int(second) > int(first)
    status, body = await json_patch(first)  # the object left `first` behind
    assert (status, body["code"]) == (422, 422), body
    assert cluster.get(PROXYMODELS, NS, "j1")["metadata"]["resourceVersion"] == second


async def test_a_conflict_between_read_and_patch_is_retried_and_loses_nothing(cluster, operator):
    """Another controller writes the ProxyModel's status between the operator's read and its
    versioned patch of the transformer's verdict: the patch gets 409, the operator reads the
    new version and decides again; both writers' changes are there in the end."""
    await cluster.secret(NS, "s3-creds", AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    await cluster.create(PROXYMODELS, NS, proxymodel("c1"))
    job = await eventually(lambda: cluster.get(JOBS, NS, "c1-transform-g1"), what="transformer Job")
    await eventually(lambda: cluster.status(NS, "c1").get("phase") == "Transforming")

    handle, injected = cluster.emulator._handle, []
    other = {"type": "ExternalAudit", "status": "True", "reason": "Audited", "message": "written by another writer"}

    async def conflicting(request):
        data = request.data if isinstance(request.data, dict) else {}
        versioned = (data.get("metadata") or {}).get("resourceVersion")
        if not injected and versioned and request.action == kmock.action.UPDATE and request.subresource == "status" \
                and not request.headers.get("X-Test-Client") and request.name == "c1":
            # Between the operator's read and this patch, another writer changes the object.
            conditions = cluster.status(NS, "c1").get("conditions") or []
            injected.append(await cluster.patch_status(PROXYMODELS, NS, "c1", {"conditions": [*conditions, other]}))
        return await handle(request)

    object.__setattr__(cluster.emulator, "_handle", conflicting)
    await cluster.transformer_succeeds(NS, job)
    await eventually(lambda: cluster.get(JOBS, NS, "c1-repro-g1"), what="the reproduction after the retry")
    await eventually(lambda: cluster.status(NS, "c1").get("phase") == "Reproducing")

    assert injected, "no versioned status patch was intercepted"
    conflicts = [c for c in cluster.emulator.conflicts if c.resource == "proxymodels/status" and not c.by_test]
    assert len(conflicts) == 1, cluster.emulator.conflicts  # the operator's patch got 409 once ...
    status = cluster.status(NS, "c1")
    assert status["proxy"]["uri"] == TRANSFORMER_REPORT["proxy_uri"]  # ... then wrote its verdict,
    kinds = {c["type"]: c for c in status["conditions"]}
    assert kinds["ExternalAudit"]["message"] == other["message"]  # keeping the other writer's,
    assert kinds["ProxyReady"]["reason"] == "ProxyBuilt"
    # and acted once: one ProxyReady Event, one reproduction Job.
    ready = lambda: [e for e in cluster.objects_of("events", NS) if e["reason"] == "ProxyReady"]  # noqa: E731
    await eventually(ready, what="the ProxyReady Event")  # kopf posts Events from a queue
    assert len(ready()) == 1, json.dumps(ready())
    assert cluster.names(JOBS, NS) == ["c1-repro-g1", "c1-transform-g1"]
