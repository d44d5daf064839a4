"""The reproduction the operator creates, run: its pods find each other and the verdict comes back.

From a ProxyModel (through kopf and the API emulator, as the other operator tests), the
reproduction workload the operator made is taken; its runtime's controller makes its pods, with
what that controller injects (`controllers.py`: the Job controller's completion index, Volcano's
env and svc plugins, the Ascend operator's PyTorch environment and Master Service), and a test
kubelet runs their containers as local processes (`kubelet.py`): env resolved as the pod spec
says (the Secret's credentials, the controllers' ConfigMaps and downward-API fields), the pods'
host names on 127.0.0.1. The pods' statuses with their termination messages go back into the
emulator as the kubelet would write them, the controller finishes the workload, and the verdict
has to reach the ProxyModel's status.

- `moe-proxy repro` on 2 pods x 2 ranks (CPU, gloo), for each runtime: one run, whose metrics
  are those of a 1-process run of the same proxy;
- a user's template whose "framework" writes verl FileLogger lines with a NaN at step 3, for
  each runtime: its containers get their node rank, and the `moe-proxy watch` sidecar says
  `nan` at step 3.
"""

from __future__ import annotations

import json
import math
import os
import sys
import textwrap
from pathlib import Path

import kubernetes_validate
import pytest

from proxymodel_operator.reproduction import METRICS_PATH, READY_FILE, RUN_DIR, RUN_VOLUME
from proxymodel_operator.resources import JOBS, PROXYMODELS, SERVICES
from proxymodel_operator.runtimes import RUNTIMES, WATCHER

from .controllers import ASCEND_MASTER_IP, CONTROLLERS, Started
from .harness import ACCESS_KEY, SECRET_KEY, eventually, proxymodel, tiny_proxy_in, tiny_report
from .kubelet import Kubelet, Ran

pytestmark = pytest.mark.slow
NS = "team-e2e"
STEPS = 2
RTOL, ATOL = 1e-5, 1e-6
UNTIMED = ("timing_s/", "perf/time_per_step", "perf/throughput")


@pytest.fixture(scope="module")
def tiny_proxy(tmp_path_factory):
    """A tiny Qwen3-MoE (8 experts, top-2) and its proxy at 4 experts, in local directories."""
    return tiny_proxy_in(tmp_path_factory.mktemp("e2e"))


async def _reproduction_of(cluster, name: str, proxy, runtime: str = "Job") -> dict:
    """Create the ProxyModel `name`, let its transformer report `proxy`: its reproduction workload."""
    await cluster.secret(NS, "s3-creds", AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    transformer = await eventually(lambda: cluster.get(JOBS, NS, f"{name}-transform-g1"), 30, "transformer Job")
    await cluster.finish_pod(NS, transformer, "transformer", 0, tiny_report(proxy))
    await cluster.job_condition(NS, transformer["metadata"]["name"], "Complete")
    resource = RUNTIMES[runtime].resource
    return await eventually(lambda: cluster.get(resource, NS, f"{name}-repro-g1"), 30, f"reproduction {runtime}")


async def _run_and_report(cluster, root, runtime: str, workload: dict) -> tuple[Started, dict[str, dict[str, Ran]],
                                                                             Kubelet]:
    """The runtime's controller makes the pods, the kubelet runs them and reports them, the
    controller finishes the workload: (its pods, pod -> container -> how it ran, the kubelet)."""
    controller = CONTROLLERS[runtime]
    started = await controller.start(cluster, NS, workload)
    kubelet = Kubelet(cluster, NS, root, hosts=started.hosts)
    ran = kubelet.run(started.pods)
    for pod in started.pods:
        await kubelet.report(pod, ran[pod.name])
    ok = all(r.exit_code == 0 for containers in ran.values() for r in containers.values())
    await controller.finish(cluster, NS, workload, ok)
    return started, ran, kubelet


def _metrics(path) -> dict[int, dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {row["step"]: row["data"] for row in rows}


@pytest.fixture(scope="module")
def one_process(tiny_proxy, tmp_path_factory) -> dict[int, dict]:
    """The metrics of a 1-process run of the same proxy: what every 2 x 2 run has to give."""
    from moe_proxy.cli import main

    one = tmp_path_factory.mktemp("one")
    assert main(["repro", str(tiny_proxy), "--out", str(one), "--steps", str(STEPS), "--precision", "fp32",
                 "--fail-on", "nan"]) == 0
    return _metrics(one / "metrics.jsonl")


def _runtime_wiring(runtime: str, workload: dict, started: Started, env: dict[str, str], cluster, root) -> None:
    """What ties each runtime's pods together, as the controller and the operator made it (env of node 1)."""
    job = workload["metadata"]["name"]
    if runtime == "Job":  # the headless Service: the pods' subdomain, owned by the ProxyModel
        service = cluster.get(SERVICES, NS, job)
        assert service["spec"]["clusterIP"] == "None" and workload["spec"]["template"]["spec"]["subdomain"] == job
        assert [o["kind"] for o in service["metadata"]["ownerReferences"]] == ["ProxyModel"]
        assert (env["NODE_RANK"], env["MASTER_ADDR"]) == ("1", f"{job}-0.{job}")
    elif runtime == "VolcanoJob":  # the operator's master is the svc plugin's first host
        hosts = (root / started.pods[1].name / f"{job}-svc" / "worker.host").read_text().splitlines()
        assert env["MASTER_ADDR"] == hosts[0] == env["VC_WORKER_HOSTS"].split(",")[0] == f"{job}-worker-0.{job}"
        assert (env["VC_TASK_INDEX"], env["VK_TASK_INDEX"], env["VC_WORKER_NUM"]) == ("1", "1", "2")
    elif runtime == "JobSet":  # the JobSet's pod host names under its own headless Service
        assert (env["NODE_RANK"], env["MASTER_ADDR"]) == ("1", f"{job}-node-0-0.{job}")
        assert started.pods[1].hostname == f"{job}-node-0-1" and started.pods[1].subdomain == job
    elif runtime == "TrainJob":  # the Trainer's torch plugin's PET_* variables, read by the repro's flags
        assert (env["PET_NODE_RANK"], env["PET_NNODES"], env["PET_NPROC_PER_NODE"]) == ("1", "2", "2")
        assert env["PET_MASTER_ADDR"] == f"{job}-node-0-0.{job}"
    else:  # the Ascend operator's values, not torchrun's: the launcher clears them
        assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["LOCAL_RANK"]) == ("1", "4", "2", "0,1")
        assert env["MASTER_ADDR"] == ASCEND_MASTER_IP and started.pods[1].name == f"{job}-worker-0"


@pytest.mark.parametrize("runtime", ["Job", "VolcanoJob", "AscendJob", "JobSet", "TrainJob"])
async def test_two_pods_of_two_ranks_are_one_run_with_the_one_process_metrics(cluster, operator, tiny_proxy,
                                                                              one_process, tmp_path, runtime):
    name = {"Job": "d1", "VolcanoJob": "dv", "AscendJob": "da", "JobSet": "dj", "TrainJob": "dt"}[runtime]
    await cluster.create(PROXYMODELS, NS, proxymodel(name, reproduction={
        "runtime": runtime, "maxSteps": STEPS, "precision": "fp32", "failOn": {"signature": "nan"},
        "accelerator": {"devices": 4, "devicesPerNode": 2}}))
    workload = await _reproduction_of(cluster, name, tiny_proxy, runtime)
    args = RUNTIMES[runtime].pod_templates(workload["spec"])[0]["spec"]["containers"][0]["args"]
    assert args[args.index("--nnodes") + 1] == "2" and args[args.index("--nproc-per-node") + 1] == "2"

    root = tmp_path / "node"
    started, ran, kubelet = await _run_and_report(cluster, root, runtime, workload)
    assert len(started.pods) == 2
    runs = [ran[pod.name][started.container] for pod in started.pods]
    for run in runs:
        assert run.exit_code == 0, run.output[-3000:]
    assert json.loads(runs[0].message)["reproduced"] is False and runs[1].message == ""  # rank 0's verdict only
    node1 = started.pods[1]
    env = kubelet.resolve_env(node1, next(c for c in node1.template["spec"]["containers"]
                                          if c["name"] == started.container))
    assert env["AWS_SECRET_ACCESS_KEY"] == SECRET_KEY  # the Secret resolved
    _runtime_wiring(runtime, workload, started, env, cluster, root)

    await eventually(lambda: cluster.status(NS, name).get("phase") == "NotReproduced", 30, "the verdict in status")
    assert cluster.status(NS, name)["reproduction"]["reproduced"] is False
    summary = json.loads((root / started.pods[0].name / "run" / "summary.json").read_text())
    assert summary["ranks"] == 4 and summary["steps_completed"] == STEPS

    four, single = _metrics(root / started.pods[0].name / "run" / "metrics.jsonl"), one_process
    assert sorted(four) == sorted(single) == list(range(STEPS))
    for step in single:
        assert four[step].keys() == single[step].keys()
        for key, x in single[step].items():
            y = four[step][key]
            assert key.startswith(UNTIMED) or (math.isnan(x) and math.isnan(y)) or \
                math.isclose(x, y, rel_tol=RTOL, abs_tol=ATOL), f"step {step} {key}: {x} != {y}"


FRAMEWORK = textwrap.dedent("""\
    import json, math, os, sys, time
    with open(os.path.join(os.path.dirname(os.environ["VERL_FILE_LOGGER_PATH"]), "node-rank"), "w") as f:
        f.write(os.environ["NODE_RANK"])
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


@pytest.mark.parametrize("runtime", ["Job", "VolcanoJob", "AscendJob", "JobSet"])
async def test_a_frameworks_nan_at_step_3_is_the_sidecars_verdict(cluster, operator, tmp_path, runtime):
    """The template's containers learn their node rank from each runtime's own variable (the
    prelude), and node 0's watcher gives the verdict (on an AscendJob only the Master has one)."""
    name = {"Job": "d2", "VolcanoJob": "dw", "AscendJob": "db", "JobSet": "dk"}[runtime]
    script = tmp_path / "framework.py"
    script.write_text(FRAMEWORK)
    template = {"spec": {"containers": [{"name": "verl", "image": "verl:test", "command": ["python", str(script)]}]}}
    await cluster.create(PROXYMODELS, NS, proxymodel(name, reproduction={
        "runtime": runtime, "maxSteps": 5, "template": template, "failOn": {"signature": "nan"},
        "accelerator": {"devices": 2, "devicesPerNode": 1}}))
    workload = await _reproduction_of(cluster, name, tmp_path / "proxy", runtime)
    pod = RUNTIMES[runtime].pod_templates(workload["spec"])[0]["spec"]
    [sidecar] = pod["initContainers"]
    assert (sidecar["name"], sidecar["restartPolicy"]) == (WATCHER, "Always")
    # the framework starts once the watcher listens for SIGTERM (the kubelet here waits for the probe too)
    assert sidecar["startupProbe"]["exec"]["command"] == ["test", "-e", READY_FILE] and READY_FILE in sidecar["args"]
    if runtime == "Job":  # the API server's schema takes it (a sidecar's startupProbe is Kubernetes >= 1.29)
        kubernetes_validate.validate(workload, "1.31.0", strict=True)
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["VERL_FILE_LOGGER_PATH"] == METRICS_PATH and env["MOEPROXY_EXPERTS_PER_LAYER"] == "4"
    assert {m["mountPath"] for m in sidecar["volumeMounts"]} == {RUN_DIR}

    started, ran, _ = await _run_and_report(cluster, tmp_path / "node", runtime, workload)
    node0, node1 = (ran[p.name] for p in started.pods)
    assert [(tmp_path / "node" / p.name / RUN_VOLUME / "node-rank").read_text() for p in started.pods] == ["0", "1"]
    verdict = json.loads(node0[WATCHER].message)
    assert (verdict["reproduced"], verdict["signature"], verdict["step"]) == (True, "nan", 3)
    assert node1[WATCHER].message == "" if runtime != "AscendJob" else WATCHER not in node1  # no metrics there
    assert all(r.exit_code == 0 for containers in ran.values() for r in containers.values()), \
        [r.output[-2000:] for containers in ran.values() for r in containers.values() if r.exit_code]

    await eventually(lambda: cluster.status(NS, name).get("phase") == "Reproduced", 30, "the verdict in status")
    result = cluster.status(NS, name)["reproduction"]
    assert (result["signature"], result["step"]) == ("nan", 3)


RAY_DRIVER = textwrap.dedent("""\
    import json, os, time
    assert os.environ["MOEPROXY_PROXY_URI"] and os.environ["NNODES"] == "1"
    with open(os.environ["VERL_FILE_LOGGER_PATH"], "a") as f:
        for step in range(1, 6):
            loss = float("nan") if step == 3 else 1.0 / step
            f.write(json.dumps({"step": step, "data": {"actor/pg_loss": loss, "actor/grad_norm": 1.0}}) + "\\n")
            f.flush()
            time.sleep(0.3)
""")


async def test_a_rayjobs_driver_logs_and_the_heads_watcher_gives_the_verdict(cluster, operator, tmp_path):
    """verl's way on a RayJob (one node here): the entrypoint (the template's command) runs on the
    head with the head's environment, writes the FileLogger lines, and the head's watcher says `nan`
    at step 3."""
    script = tmp_path / "driver.py"
    script.write_text(RAY_DRIVER)
    template = {"spec": {"containers": [{"name": "verl", "image": "verl:test",
                                         "command": [sys.executable, str(script)]}]}}
    await cluster.create(PROXYMODELS, NS, proxymodel("dr", reproduction={
        "runtime": "RayJob", "maxSteps": 5, "template": template, "failOn": {"signature": "nan"},
        "accelerator": {"devices": 1, "devicesPerNode": 1}}))
    workload = await _reproduction_of(cluster, "dr", tmp_path / "proxy", "RayJob")
    assert workload["spec"]["entrypoint"] == f"{sys.executable} {script}"
    started, ran, _ = await _run_and_report(cluster, tmp_path / "node", "RayJob", workload)
    [head] = started.pods
    assert all(r.exit_code == 0 for r in ran[head.name].values()), [r.output[-2000:] for r in ran[head.name].values()]
    verdict = json.loads(ran[head.name][WATCHER].message)
    assert (verdict["reproduced"], verdict["signature"], verdict["step"]) == (True, "nan", 3)
    await eventually(lambda: cluster.status(NS, "dr").get("phase") == "Reproduced", 30, "the verdict in status")


FAKE_RAY = Path(__file__).parent / "fake_ray"


async def test_a_rayjobs_repro_over_two_nodes_is_one_run_through_the_launcher(cluster, operator, tiny_proxy,
                                                                             one_process, tmp_path, monkeypatch):
    """`moe-proxy repro` on a RayJob of 2 pods x 2 ranks: the entrypoint (runtimes_ray.LAUNCHER, here
    on a stand-in of Ray's API, tests/operator/fake_ray) starts each node's ranks as a Ray task pinned
    to its node; one run, with the 1-process metrics, its verdict the head's."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FAKE_RAY), os.environ.get("PYTHONPATH", "")]))
    await cluster.create(PROXYMODELS, NS, proxymodel("dr2", reproduction={
        "runtime": "RayJob", "maxSteps": STEPS, "precision": "fp32", "failOn": {"signature": "nan"},
        "accelerator": {"devices": 4, "devicesPerNode": 2}}))
    workload = await _reproduction_of(cluster, "dr2", tiny_proxy, "RayJob")
    assert workload["spec"]["entrypoint"].startswith("python3 -c ")
    assert workload["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] == 1
    started, ran, _ = await _run_and_report(cluster, tmp_path / "node", "RayJob", workload)
    head = ran[started.pods[0].name][started.container]
    assert head.exit_code == 0, head.output[-3000:]
    assert json.loads(head.message)["reproduced"] is False
    await eventually(lambda: cluster.status(NS, "dr2").get("phase") == "NotReproduced", 30, "the verdict in status")
    run = tmp_path / "node" / started.pods[0].name / "run"
    assert json.loads((run / "summary.json").read_text())["ranks"] == 4
    four = _metrics(run / "metrics.jsonl")
    for step, row in one_process.items():
        for key, x in row.items():
            y = four[step][key]
            assert key.startswith(UNTIMED) or (math.isnan(x) and math.isnan(y)) or \
                math.isclose(x, y, rel_tol=RTOL, abs_tol=ATOL), f"step {step} {key}: {x} != {y}"
