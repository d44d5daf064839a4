"""The ProxyModel CRD: a valid Kubernetes object; the examples pass its schema (and the
operator's own checks, and make valid Jobs); bad ProxyModels are rejected by the schema."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest
import yaml

from proxymodel_operator.reproduction import reproduction_workload
from proxymodel_operator.runtimes import RUNTIMES
from proxymodel_operator.settings import Settings
from proxymodel_operator.spec import parse
from proxymodel_operator.transformer_job import transformer_job

from ..checkpoints.crd_schema import ROOT, errors, load_crd, openapi
from .test_upstream_crds import CRDS as UPSTREAM
from .test_upstream_crds import upstream_errors

EXAMPLES = sorted((ROOT / "examples").glob("proxymodel-*.yaml"))
K8S = "1.31.0"


@pytest.fixture(scope="module")
def crd() -> dict:
    return load_crd("proxymodels.moeproxy.io")


def _example(path) -> dict:
    return yaml.safe_load(path.read_text())


def test_crd_is_valid_kubernetes_with_status_columns_and_short_name(crd):
    kubernetes_validate.validate(crd, K8S, strict=True)
    spec = crd["spec"]
    assert (spec["group"], spec["scope"], spec["names"]["kind"], spec["names"]["shortNames"]) == \
        ("moeproxy.io", "Namespaced", "ProxyModel", ["pxm"])
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Phase"] == ".status.phase" and columns["Experts"] == ".status.experts"
    assert columns["Accelerators"] == ".status.accelerators"
    assert columns["Reproduced"] == ".status.reproduction.reproduced"
    status = openapi(crd)["properties"]["status"]["properties"]
    assert status["kopf"]["x-kubernetes-preserve-unknown-fields"]  # kopf's records survive pruning
    assert set(status["phase"]["enum"]) == {"Pending", "Transforming", "ProxyReady", "Reproducing", "Reproduced",
                                            "NotReproduced", "Failed", "Suspended"}


def test_there_are_examples_for_every_runtime_and_a_user_template():
    specs = [_example(p)["spec"] for p in EXAMPLES]
    assert {s.get("reproduction", {}).get("runtime") for s in specs} >= set(RUNTIMES)
    assert any("template" in s.get("reproduction", {}) for s in specs)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_pass_the_schema_the_operator_and_make_valid_jobs(crd, path):
    obj = _example(path)
    assert errors(crd, obj) == []
    meta = obj["metadata"]
    spec = parse(obj["spec"], meta["namespace"], meta["name"], Settings())
    job = transformer_job(meta["name"], meta["namespace"], 1, spec)
    kubernetes_validate.validate(job, K8S, strict=True)
    repro = reproduction_workload(meta["name"], meta["namespace"], 1, spec, "s3://b/proxy", "ab" * 32,
                                  spec.reproduction.accelerator.devices or 16)
    if repro["kind"] == "Job" and repro["apiVersion"] == "batch/v1":
        kubernetes_validate.validate(repro, K8S, strict=True)
    else:  # CRDs of other projects: at least their pod templates are valid pods (and the upstream CRD's schema)
        if repro["kind"] in UPSTREAM:
            assert upstream_errors(repro["kind"], repro) == []
        for template in RUNTIMES[spec.reproduction.runtime].pod_templates(repro["spec"]):
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}, "spec": template["spec"]}
            kubernetes_validate.validate(pod, K8S, strict=True)


def _base() -> dict:
    return copy.deepcopy(_example(ROOT / "examples" / "proxymodel-qwen3-job.yaml"))


def _with(path: str, value) -> dict:
    obj = _base()
    node = obj
    keys = path.split(".")
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    if value is None:
        node.pop(keys[-1], None)
    else:
        node[keys[-1]] = value
    return obj


BAD = {
    "both experts and keepRatio": (_with("spec.pruning.keepRatio", 0.5), "exactly one of experts or keepRatio"),
    "neither experts nor keepRatio": (_with("spec.pruning.experts", None), "exactly one of experts or keepRatio"),
    "keepRatio 0": (_with("spec.pruning", {"keepRatio": 0}), "keepRatio"),
    "keepRatio above 1": (_with("spec.pruning", {"keepRatio": 1.5}), "keepRatio"),
    "experts 0": (_with("spec.pruning.experts", 0), "experts"),
    "not an s3 uri": (_with("spec.source.uri", "/mnt/ckpt"), "source.uri"),
    "no source": (_with("spec.source", None), "source"),
    "endpoint without scheme": (_with("spec.source.endpoint", "minio:9000"), "endpoint"),
    "unknown method": (_with("spec.pruning.method", "best"), "method"),
    "pin without colon": (_with("spec.pruning.pin", ["3-17"]), "pin"),
    "unknown runtime": (_with("spec.reproduction.runtime", "MPIJob"), "runtime"),
    "devices a word": (_with("spec.reproduction.accelerator.devices", "many"), "devices"),
    "devices 0": (_with("spec.reproduction.accelerator.devices", 0), "devices"),
    "threshold without metric": (_with("spec.reproduction.failOn", {"signature": "threshold", "value": "1"}),
                                 "a threshold needs metric and value"),
    "threshold value not a number": (_with("spec.reproduction.failOn", {"signature": "threshold",
                                                                        "metric": "actor/grad_norm", "value": "big"}),
                                     "value"),
    "unknown signature": (_with("spec.reproduction.failOn", {"signature": "explosion"}), "signature"),
    "maxSteps 0": (_with("spec.reproduction.maxSteps", 0), "maxSteps"),
    "unknown field": (_with("spec.pruning.expertz", 3), "expertz"),
    "negative backoffLimit": (_with("spec.transformer", {"backoffLimit": -1}), "backoffLimit"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_proxymodels_are_rejected_by_the_schema(crd, name):
    obj, expected = BAD[name]
    found = errors(crd, obj)
    assert found, f"{name}: accepted"
    assert any(expected in e for e in found), found
