"""The spec blocks several CRDs share, declared once: a `source` (a ProxyModel's checkpoint, a
CheckpointWatch's and a bisection's run prefix), a `failOn` (a ProxyModel's reproduction, a
Diagnosis), a ProxyModel `template` (a CheckpointWatch's, a bisection's), and a workload's pod
fields (a ProxyModel's transformer and reproduction). Each resource words the descriptions its
own way; the shape and the checks are these.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_proxy.options import S3_URI, option

from .crd_fields import crd_field, object_schema
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


STRINGS = {"type": "array", "items": {"type": "string"}}
OPEN_OBJECT = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}  # as Kubernetes has it


@dataclass(frozen=True)
class WorkloadFields:
    """Where and how a child's pods run, as a Job's pod has it: the fields of a ProxyModel's
    spec.transformer (the build's Jobs) and spec.reproduction (its workload). spec.parse reads
    them into spec_types.Workload (schedulerName and queue into the Reproduction), under the same
    names, with each section's defaults (the operator's image; backoffLimit 1 for the build, 0 for
    the reproduction), which is why the CRD declares none.
    """

    scheduler_name: str | None = option(None, "str", "the pods' scheduler (default the cluster's; volcano for "
                                        "VolcanoJob and AscendJob)", crd="schedulerName", crd_schema=NAME)
    volcano_queue: str | None = option(None, "str", "Volcano queue (VolcanoJob, AscendJob)", crd="queue",
                                       crd_schema=NAME)
    image: str | None = option(None, "str", "the container image (default the operator's)", crd="image",
                               crd_schema={"maxLength": 512})
    image_pull_policy: str | None = option(None, "str", "the container's image pull policy", crd="imagePullPolicy",
                                           choices=("Always", "IfNotPresent", "Never"))
    command: list | None = crd_field("command", "the container's command (default the operator's)", STRINGS, None)
    args: list | None = crd_field("args", "the container's arguments (default the operator's moe-proxy command)",
                                  STRINGS, None)
    env: list | None = crd_field("env", "added to the container's environment (yours wins over the operator's for "
                                 "a name both set)", {"type": "array", "items": OPEN_OBJECT | {
                                     "required": ["name"], "properties": {"name": {"type": "string"}}}}, None)
    resources: dict | None = crd_field("resources", "the container's resource requests and limits", OPEN_OBJECT, None)
    node_selector: dict | None = crd_field("nodeSelector", "the pods' node selector",
                                           {"type": "object", "additionalProperties": {"type": "string"}}, None)
    tolerations: list | None = crd_field("tolerations", "the pods' tolerations",
                                         {"type": "array", "items": OPEN_OBJECT}, None)
    service_account: str | None = option(None, "str", "the pods' service account", crd="serviceAccountName",
                                         crd_schema=NAME)
    backoff_limit: int | None = option(None, "int", "retries of a failed pod", crd="backoffLimit", minimum=0,
                                       maximum=100)
    active_deadline_seconds: int | None = option(None, "int", "seconds the Job may run before it is failed",
                                                 crd="activeDeadlineSeconds", minimum=1)


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
