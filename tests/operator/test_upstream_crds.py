"""The RayJob, TrainJob and JobSet workloads the operator builds are what the upstream CRDs accept.

Each is validated against the published openAPIV3Schema (upstream_crds/, README there: versions
and sources) as an API server with strict field validation would: the schema as JSON Schema
(jsonschema; unknown fields are errors) and the CEL rules (cel-python) but the transition rules
(`oldSelf`: updates only). The statuses the fake controllers write (controllers.py) are checked
against the same schemas, so the verdicts the e2e tests read come from statuses the real
controllers could write.
"""

from __future__ import annotations

import copy
from functools import cache
from pathlib import Path

import jsonschema
import pytest
import yaml

from proxymodel_operator.outcome import FAILED, RUNNING, SUCCEEDED, workload_state
from proxymodel_operator.reproduction import RUN_VOLUME, Naming, reproduction_workload
from proxymodel_operator.resources import KUEUE_QUEUE_LABEL, LABEL_CHILD
from proxymodel_operator.runtimes import RUNTIMES, WATCHER
from proxymodel_operator.settings import Settings
from proxymodel_operator.spec import InvalidSpec, parse

from ..checkpoints.crd_schema import cel_errors, to_json_schema
from .controllers import STATUSES
from .harness import proxymodel

HERE = Path(__file__).parent / "upstream_crds"
CRDS = {"RayJob": "ray.io_rayjobs.yaml", "TrainJob": "trainer.kubeflow.org_trainjobs.yaml",
        "JobSet": "jobset.x-k8s.io_jobsets.yaml"}
VERL = {"spec": {"containers": [{
    "name": "verl", "image": "verlai/verl:vllm", "command": ["python3", "-m", "verl.trainer.main_ppo"],
    "args": ["trainer.nnodes=$(NNODES)", "trainer.n_gpus_per_node=$(NPROC_PER_NODE)",
             "actor_rollout_ref.model.path=$(MOEPROXY_PROXY_URI)"]}]}}


def _without_transition_rules(node):
    if isinstance(node, dict):
        out = {k: _without_transition_rules(v) for k, v in node.items() if k != "x-kubernetes-validations"}
        rules = [r for r in node.get("x-kubernetes-validations", []) if "oldSelf" not in r["rule"]]
        if rules:
            out["x-kubernetes-validations"] = rules
        return out
    if isinstance(node, list):
        return [_without_transition_rules(v) for v in node]
    return node


@cache
def _schema(runtime: str) -> dict:
    crd = yaml.safe_load((HERE / CRDS[runtime]).read_text())
    version = RUNTIMES[runtime].resource.version
    assert (crd["spec"]["group"], crd["spec"]["names"]["plural"], crd["spec"]["names"]["kind"]) == (
        RUNTIMES[runtime].resource.group, RUNTIMES[runtime].resource.plural, RUNTIMES[runtime].resource.kind)
    [served] = [v for v in crd["spec"]["versions"] if v["name"] == version and v["served"]]
    return _without_transition_rules(served["schema"]["openAPIV3Schema"])


def upstream_errors(runtime: str, obj: dict) -> list[str]:
    """Why the API server with the upstream CRD would refuse `obj` (empty: it accepts it)."""
    schema = _schema(runtime)
    validator = jsonschema.Draft7Validator(to_json_schema(schema))
    found = [f"{'.'.join(map(str, e.absolute_path)) or '.'}: {e.message}" for e in validator.iter_errors(obj)]
    return found or cel_errors(schema, obj)


def _built(runtime: str, devices: int, per_node: int = 8, naming: Naming | None = None, **reproduction) -> dict:
    body = proxymodel("q3", reproduction={"runtime": runtime, "accelerator": {"devices": devices,
                                                                              "devicesPerNode": per_node},
                                          "failOn": {"signature": "nan"}, **reproduction},
                      queueName="team-queue", ttlSecondsAfterFinished=600)
    spec = parse(body["spec"], "team-a", "q3", Settings())
    return reproduction_workload("q3", "team-a", 1, spec, "s3://ckpt/proxy/", "ab" * 32, devices, 4, 2, naming)


CASES = {
    "RayJob one node, moe-proxy repro": ("RayJob", 8, {}),
    "RayJob 2 nodes, moe-proxy repro": ("RayJob", 16, {}),
    "RayJob one node, verl": ("RayJob", 8, {"template": VERL}),
    "RayJob 4 nodes, verl": ("RayJob", 32, {"template": VERL, "sharedVolumeClaim": "rl-runs"}),
    "TrainJob one node": ("TrainJob", 8, {}),
    "TrainJob 4 nodes": ("TrainJob", 32, {"activeDeadlineSeconds": 3600}),
    "JobSet one node": ("JobSet", 8, {}),
    "JobSet 4 nodes": ("JobSet", 32, {}),
    "JobSet 2 nodes, verl": ("JobSet", 16, {"template": VERL, "failOn": {"signature": "nan", "stopOnReproduce": True}}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_workload_is_valid_against_the_upstream_crd(case):
    runtime, devices, extra = CASES[case]
    manifest = _built(runtime, devices, **extra)
    assert upstream_errors(runtime, manifest) == []
    assert manifest["metadata"]["labels"][KUEUE_QUEUE_LABEL] == "team-queue"
    assert manifest["spec"]["suspend"] is True  # created suspended: Kueue admits it
    for template in RUNTIMES[runtime].pod_templates(manifest["spec"]):  # its pods are found by the child label
        assert template["metadata"]["labels"][LABEL_CHILD] == manifest["metadata"]["name"]


@pytest.mark.parametrize("runtime", list(CRDS))
def test_a_diagnosis_run_is_valid_against_the_upstream_crd(runtime):
    naming = Naming("diag-lower-lr-s1", {"moeproxy.io/diagnosis": "diag", LABEL_CHILD: "diag-lower-lr-s1"},
                    ("--lr", "1e-7"), ({"name": "MOEPROXY_SEED", "value": "1"},))
    manifest = _built(runtime, 8, naming=naming)
    assert upstream_errors(runtime, manifest) == []
    assert manifest["metadata"]["name"] == "diag-lower-lr-s1"
    assert manifest["metadata"]["labels"][KUEUE_QUEUE_LABEL] == "team-queue"


def test_a_misspelt_field_is_caught():
    """The check is real: a field the CRD does not have, or a wrong type, is refused."""
    manifest = _built("RayJob", 8)
    manifest["spec"]["shutdownAfterJobFinish"] = True
    assert any("shutdownAfterJobFinish" in e for e in upstream_errors("RayJob", manifest))
    manifest = _built("TrainJob", 8)
    manifest["spec"]["trainer"]["numProcPerNode"] = 0
    assert upstream_errors("TrainJob", manifest)
    manifest = _built("JobSet", 8)
    manifest["spec"]["failurePolicy"]["maxRestarts"] = "none"
    assert upstream_errors("JobSet", manifest)


def test_rayjob_head_and_workers_follow_the_plan():
    manifest = _built("RayJob", 32, template=VERL, sharedVolumeClaim="rl-runs")
    spec = manifest["spec"]
    assert (spec["shutdownAfterJobFinishes"], spec["ttlSecondsAfterFinished"], spec["backoffLimit"]) == (True, 600, 0)
    head = spec["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    [workers] = spec["rayClusterSpec"]["workerGroupSpecs"]
    assert workers["replicas"] == workers["minReplicas"] == workers["maxReplicas"] == 3
    assert [c["name"] for c in head["initContainers"]] == [WATCHER]  # the watcher on the head only
    assert "initContainers" not in workers["template"]["spec"]
    for pod in (head, workers["template"]["spec"]):
        [ray] = pod["containers"]
        assert "command" not in ray and "args" not in ray  # KubeRay runs `ray start` there
        assert ray["resources"]["limits"]["huawei.com/Ascend910"] == 8
        assert {"name": RUN_VOLUME, "persistentVolumeClaim": {"claimName": "rl-runs"}} in pod["volumes"]
    assert spec["entrypoint"].startswith("python3 -m verl.trainer.main_ppo trainer.nnodes=\"${NNODES}\"")
    assert workers["rayStartParams"]["resources"] == '"{\\"NPU\\": 8}"'


def test_trainjob_names_its_runtime_and_the_plan():
    manifest = _built("TrainJob", 32, trainingRuntime="torch-distributed-npu")
    spec = manifest["spec"]
    assert spec["runtimeRef"] == {"name": "torch-distributed-npu", "apiGroup": "trainer.kubeflow.org",
                                  "kind": "ClusterTrainingRuntime"}
    trainer = spec["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (4, 8)
    assert trainer["resourcesPerNode"]["limits"] == {"huawei.com/Ascend910": 8}
    args = trainer["args"]  # the Trainer's torch plugin's variables
    assert args[args.index("--node-rank") + 1] == "$(PET_NODE_RANK)"
    assert args[args.index("--master-addr") + 1] == "$(PET_MASTER_ADDR)"
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert env["MOEPROXY_PROXY_URI"] == "s3://ckpt/proxy/"  # the repro reads the proxy from S3 itself


def test_jobset_is_one_indexed_job_never_restarted():
    manifest = _built("JobSet", 32)
    spec = manifest["spec"]
    [rj] = spec["replicatedJobs"]
    job = rj["template"]["spec"]
    assert (rj["replicas"], job["completionMode"], job["completions"], job["parallelism"]) == (1, "Indexed", 4, 4)
    assert spec["failurePolicy"] == {"maxRestarts": 0}
    env = {e["name"]: e for e in job["template"]["spec"]["containers"][0]["env"]}
    name = manifest["metadata"]["name"]
    assert env["MASTER_ADDR"]["value"] == f"{name}-node-0-0.{name}"  # the JobSet's pod host names
    assert env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"].endswith("job-completion-index']")


@pytest.mark.parametrize("reproduction, why", [
    ({"runtime": "TrainJob", "template": VERL}, "RayJob or a JobSet"),
    ({"runtime": "RayJob", "template": VERL, "accelerator": {"devices": 16}}, "sharedVolumeClaim"),
    ({"runtime": "RayJob", "template": VERL}, "sharedVolumeClaim"),  # devices auto: maybe more than one node
])
def test_what_a_runtime_cannot_run_is_refused_with_why(reproduction, why):
    body = proxymodel("q3", reproduction=reproduction)
    with pytest.raises(InvalidSpec, match=why):
        parse(body["spec"], "team-a", "q3", Settings())


def test_a_runtime_the_operator_does_not_serve_is_refused():
    body = proxymodel("q3", reproduction={"runtime": "JobSet"})
    with pytest.raises(InvalidSpec, match="runtimes.jobSet"):
        parse(body["spec"], "team-a", "q3", Settings(runtimes=("Job", "RayJob")))


@pytest.mark.parametrize("runtime, phase", [(r, p) for r in CRDS for p in STATUSES[r]])
def test_the_fake_controllers_statuses_are_upstream_statuses_and_read_as_meant(runtime, phase):
    """running, succeeded, failed (RayJob: Complete with jobStatus FAILED too) as the verdict."""
    manifest = _built(runtime, 8)
    status, expected = STATUSES[runtime][phase]
    obj = {**copy.deepcopy(manifest), "status": status}
    assert upstream_errors(runtime, obj) == []
    assert workload_state(RUNTIMES[runtime].resource, obj).state == expected
    assert expected in (RUNNING, SUCCEEDED, FAILED)
