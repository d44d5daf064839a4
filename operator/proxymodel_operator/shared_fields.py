"""The spec blocks several CRDs share, declared once: a `source` (a ProxyModel's checkpoint, a
CheckpointWatch's and a bisection's run prefix), a `failOn` (a ProxyModel's reproduction, a
Diagnosis) and a ProxyModel `template` (a CheckpointWatch's, a bisection's). Each resource
words the descriptions its own way; the shape and the checks are these.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_proxy.options import S3_URI, option

from .crd_fields import object_schema
from .spec import SIGNATURES

ENDPOINT_URL = r"^https?://[^\s]+$"
METRIC_NAME = r"^[A-Za-z0-9_/.\-]+$"
THRESHOLD_VALUE = r"^[-+]?([0-9]+\.?[0-9]*([eE][-+]?[0-9]+)?|inf)$"
S3_LOCATION = {"pattern": S3_URI, "maxLength": 1024}  # every s3:// field of every CRD
NAME = {"maxLength": 253}  # a Kubernetes object's name


@dataclass(frozen=True)
class SourceFields:
    """An S3 location and how to reach it (spec.source)."""

    uri: str | None = option(None, "str", "s3://bucket/prefix", crd="uri", crd_schema=S3_LOCATION)
    endpoint: str | None = option(None, "str", "S3 endpoint URL (default the operator's, else AWS)", crd="endpoint",
                                  crd_schema={"pattern": ENDPOINT_URL, "maxLength": 512})
    region: str | None = option(None, "str", "S3 region (default the operator's)", crd="region",
                                crd_schema={"maxLength": 64})
    credentials_secret: str | None = option(None, "str", "Secret in this namespace with AWS_ACCESS_KEY_ID and "
                                            "AWS_SECRET_ACCESS_KEY", crd="credentialsSecret", crd_schema=NAME)


def source_schema(uri: str, credentials: str, **helps: str) -> dict:
    """spec.source, with what its uri is and who reads its credentials in the resource's words."""
    return object_schema(SourceFields, required=("uri",), helps={"uri": uri, "credentialsSecret": credentials, **helps})


@dataclass(frozen=True)
class FailOnFields:
    """The failure that counts as reproduced: a detector's signature, or a threshold on a metric
    (spec.reproduction.failOn's parse_fail_on reads it)."""

    signature: str | None = option(None, "str", "a detector's failure signature (moe_proxy.metrics.detect), or "
                                   "threshold on a metric", crd="signature", choices=SIGNATURES)
    metric: str | None = option(None, "str", "with threshold: the metric (e.g. actor/grad_norm)", crd="metric",
                                crd_schema={"maxLength": 128, "pattern": METRIC_NAME})
    operator: str = option(">", "str", "with threshold: above (>) or below (<) the value", crd="operator",
                           choices=(">", "<"))
    value: str | None = option(None, "str", "the threshold, a number (a string, so that 1e4 or inf is exact)",
                               crd="value", crd_schema={"pattern": THRESHOLD_VALUE})
    steps: int = option(1, "int", "consecutive steps over the threshold", crd="steps", minimum=1)
    stop_on_reproduce: bool = option(False, "bool", "with reproduction.template, end the framework's run once the "
                                     "watch sidecar's verdict is in", crd="stopOnReproduce")


def fail_on_schema() -> dict:
    return object_schema(
        FailOnFields, required=("signature",),
        rules=(("self.signature != 'threshold' || (has(self.metric) && has(self.value))",
                "a threshold needs metric and value"),))


def template_schema(spec: str | None, source_rule: str) -> dict:
    """A ProxyModel template less its source (`spec`: the description of its spec; `source_rule`:
    the message when it has a source), validated as a ProxyModel when used."""
    labels = {"type": "object", "additionalProperties": {"type": "string"}}
    spec_schema = {"type": "object", **({"description": spec} if spec else {}),
                   "x-kubernetes-preserve-unknown-fields": True, "required": ["pruning"],
                   "x-kubernetes-validations": [{"rule": "!has(self.source)", "message": source_rule}],
                   "properties": {"pruning": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}}
    return {"type": "object", "required": ["spec"],
            "properties": {"metadata": {"type": "object", "properties": {"labels": labels, "annotations": labels}},
                           "spec": spec_schema}}
