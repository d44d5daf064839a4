"""How each runtime's pods find each other, in the manifests the operator makes (the Job's are
also run, in test_rendezvous_e2e.py), and the watch sidecar's life as a native sidecar."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from proxymodel_operator.reproduction import STOP_FILE, ep_sizes, headless_service, reproduction_workload
from proxymodel_operator.runtimes import RUNTIMES, WATCHER
from proxymodel_operator.settings import Settings
from proxymodel_operator.spec import parse

from .harness import proxymodel

TEMPLATE = {"spec": {"containers": [{"name": "verl", "image": "verl:1", "command": ["bash", "-c", "train"]}]}}


def _workload(runtime: str, devices: int = 16, **reproduction) -> dict:
    body = proxymodel("q3", reproduction={"runtime": runtime, "accelerator": {"devices": devices}, **reproduction})
    spec = parse(body["spec"], "team-a", "q3", Settings())
    return reproduction_workload("q3", "team-a", 1, spec, "s3://ckpt/proxy/", "ab" * 32, devices, 16, 8)


def _env(container: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_job_pods_meet_at_index_0_through_the_headless_service():
    job = _workload("Job")
    pod = job["spec"]["template"]["spec"]
    [container] = pod["containers"]
    env = _env(container)
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["NNODES"], env["NPROC_PER_NODE"]) == \
        ("q3-repro-g1-0.q3-repro-g1", "29500", "2", "8")
    assert env["NODE_RANK"] == {"fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}
    args = container["args"]
    assert args[args.index("--node-rank") + 1] == "$(NODE_RANK)" and args[args.index("--nnodes") + 1] == "2"
    service = headless_service(RUNTIMES["Job"], job)
    assert service["metadata"]["name"] == pod["subdomain"] == "q3-repro-g1"
    assert service["spec"]["selector"] == {"moeproxy.io/child": "q3-repro-g1"} and service["spec"]["publishNotReadyAddresses"]


def test_one_node_needs_no_service_and_no_multi_node_flags():
    job = _workload("Job", devices=8)
    assert headless_service(RUNTIMES["Job"], job) is None and "subdomain" not in job["spec"]["template"]["spec"]
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--nnodes" not in args and args[args.index("--nproc-per-node") + 1] == "8"


def test_volcano_pods_meet_at_the_first_host_of_the_svc_plugin():
    vc = _workload("VolcanoJob")
    assert set(vc["spec"]["plugins"]) == {"env", "svc"} and headless_service(RUNTIMES["VolcanoJob"], vc) is None
    container = vc["spec"]["tasks"][0]["template"]["spec"]["containers"][0]
    assert _env(container)["MASTER_ADDR"] == "q3-repro-g1-worker-0.q3-repro-g1"  # VC_WORKER_HOSTS' first
    assert "NODE_RANK" not in _env(container)  # appended later by the env plugin: only args can name it
    assert container["args"][container["args"].index("--node-rank") + 1] == "$(VC_TASK_INDEX)"


def test_ascend_takes_the_operators_rank_and_clears_its_torchrun_lookalikes():
    job = _workload("AscendJob")
    container = job["spec"]["replicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["env", "-u", "RANK", "-u", "WORLD_SIZE", "-u", "LOCAL_RANK", "-u",
                                    "LOCAL_WORLD_SIZE", "moe-proxy"]
    args = container["args"]
    assert args[args.index("--node-rank") + 1] == "$(RANK)" and args[args.index("--master-addr") + 1] == "$(MASTER_ADDR)"
    assert "MASTER_ADDR" not in _env(container)  # the Ascend operator's


@pytest.mark.parametrize("runtime, rank_var, sidecar_rank", [
    ("Job", None, "$(NODE_RANK)"), ("VolcanoJob", "VC_TASK_INDEX", "$(VC_TASK_INDEX)"), ("AscendJob", "RANK", "0")])
def test_a_template_gets_the_rendezvous_the_facts_and_a_watcher(runtime, rank_var, sidecar_rank):
    workload = _workload(runtime, template=TEMPLATE, failOn={"signature": "nan", "stopOnReproduce": True})
    templates = RUNTIMES[runtime].pod_templates(workload["spec"])
    pod = templates[0]["spec"]
    main = pod["containers"][0]
    env = _env(main)
    assert (env["NNODES"], env["NPROC_PER_NODE"], env["MOEPROXY_EXPERTS_PER_LAYER"], env["MOEPROXY_EP_SIZES"]) == \
        ("2", "8", "16", "1,2,4,8,16")
    assert env["MOEPROXY_TOP_K"] == "8" and env["VERL_FILE_LOGGER_PATH"] == "/run/moe-proxy/metrics.jsonl"
    assert main["command"][:2] == ["/bin/sh", "-c"]
    script = main["command"][2]
    assert main["command"][4:] == ["bash", "-c", "train"] and STOP_FILE in script  # stopOnReproduce
    assert (f'NODE_RANK:-${rank_var}' in script) == bool(rank_var)
    [sidecar] = pod["initContainers"]
    assert (sidecar["name"], sidecar["restartPolicy"], sidecar["command"]) == (WATCHER, "Always", ["moe-proxy"])
    args = sidecar["args"]
    assert args[:2] == ["watch", "/run/moe-proxy/metrics.jsonl"] and "--hold" in args
    assert args[args.index("--node-rank") + 1] == sidecar_rank and args[args.index("--stop-file") + 1] == STOP_FILE
    assert args[args.index("--last-step") + 1] == env["MOEPROXY_MAX_STEPS"]  # its log's end: judged at once
    for template in templates[1:]:  # AscendJob's Workers: node 0 is the Master, the watcher is there only
        assert WATCHER not in json.dumps(template.get("spec", {}).get("initContainers", []))


def test_a_templates_own_metrics_path_is_watched_and_a_container_without_command_is_left_alone():
    template = {"spec": {"containers": [{"name": "verl", "image": "v", "env": [
        {"name": "VERL_FILE_LOGGER_PATH", "value": "/out/m.jsonl"}], "volumeMounts": [{"name": "out", "mountPath": "/out"}]}]}}
    vc = _workload("VolcanoJob", template=template)
    pod = vc["spec"]["tasks"][0]["template"]["spec"]
    assert "command" not in pod["containers"][0]
    [sidecar] = pod["initContainers"]
    assert sidecar["args"][1] == "/out/m.jsonl" and {m["mountPath"] for m in sidecar["volumeMounts"]} == \
        {"/out", "/run/moe-proxy"}


def test_expert_parallel_sizes_divide_experts_and_devices():
    assert ep_sizes(16, 8) == [1, 2, 4, 8] and ep_sizes(6, 8) == [1, 2] and ep_sizes(4, 16) == [1, 2, 4]


def _watch(tmp_path: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "moe_proxy", "watch", *args, "--poll", "0.05"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_the_watcher_holds_its_verdict_until_sigterm(tmp_path):
    metrics, log = tmp_path / "m.jsonl", tmp_path / "termination-log"
    metrics.write_text(json.dumps({"step": 1, "data": {"actor/pg_loss": 1.0}}) + "\n"
                       + json.dumps({"step": 2, "data": {"actor/pg_loss": float("nan")}}) + "\n")
    watcher = _watch(tmp_path, str(metrics), "--fail-on", "nan", "--termination-log", str(log), "--hold")
    deadline = time.monotonic() + 30
    while not log.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert json.loads(log.read_text())["step"] == 2
    time.sleep(0.3)
    assert watcher.poll() is None  # decided, still up: a native sidecar that exits is restarted
    watcher.send_signal(signal.SIGTERM)
    assert watcher.wait(timeout=30) == 0 and json.loads(log.read_text())["signature"] == "nan"


def test_a_watcher_off_node_0_writes_nothing(tmp_path):
    log = tmp_path / "termination-log"
    watcher = _watch(tmp_path, str(tmp_path / "never.jsonl"), "--termination-log", str(log), "--node-rank", "1")
    time.sleep(1.0)
    watcher.send_signal(signal.SIGTERM)
    assert watcher.wait(timeout=30) == 0 and not log.exists()
