"""The runtimes table is the one place a reproduction runtime is declared: the CRD's enum,
RBAC, the watched resources and the manifests all follow it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from proxymodel_operator import rbac
from proxymodel_operator.reproduction import reproduction_workload
from proxymodel_operator.resources import LABEL_CHILD
from proxymodel_operator.runtimes import RUNTIMES, WORKLOADS, runtime_of
from proxymodel_operator.settings import Settings
from proxymodel_operator.spec import parse

from .harness import proxymodel

CRD = Path(__file__).resolve().parents[2] / "crds" / "proxymodels.moeproxy.io.yaml"
VERL = {"spec": {"containers": [{"name": "verl", "image": "verlai/verl:vllm", "command": ["python3", "-m",
                                                                                       "verl.trainer.main_ppo"]}]}}


def _crd_runtime_schema() -> dict:
    crd = yaml.safe_load(CRD.read_text())
    [version] = [v for v in crd["spec"]["versions"] if v.get("storage")]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return spec["properties"]["reproduction"]["properties"]["runtime"]


def test_the_crd_enum_names_exactly_the_runtimes():
    schema = _crd_runtime_schema()
    assert schema["enum"] == list(RUNTIMES)
    assert schema["default"] in RUNTIMES


@pytest.mark.parametrize("name", list(RUNTIMES))
def test_each_runtime_has_rbac_to_create_follow_and_delete(name):
    resource = RUNTIMES[name].resource
    for verb in ("create", "get", "list", "watch", "delete"):
        assert rbac.allowed(resource.group, resource.plural, verb), (name, verb)


@pytest.mark.parametrize("name", list(RUNTIMES))
def test_each_runtime_builds_its_workload_and_finds_its_pods(name):
    runtime = RUNTIMES[name]
    reproduction = {"runtime": name, "accelerator": {"devices": 16}}
    if name == "RayJob":  # over nodes, Ray runs a framework (verl), its metrics on a shared volume
        reproduction.update(template=VERL, sharedVolumeClaim="rl-runs")
    body = proxymodel("q3", reproduction=reproduction)
    spec = parse(body["spec"], "team-a", "q3", Settings())
    manifest = reproduction_workload("q3", "team-a", 1, spec, "s3://ckpt/proxy/", "ab" * 32, 16)
    assert (manifest["apiVersion"], manifest["kind"]) == (runtime.resource.api_version, runtime.resource.kind)
    templates = runtime.pod_templates(manifest["spec"])
    assert templates, name
    for template in templates:  # pods are found by the child label every template carries
        assert template["metadata"]["labels"][LABEL_CHILD] == manifest["metadata"]["name"]
    container = templates[0]["spec"]["containers"][0]
    assert container["name"] == (runtime.container or "reproduction")
    assert container["resources"]["limits"] == {"huawei.com/Ascend910": 8}  # one node's devices per pod


def test_workloads_are_the_runtimes_resources_and_are_found_back():
    assert set(WORKLOADS) == {r.resource for r in RUNTIMES.values()}
    for runtime in RUNTIMES.values():
        assert runtime_of(runtime.resource) is runtime


def test_the_operator_follows_only_the_runtimes_it_serves():
    """MOEPROXY_RUNTIMES (the chart's runtimes.*): kopf watches those workloads and the build's
    Jobs, nothing the chart's RBAC does not grant; an unknown name is a settings error."""
    from proxymodel_operator.handlers import register_workloads
    from proxymodel_operator.settings import SettingsError, from_env

    from .harness import registry_copy

    registry = registry_copy(None)
    register_workloads(from_env({"MOEPROXY_RUNTIMES": "Job,RayJob"}).runtimes, registry)
    watched = {(h.selector.group, h.selector.plural or h.selector.any_name)
               for h in registry._watching.get_all_handlers()}
    assert {("batch", "jobs"), ("ray.io", "rayjobs")} <= watched
    assert not watched & {("jobset.x-k8s.io", "jobsets"), ("trainer.kubeflow.org", "trainjobs"),
                          ("batch.volcano.sh", "jobs"), ("mindxdl.gitee.com", "ascendjobs")}
    with pytest.raises(SettingsError, match="MPIJob"):
        from_env({"MOEPROXY_RUNTIMES": "Job,MPIJob"})


def test_a_rayjobs_entrypoint_is_the_containers_command_for_the_shell(tmp_path):
    """The template's command and args, behind the stop wrapper (stopOnReproduce), with
    `$(VAR)` as the shell's "${VAR}": run by a shell as `ray job submit` runs it, it runs them."""
    import subprocess
    import sys

    out = tmp_path / "out"
    template = {"spec": {"containers": [{"name": "verl", "image": "x", "command": [sys.executable, "-c"],
                                         "args": ["import sys; open(sys.argv[1], 'w').write(sys.argv[2])",
                                                  str(out), "nodes=$(NNODES) it's"]}]}}
    body = proxymodel("q3", reproduction={"runtime": "RayJob", "template": template, "accelerator": {"devices": 8},
                                          "failOn": {"signature": "nan", "stopOnReproduce": True}})
    spec = parse(body["spec"], "team-a", "q3", Settings())
    manifest = reproduction_workload("q3", "team-a", 1, spec, "s3://ckpt/proxy/", "ab" * 32, 8)
    entry = manifest["spec"]["entrypoint"]
    assert entry.startswith("/bin/sh -c ")  # the stop wrapper
    done = subprocess.run(["/bin/sh", "-c", entry], env={"NNODES": "3", "PATH": "/usr/bin:/bin"}, timeout=60)
    assert done.returncode == 0 and out.read_text() == "nodes=3 it's"
