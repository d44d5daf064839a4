"""The Diagnosis CRD: a valid Kubernetes object with its columns and short name, spec.failOn
the ProxyModel's own schema, and the example passes it and the operator's own checks."""

from __future__ import annotations

import kubernetes_validate
import pytest
import yaml

from proxymodel_operator.diagnosis_bisect import parse_bisection
from proxymodel_operator.diagnosis_spec import parse_diagnosis

from ..checkpoints.crd_schema import ROOT, errors, load_crd, openapi

EXAMPLE = ROOT / "examples" / "diagnosis.yaml"
BISECTION = ROOT / "examples" / "diagnosis-bisect.yaml"


@pytest.fixture(scope="module")
def crd() -> dict:
    return load_crd("diagnoses.moeproxy.io")


def test_crd_basics(crd):
    kubernetes_validate.validate(crd, "1.31.0", strict=True)
    spec = crd["spec"]
    assert (spec["group"], spec["scope"], spec["names"]["kind"], spec["names"]["plural"],
            spec["names"]["shortNames"]) == ("moeproxy.io", "Namespaced", "Diagnosis", "diagnoses", ["pxd"])
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Baseline"] == ".status.baseline.verdict" and columns["Fixed by"] == ".status.fixedBy"
    assert columns["Done/Total"] == ".status.progress" and columns["Age"] == ".metadata.creationTimestamp"
    assert columns["First bad"] == ".status.firstBad.step"
    assert openapi(crd)["properties"]["status"]["properties"]["kopf"]["x-kubernetes-preserve-unknown-fields"]


def test_fail_on_is_the_proxymodels():
    ours = openapi(load_crd("diagnoses.moeproxy.io"))["properties"]["spec"]["properties"]["failOn"]
    theirs = openapi(load_crd("proxymodels.moeproxy.io"))["properties"]["spec"]["properties"]["reproduction"][
        "properties"]["failOn"]
    assert {k: v for k, v in ours.items() if k != "description"} == \
        {k: v for k, v in theirs.items() if k != "description"}


def test_the_example_is_valid(crd):
    example = yaml.safe_load(EXAMPLE.read_text())
    assert errors(crd, example) == []
    d = parse_diagnosis(example["spec"])
    assert [c.name for c in d.candidates] == ["bf16", "loss-scaling", "lower-lr", "clip-harder"]


@pytest.mark.parametrize("change, text", [
    (lambda s: s.pop("proxyModel"), "proxyModel"),
    (lambda s: s.update(candidates=[]), "candidates"),
    (lambda s: s.update(seeds=0), "seeds"),
    (lambda s: s.update(parallelism="2"), "parallelism"),
    (lambda s: s.update(failOn={"signature": "boom"}), "signature"),
])
def test_bad_diagnoses_are_rejected_by_the_schema(crd, change, text):
    example = yaml.safe_load(EXAMPLE.read_text())
    change(example["spec"])
    found = errors(crd, example)
    assert found and any(text in e for e in found), found


def test_the_bisection_example_is_valid(crd):
    example = yaml.safe_load(BISECTION.read_text())
    assert errors(crd, example) == []
    b = parse_bisection(example["spec"])
    assert (b.watch, b.good, b.bad, b.inline["pattern"]) == (None, 100, None, "global_step_*/actor/huggingface")
    assert errors(crd, {**example, "spec": {**example["spec"], "checkpoints": {"watch": "qwen3-run"}}}) == []


def test_a_bisection_with_candidates_is_valid_and_goes_on_to_them(crd):
    """Issue 45 item 3: candidates with spec.checkpoints are tried on the first bad probe's ProxyModel."""
    example = yaml.safe_load(BISECTION.read_text())
    example["spec"]["candidates"] = ["fp32", "lower-lr"]
    assert errors(crd, example) == []
    assert [c.name for c in parse_bisection(example["spec"]).candidates] == ["fp32", "lower-lr"]


@pytest.mark.parametrize("change, text", [
    (lambda s: s.update(proxyModel="pm"), "one of them"),
    (lambda s: s["checkpoints"].update(watch="w"), "not both"),
    (lambda s: s["checkpoints"].pop("template"), "needs a ProxyModel template"),
    (lambda s: s["checkpoints"].update(bad=50), "good comes before bad"),
    (lambda s: s["checkpoints"]["template"]["spec"].update(source={"uri": "s3://b/c"}), "each checkpoint's URI"),
    (lambda s: s["checkpoints"]["source"].update(uri="/local/run"), "uri"),
])
def test_bad_bisections_are_rejected_by_the_schema(crd, change, text):
    example = yaml.safe_load(BISECTION.read_text())
    change(example["spec"])
    found = errors(crd, example)
    assert found and any(text in e for e in found), found
