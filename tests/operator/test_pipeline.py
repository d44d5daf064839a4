"""The operator end to end: kopf for real against the emulated API, SeaweedFS for the source.

Each test plays the user (kubectl apply), the Job controller and the kubelet (Job conditions,
pods with termination messages), and checks what the operator made of it.
"""

from __future__ import annotations

import json
import logging

import pytest

from proxymodel_operator.resources import ASCEND_JOBS, JOBS, PROXYMODELS, VOLCANO_JOBS

from .harness import ACCESS_KEY, SECRET_KEY, SOURCE, TRANSFORMER_REPORT, eventually, proxymodel

NS = "team-a"


async def _apply(cluster, name: str = "q3", **overrides) -> None:
    await cluster.secret(NS, "s3-creds", AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    await cluster.create(PROXYMODELS, NS, proxymodel(name, **overrides))


async def _transformer_done(cluster, name: str = "q3", generation: int = 1) -> dict:
    job_name = f"{name}-transform-g{generation}"
    job = await eventually(lambda: cluster.get(JOBS, NS, job_name), what=f"Job {job_name}")
    await cluster.transformer_succeeds(NS, job)
    return job


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container["env"]}


async def test_apply_to_reproduced(cluster, operator, caplog):
    caplog.set_level(logging.INFO)
    await _apply(cluster)

    # The transformer Job: image, args, credentials by reference only, owned by the ProxyModel.
    job = await eventually(lambda: cluster.get(JOBS, NS, "q3-transform-g1"), what="transformer Job")
    pxm = cluster.get(PROXYMODELS, NS, "q3")
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "registry.local/moe-proxy:test"
    assert container["command"] == ["moe-proxy"]
    assert container["args"][:3] == ["build", SOURCE, f"{SOURCE}-proxies/{NS}/q3/"]
    args = container["args"]
    assert args[args.index("--experts") + 1] == "16" and args[args.index("--pin") + 1] == "3:17"
    assert args[args.index("--termination-log") + 1] == "/dev/termination-log"
    assert args[args.index("--endpoint-url") + 1].startswith("http://127.0.0.1:")
    env = _env(container)
    assert env["AWS_ACCESS_KEY_ID"] == {"name": "AWS_ACCESS_KEY_ID", "valueFrom": {
        "secretKeyRef": {"name": "s3-creds", "key": "AWS_ACCESS_KEY_ID"}}}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["key"] == "AWS_SECRET_ACCESS_KEY"
    assert env["AWS_REGION"]["value"] == "us-east-1"
    owner = job["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == \
        ("ProxyModel", "q3", pxm["metadata"]["uid"], True)
    assert job["spec"]["podFailurePolicy"]["rules"][0]["onExitCodes"]["values"] == [2]

    # Before any Job: the plan from config.json (Qwen3-30B-A3B, 128 -> 16 experts).
    await eventually(lambda: cluster.status(NS, "q3").get("phase") == "Transforming", what="Transforming")
    status = cluster.status(NS, "q3")
    assert status["experts"] == "128->16"
    assert status["plan"]["original"]["paramsTotal"] == 30_532_122_624
    assert status["plan"]["proxy"]["devices"] < status["plan"]["original"]["devices"]
    hours = status["plan"]["deviceHoursPerStep"]  # by phase of an RL step, through the API server
    assert float(hours["rolloutDecode"]["ratio"]) < float(hours["train"]["ratio"]) and "allToAll" in hours
    by_precision = status["plan"]["proxyDeviceHoursPerStep"]  # what a candidate at another precision costs
    assert by_precision["bf16"] == hours["total"]["proxy"] and float(by_precision["fp32"]) > float(by_precision["bf16"])
    assert cluster.condition(NS, "q3", "Accepted")["status"] == "True"

    # The transformer succeeds: ProxyReady with its summary, then the reproduction Job.
    await _transformer_done(cluster)
    repro = await eventually(lambda: cluster.get(JOBS, NS, "q3-repro-g1"), what="reproduction Job")
    status = cluster.status(NS, "q3")
    assert status["proxy"]["uri"] == TRANSFORMER_REPORT["proxy_uri"]
    assert status["proxy"]["manifestSha256"] == "ab" * 32
    assert status["proxy"]["params"]["totalAfter"] == 4559142912
    assert cluster.condition(NS, "q3", "ProxyReady")["reason"] == "ProxyBuilt"
    assert status["phase"] == "Reproducing"
    planned = status["plan"]["proxy"]["devices"]
    assert status["accelerators"] == f"{status['plan']['original']['devices']}->{planned}"
    rc = repro["spec"]["template"]["spec"]["containers"][0]
    assert rc["resources"]["limits"]["huawei.com/Ascend910"] == min(planned, 8)
    assert rc["args"][:2] == ["repro", TRANSFORMER_REPORT["proxy_uri"]]
    assert rc["args"][rc["args"].index("--fail-on") + 1] == "overflow"
    assert _env(rc)["MOEPROXY_PROXY_URI"]["value"] == TRANSFORMER_REPORT["proxy_uri"]
    # The transformer's manifest_sha256 (that of proxy-manifest.json) reaches the reproduction as is.
    assert _env(rc)["MOEPROXY_PROXY_MANIFEST_SHA256"]["value"] == TRANSFORMER_REPORT["manifest_sha256"]

    # The reproduction sees the overflow at step 17.
    report = {"reproduced": True, "signature": "overflow", "step": 17,
              "metrics": {"actor/grad_norm": float("inf"), "actor/pg_loss": 0.31}}
    await cluster.finish_pod(NS, repro, "reproduction", 0, json.dumps(report))
    await cluster.job_condition(NS, "q3-repro-g1", "Complete")
    await eventually(lambda: cluster.status(NS, "q3").get("phase") == "Reproduced", what="Reproduced")
    status = cluster.status(NS, "q3")
    assert status["reproduction"] == {"reproduced": True, "signature": "overflow", "step": 17,
                                      "metrics": {"actor/grad_norm": "inf", "actor/pg_loss": "0.31"}}
    reproduced = cluster.condition(NS, "q3", "FailureReproduced")
    assert (reproduced["status"], reproduced["reason"]) == ("True", "GradientOverflow")
    assert "step 17" in reproduced["message"]
    expected = ["TransformerCreated", "ProxyReady", "ReproductionCreated", "GradientOverflow"]
    await eventually(lambda: cluster.event_reasons(NS, "q3") == expected,
                     what=lambda: f"Events {expected}, not {cluster.event_reasons(NS, 'q3')}")

    # The credentials went nowhere: not in logs, status, Events, or the Jobs (only secretKeyRefs).
    for value in (ACCESS_KEY, SECRET_KEY):
        assert value not in caplog.text
        for kind in ("proxymodels", "jobs", "events"):
            assert value not in json.dumps(cluster.objects_of(kind, NS))


async def test_reproduction_disabled_stops_at_proxy_ready(cluster, operator):
    await _apply(cluster, reproduction={"enabled": False})
    mark = operator.mark()
    await _transformer_done(cluster)
    await eventually(lambda: cluster.status(NS, "q3").get("phase") == "ProxyReady")
    # Both handlers that judge the finished transformer (its Job's and its pod's) are done.
    await operator.handled("child_changed", "q3-transform-g1", since=mark)
    await operator.handled("pod_changed", "q3-transform-g1-0", since=mark)
    assert cluster.names(JOBS, NS) == ["q3-transform-g1"]


async def test_not_reproduced(cluster, operator):
    await _apply(cluster)
    await _transformer_done(cluster)
    repro = await eventually(lambda: cluster.get(JOBS, NS, "q3-repro-g1"))
    await cluster.finish_pod(NS, repro, "reproduction", 0, json.dumps(
        {"reproduced": False, "signature": None, "step": None, "metrics": {}}))
    await cluster.job_condition(NS, "q3-repro-g1", "Complete")
    await eventually(lambda: cluster.status(NS, "q3").get("phase") == "NotReproduced")
    assert cluster.condition(NS, "q3", "FailureReproduced")["reason"] == "NotObserved"


@pytest.mark.parametrize("runtime, resource, devices", [
    ("VolcanoJob", VOLCANO_JOBS, 16),
    ("AscendJob", ASCEND_JOBS, 16),
    ("Job", JOBS, 16),
])
async def test_runtimes_get_the_device_count(cluster, operator, runtime, resource, devices):
    await _apply(cluster, reproduction={"runtime": runtime, "accelerator": {"devices": devices},
                                        "queue": "rl", "env": [{"name": "INF_NAN_MODE_ENABLE", "value": "0"}]})
    await _transformer_done(cluster)
    child = await eventually(lambda: cluster.get(resource, NS, "q3-repro-g1"), what=f"{runtime}")
    assert child["metadata"]["ownerReferences"][0]["name"] == "q3"
    if runtime == "Job":  # two nodes: an Indexed Job, one pod per node
        assert (child["spec"]["completionMode"], child["spec"]["parallelism"]) == ("Indexed", 2)
        templates = [child["spec"]["template"]]
    elif runtime == "VolcanoJob":
        assert child["spec"]["minAvailable"] == 2 and child["spec"]["queue"] == "rl"
        templates = [t["template"] for t in child["spec"]["tasks"]]
        assert child["spec"]["tasks"][0]["replicas"] == 2
    else:
        replicas = child["spec"]["replicaSpecs"]
        assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == 1
        assert child["spec"]["runPolicy"]["schedulingPolicy"] == {"minAvailable": 2, "queue": "rl"}
        assert child["metadata"]["labels"]["ring-controller.atlas"] == "ascend-910b"
        templates = [r["template"] for r in replicas.values()]
    for template in templates:
        container = template["spec"]["containers"][0]
        assert container["resources"]["limits"]["huawei.com/Ascend910"] == 8
        assert container["resources"]["requests"]["huawei.com/Ascend910"] == 8
        assert _env(container)["INF_NAN_MODE_ENABLE"]["value"] == "0"
        if runtime == "AscendJob":
            assert container["name"] == "ascend"
    assert cluster.status(NS, "q3")["accelerators"].endswith("->16")


@pytest.mark.parametrize("devices, built", [("auto", "16"), (4, "8")])
async def test_the_job_builds_the_planned_expert_count(cluster, operator, devices, built):
    """A keep ratio of 1/16 keeps 8 of Qwen3-30B-A3B's 128 experts, its top-k: routing would be
    trivial. The planner raises that to 16 where the device budget holds it, and the transformer
    Job must build what was planned (and what the reproduction is sized for); with a budget of
    4 devices it stays at 8, and status says why."""
    manifest = proxymodel("ratio", reproduction={"accelerator": {"devices": devices}})
    manifest["spec"]["pruning"] = {"keepRatio": 0.0625}
    await cluster.secret(NS, "s3-creds", AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    await cluster.create(PROXYMODELS, NS, manifest)
    job = await eventually(lambda: cluster.get(JOBS, NS, "ratio-transform-g1"), what="transformer Job")
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--experts") + 1] == built and "--keep-ratio" not in args
    status = cluster.get(PROXYMODELS, NS, "ratio")["status"]
    assert status["plan"]["proxy"]["expertsPerLayer"] == int(built)
    assert status["experts"] == f"128->{built}"
    (note,) = status["plan"]["notes"]
    assert note.startswith("kept experts raised from 8" if built == "16" else "kept experts stay 8"), note
