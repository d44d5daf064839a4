"""values.schema.json: Helm itself rejects wrong values, with a message naming the key."""

from __future__ import annotations

import json

import pytest

from .conftest import CHART, helm, render_objects

BAD = [
    # (values, what the message must name, the constraint)
    ({"watchNamespace": ["team-a"]}, "additional properties 'watchNamespace' not allowed", ""),
    ({"watchNamespaces": ["Team_A"]}, "/watchNamespaces/0", "does not match pattern"),
    ({"watchNamespaces": ["team-a", "team-a"]}, "/watchNamespaces", "items at 0 and 1 are equal"),
    ({"watchNamespaces": "team-a"}, "/watchNamespaces", "want array"),
    ({"jobs": {"accelerator": {"devicesPerNode": 0}}}, "/jobs/accelerator/devicesPerNode", "minimum"),
    ({"jobs": {"accelerator": {"devicesPerNode": 2.5}}}, "/jobs/accelerator/devicesPerNode", "want integer"),
    ({"jobs": {"accelerator": {"memoryGB": 0}}}, "/jobs/accelerator/memoryGB", "exclusiveMinimum"),
    ({"jobs": {"accelerator": {"resource": "Ascend910"}}}, "/jobs/accelerator/resource", "does not match pattern"),
    ({"jobs": {"s3": {"endpoint": "minio:9000"}}}, "/jobs/s3/endpoint", "does not match pattern"),
    ({"jobs": {"transformerImage": "Not An Image"}}, "/jobs/transformerImage", "does not match pattern"),
    ({"jobs": {"reproductionImage": 3}}, "/jobs/reproductionImage", "want string"),
    ({"operator": {"logFormat": "xml"}}, "/operator/logFormat", "value must be one of"),
    ({"operator": {"preflight": "yes"}}, "/operator/preflight", "want boolean"),
    ({"operator": {"livenessPort": 80}}, "/operator/livenessPort", "minimum"),
    ({"operator": {"extraEnv": [{"name": "1X", "value": ""}]}}, "/operator/extraEnv/0/name", "does not match"),
    ({"operator": {"extraEnv": [{"value": "x"}]}}, "/operator/extraEnv/0", "missing property 'name'"),
    ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy", "value must be one of"),
    ({"image": {"digest": "sha256:xyz"}}, "/image/digest", "does not match pattern"),
    ({"image": {"repository": ""}}, "/image/repository", ""),
    ({"podSecurityContext": {"runAsUser": 0}}, "/podSecurityContext/runAsUser", "minimum"),
    ({"resources": {"limits": {"memory": "lots"}}}, "/resources/limits/memory", "does not match pattern"),
    ({"crds": {"install": "true"}}, "/crds/install", "want boolean"),
    ({"checkpointWatch": {"enabled": 1}}, "/checkpointWatch/enabled", "want boolean"),
    ({"rbac": {"create": True, "extra": []}}, "additional properties 'extra' not allowed", ""),
    ({"securityContext": {"privileged": True}}, "additional properties 'securityContext' not allowed", ""),
]


@pytest.mark.parametrize("values,where,constraint", BAD, ids=[str(b[0]) for b in BAD])
def test_bad_values_are_rejected_with_a_clear_message(chart, values, where, constraint):
    with pytest.raises(helm.HelmValuesError) as caught:
        render_objects(chart, values)
    message = str(caught.value)
    assert "values don't meet the specifications of the schema" in message
    assert where in message and constraint in message, message
    # And `helm lint` reports the same as an error.
    report = helm.lint(str(CHART), values)
    assert any(where in e for e in report["errors"]), report


def test_operator_settings_cannot_be_overridden_through_extra_env(chart):
    with pytest.raises(helm.HelmRenderError, match="MOEPROXY_NAMESPACES is one of the operator's settings"):
        render_objects(chart, {"operator": {"extraEnv": [{"name": "MOEPROXY_NAMESPACES", "value": ""}]}})


def test_defaults_and_good_values_pass(chart):
    chart.validate_schema({})
    chart.validate_schema({"watchNamespaces": ["a", "b-2"], "jobs": {"s3": {"endpoint": "https://s3.example.com"}},
                           "operator": {"extraEnv": [{"name": "HTTPS_PROXY", "value": "x"}]}})


def test_every_default_value_is_described_by_the_schema():
    """additionalProperties is false wherever values.yaml has a fixed set of keys, so a typo
    in any of them is caught."""
    schema = json.loads((CHART / "values.schema.json").read_text())

    def walk(node, path):
        if node.get("type") == "object" and "properties" in node:
            assert node.get("additionalProperties") is False, path
            for key, child in node["properties"].items():
                walk(child, f"{path}/{key}")

    walk(schema, "")
