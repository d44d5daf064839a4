"""The reproduction the operator creates, run: its pods find each other and the verdict comes back.

From a ProxyModel (through kopf and the API emulator, as the other operator tests), the
reproduction workload the operator made is taken and its pods' containers are run as local
processes by a test kubelet (`kubelet.py`): env resolved as the pod spec says (the Secret's
credentials, the completion index), the pods' host names on 127.0.0.1. The pods' statuses
with their termination messages go back into the emulator as the kubelet would write them,
and the verdict has to reach the ProxyModel's status.

- `moe-proxy repro` on 2 pods x 2 ranks (CPU, gloo): one run, whose metrics are those of a
  1-process run of the same proxy;
- a user's template whose "framework" writes verl FileLogger lines with a NaN at step 3: the
  `moe-proxy watch` sidecar says `nan` at step 3.
"""

from __future__ import annotations

import json
import math
import textwrap

import pytest

from proxymodel_operator.reproduction import METRICS_FILE, RUN_DIR
from proxymodel_operator.resources import JOBS, PROXYMODELS, SERVICES
from proxymodel_operator.runtimes import JOB_COMPLETION_INDEX, WATCHER

from .harness import ACCESS_KEY, SECRET_KEY, eventually, proxymodel
from .kubelet import Kubelet, Pod

pytestmark = pytest.mark.slow
NS = "team-e2e"
STEPS = 2
RTOL, ATOL = 1e-5, 1e-6
UNTIMED = ("timing_s/", "perf/time_per_step", "perf/throughput")


@pytest.fixture(scope="module")
def tiny_proxy(tmp_path_factory):
    """A tiny Qwen3-MoE (8 experts, top-2) and its proxy at 4 experts, in local directories."""
    from moe_proxy.build import build_proxy
    from moe_proxy.demo.tiny import make_tiny

    root = tmp_path_factory.mktemp("e2e")
    make_tiny("qwen3_moe", root / "original")
    build_proxy(str(root / "original"), str(root / "proxy"), experts=4)
    return root / "proxy"


def _report(proxy) -> str:
    return json.dumps({"proxy_uri": str(proxy), "manifest_sha256": "ab" * 32, "architecture": "Qwen3-MoE",
                       "experts_per_layer": {"before": 8, "after": 4, "top_k": 2}, "params": {}, "bytes": {}})


async def _reproduction_of(cluster, name: str, proxy) -> dict:
    """Create the ProxyModel `name`, let its transformer report `proxy`: its reproduction Job."""
    await cluster.secret(NS, "s3-creds", AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    transformer = await eventually(lambda: cluster.get(JOBS, NS, f"{name}-transform-g1"), 30, "transformer Job")
    await cluster.finish_pod(NS, transformer, "transformer", 0, _report(proxy))
    await cluster.job_condition(NS, transformer["metadata"]["name"], "Complete")
    return await eventually(lambda: cluster.get(JOBS, NS, f"{name}-repro-g1"), 30, "reproduction Job")


def _pods(job: dict) -> list[Pod]:
    """The pods the Job controller makes of an Indexed Job: `<job>-<i>`, index annotated."""
    name, spec = job["metadata"]["name"], job["spec"]
    template = spec["template"]
    return [Pod(f"{name}-{i}", template, annotations={JOB_COMPLETION_INDEX: str(i)},
                labels={**template["metadata"]["labels"], "job-name": name},
                hostname=f"{name}-{i}", subdomain=template["spec"].get("subdomain", ""))
            for i in range(spec.get("completions") or 1)]


async def _run_and_report(cluster, kubelet: Kubelet, job: dict) -> dict:
    pods = _pods(job)
    ran = kubelet.run(pods)
    for pod in pods:
        await kubelet.report(pod, ran[pod.name], job["spec"]["template"])
    ok = all(r.exit_code == 0 for containers in ran.values() for r in containers.values())
    await cluster.job_condition(NS, job["metadata"]["name"], "Complete" if ok else "Failed")
    return ran


def _metrics(path) -> dict[int, dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {row["step"]: row["data"] for row in rows}


async def test_two_pods_of_two_ranks_are_one_run_with_the_one_process_metrics(cluster, operator, tiny_proxy,
                                                                              tmp_path):
    from moe_proxy.cli import main

    await cluster.create(PROXYMODELS, NS, proxymodel("d1", reproduction={
        "runtime": "Job", "maxSteps": STEPS, "precision": "fp32", "failOn": {"signature": "nan"},
        "accelerator": {"devices": 4, "devicesPerNode": 2}}))
    job = await _reproduction_of(cluster, "d1", tiny_proxy)
    assert (job["spec"]["completionMode"], job["spec"]["completions"], job["spec"]["parallelism"]) == ("Indexed", 2, 2)
    service = cluster.get(SERVICES, NS, "d1-repro-g1")  # the pods' subdomain, owned by the ProxyModel
    assert service["spec"]["clusterIP"] == "None" and job["spec"]["template"]["spec"]["subdomain"] == "d1-repro-g1"
    assert [o["kind"] for o in service["metadata"]["ownerReferences"]] == ["ProxyModel"]
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--nnodes") + 1] == "2" and args[args.index("--nproc-per-node") + 1] == "2"

    kubelet = Kubelet(cluster, NS, tmp_path / "node", hosts=["d1-repro-g1-0.d1-repro-g1"])
    ran = await _run_and_report(cluster, kubelet, job)
    for pod, containers in ran.items():
        assert containers["reproduction"].exit_code == 0, containers["reproduction"].output[-3000:]
    assert json.loads(ran["d1-repro-g1-0"]["reproduction"].message)["reproduced"] is False  # rank 0's verdict
    assert ran["d1-repro-g1-1"]["reproduction"].message == ""  # node 1 writes none
    env = kubelet.resolve_env(_pods(job)[1], job["spec"]["template"]["spec"]["containers"][0])
    assert (env["NODE_RANK"], env["AWS_SECRET_ACCESS_KEY"]) == ("1", SECRET_KEY)  # index and Secret resolved

    await eventually(lambda: cluster.status(NS, "d1").get("phase") == "NotReproduced", 30, "the verdict in status")
    assert cluster.status(NS, "d1")["reproduction"]["reproduced"] is False
    summary = json.loads((tmp_path / "node" / "d1-repro-g1-0" / "run" / "summary.json").read_text())
    assert summary["ranks"] == 4 and summary["steps_completed"] == STEPS

    one = tmp_path / "one"
    assert main(["repro", str(tiny_proxy), "--out", str(one), "--steps", str(STEPS), "--precision", "fp32",
                 "--fail-on", "nan"]) == 0
    four, single = _metrics(tmp_path / "node" / "d1-repro-g1-0" / "run" / "metrics.jsonl"), _metrics(one / "metrics.jsonl")
    assert sorted(four) == sorted(single) == list(range(STEPS))
    for step in single:
        assert four[step].keys() == single[step].keys()
        for key, x in single[step].items():
            y = four[step][key]
            assert key.startswith(UNTIMED) or (math.isnan(x) and math.isnan(y)) or \
                math.isclose(x, y, rel_tol=RTOL, abs_tol=ATOL), f"step {step} {key}: {x} != {y}"


FRAMEWORK = textwrap.dedent("""\
    import json, math, os, sys, time
    if os.environ["NODE_RANK"] != "0":  # only the driver (node 0) logs, as verl's FileLogger does
        sys.exit(0)
    assert os.environ["NNODES"] == "2" and os.environ["MASTER_ADDR"] and os.environ["MOEPROXY_EP_SIZES"] == "1,2"
    with open(os.environ["VERL_FILE_LOGGER_PATH"], "a") as f:
        for step in range(1, 6):
            loss = float("nan") if step == 3 else 1.0 / step
            f.write(json.dumps({"step": step, "elapsed_seconds": step * 0.1,
                                "data": {"actor/pg_loss": loss, "actor/grad_norm": 1.0}}) + "\\n")
            f.flush()
            time.sleep(0.3)
""")


async def test_a_frameworks_nan_at_step_3_is_the_sidecars_verdict(cluster, operator, tmp_path):
    script = tmp_path / "framework.py"
    script.write_text(FRAMEWORK)
    template = {"spec": {"containers": [{"name": "verl", "image": "verl:test", "command": ["python", str(script)]}]}}
    await cluster.create(PROXYMODELS, NS, proxymodel("d2", reproduction={
        "runtime": "Job", "maxSteps": 5, "template": template, "failOn": {"signature": "nan"},
        "accelerator": {"devices": 2, "devicesPerNode": 1}}))
    job = await _reproduction_of(cluster, "d2", tmp_path / "proxy")
    pod = job["spec"]["template"]["spec"]
    [sidecar] = pod["initContainers"]
    assert (sidecar["name"], sidecar["restartPolicy"]) == (WATCHER, "Always")
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["VERL_FILE_LOGGER_PATH"] == METRICS_FILE and env["MOEPROXY_EXPERTS_PER_LAYER"] == "4"
    assert {m["mountPath"] for m in sidecar["volumeMounts"]} == {RUN_DIR}

    kubelet = Kubelet(cluster, NS, tmp_path / "node", hosts=["d2-repro-g1-0.d2-repro-g1"])
    ran = await _run_and_report(cluster, kubelet, job)
    verdict = json.loads(ran["d2-repro-g1-0"][WATCHER].message)
    assert (verdict["reproduced"], verdict["signature"], verdict["step"]) == (True, "nan", 3)
    assert ran["d2-repro-g1-1"][WATCHER].message == ""  # node 1 has no metrics, and no verdict
    assert all(r.exit_code == 0 for containers in ran.values() for r in containers.values())

    await eventually(lambda: cluster.status(NS, "d2").get("phase") == "Reproduced", 30, "the verdict in status")
    result = cluster.status(NS, "d2")["reproduction"]
    assert (result["signature"], result["step"]) == ("nan", 3)
