"""A CheckpointWatch's spec, read into a dataclass with the defaults applied. WatchSpec declares
every field of the CRD's spec once (crd_fields): the schema of crds/checkpointwatches.moeproxy.io.yaml
is generated from it, and parse_watch reads each field's type, default and range from it.

The CRD's schema rejects what a schema can (required fields, minimums, the s3:// pattern, a
source in the template). What it cannot check (a step regex that does not compile) is
checked here and reported with its field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from moe_proxy.errors import InvalidOptions
from moe_proxy.options import from_crd, option

from .crd_fields import crd_field, without_empty
from .loop_spec import InvalidLoop, MetricsSpec, OnFailureSpec, metrics_schema, on_failure_schema, parse_metrics, \
    parse_on_failure
from .settings import Settings
from .shared_fields import source_schema, template_schema
from .spec import InvalidSpec, parse as parse_proxymodel
from .spec_types import Source

DEFAULT_POLL_INTERVAL = 300  # seconds
MIN_POLL_INTERVAL = 30  # the CRD's minimum; not the parser's, so that tests can poll every second

SOURCE = source_schema(
    "s3://bucket/prefix of the training run (e.g. the verl trainer.default_local_dir).",
    "Secret in this namespace with AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and optionally AWS_SESSION_TOKEN. The "
    "operator reads it (get only) to list the prefix; it is never logged or written to status, and ProxyModels get "
    "it by name.", endpoint="S3 endpoint URL (default the operator's, else AWS).")
TEMPLATE = template_schema("A ProxyModel's spec without `source`. A destination.uri here is a prefix: each ProxyModel "
                           "writes under <prefix>/<its name>/. Validated as a ProxyModel when created.",
                           "the ProxyModels' source is this watch's spec.source with each checkpoint's URI")


class InvalidWatch(ValueError):
    """The spec passed the schema but cannot work; the message names the field."""


@dataclass(frozen=True)
class WatchSpec:
    # uri is the run's prefix; endpoint and region with the operator's defaults
    source: Source = crd_field("source", "Where the run writes its checkpoints; the same shape as a ProxyModel's "
                               "source, with `uri` a prefix. Each ProxyModel gets this source with its checkpoint's "
                               "URI.", SOURCE)
    source_fields: dict  # spec.source as written, less uri: what each ProxyModel's source repeats
    # a ProxyModel spec without source (spec.template.spec; its metadata below)
    template_spec: dict = crd_field("template", "The ProxyModels to make, less the source (which comes from this "
                                    "watch).", TEMPLATE)
    template_labels: dict[str, str] = field(default_factory=dict)
    template_annotations: dict[str, str] = field(default_factory=dict)
    pattern: str | None = option(None, "str", "Checkpoint directories relative to source.uri, as a glob (* stays "
                                 "within one path segment, ** spans any), e.g. global_step_*/actor/huggingface for "
                                 "verl. Default: every directory holding a config.json.", crd="pattern",
                                 crd_schema={"maxLength": 512})
    step_regex: str | None = option(None, "str", "The step in a checkpoint's relative path: the first group (or the "
                                    "match) of this regular expression. Default: the path's last integer. "
                                    "Directories without a step are skipped.", crd="stepRegex",
                                    crd_schema={"maxLength": 256})
    every: int | None = option(None, "int", "only checkpoints at least this many steps apart from each other get a "
                               "ProxyModel", crd="every", minimum=1)
    proxy_per_checkpoint: bool = option(True, "bool", "a ProxyModel for every new complete checkpoint (every, "
                                        "startAfterStep, keepLast and maxConcurrent bound them); false: the watch "
                                        "only follows spec.metrics, and only an incident builds proxies",
                                        crd="proxyPerCheckpoint")
    start_after_step: int | None = option(None, "int", "only checkpoints with a step greater than this",
                                          crd="startAfterStep", minimum=0)
    keep_last: int | None = option(None, "int", "at most this many ProxyModels of this watch; the oldest steps are "
                                   "deleted first", crd="keepLast", minimum=1)
    delete_proxy_data: bool = option(False, "bool", "ProxyModels deleted by retention (or with this watch) also delete "
                                     "their proxy's objects (their spec.cleanup.deleteProxy); best effort, never "
                                     "blocking deletion", crd="deleteProxyData")
    max_concurrent: int | None = option(None, "int", "ProxyModels of this watch transforming at once; further "
                                        "checkpoints wait as pending", crd="maxConcurrent", minimum=1)
    poll_interval: int = option(DEFAULT_POLL_INTERVAL, "int", "seconds between listings of the prefix",
                                crd="pollInterval", minimum=1, crd_schema={"minimum": MIN_POLL_INTERVAL})
    suspend: bool = option(False, "bool", "while true, the prefix is not listed and no ProxyModel is made",
                           crd="suspend")
    metrics: MetricsSpec | None = crd_field("metrics", "The training run's metrics, followed on every poll: a "
                                            "failure of spec.onFailure.failOn opens an incident (docs/"
                                            "checkpointwatch.md, The watched run).", metrics_schema(), None)
    on_failure: OnFailureSpec | None = crd_field("onFailure", "What an incident does: one Diagnosis that bisects the "
                                                 "run's complete checkpoints up to the failing step, then tries the "
                                                 "candidates on the first bad one's proxy, within a budget.",
                                                 on_failure_schema(), None)


def parse_watch(spec: dict[str, Any], settings: Settings | None = None) -> WatchSpec:
    settings = settings or Settings()
    src = spec.get("source") or {}
    uri = str(src.get("uri") or "")
    if not uri.startswith("s3://"):
        raise InvalidWatch(f"spec.source.uri {uri!r}: expected s3://bucket/prefix")
    source = Source(uri.rstrip("/"), src.get("endpoint") or settings.s3_endpoint,
                    src.get("region") or settings.s3_region, src.get("credentialsSecret") or "")
    step_regex = spec.get("stepRegex") or None
    if step_regex:
        try:
            re.compile(step_regex)
        except re.error as exc:
            raise InvalidWatch(f"spec.stepRegex {step_regex!r} is not a regular expression: {exc}") from None
    template = spec.get("template") or {}
    template_spec = dict(template.get("spec") or {})
    if "source" in template_spec:
        raise InvalidWatch("spec.template.spec.source: the ProxyModels' source is spec.source with each "
                           "checkpoint's URI; remove it from the template")
    try:  # the ProxyModel's own checks, on what the template makes of a stand-in checkpoint
        parse_proxymodel({**template_spec, "source": {**src, "uri": f"{uri.rstrip('/')}/checkpoint"}},
                         "namespace", "watch-step-0", settings)
    except InvalidSpec as exc:
        raise InvalidWatch(f"spec.template: {exc}") from None
    meta = template.get("metadata") or {}
    try:
        metrics, on_failure = parse_metrics(spec.get("metrics")), parse_on_failure(spec.get("onFailure"))
    except InvalidLoop as exc:
        raise InvalidWatch(str(exc)) from None
    if bool(metrics) != bool(on_failure):
        raise InvalidWatch("spec.metrics and spec.onFailure come together: the metrics to follow and what to do "
                           "on a failure")
    try:  # the scalar fields: types, ranges and defaults as WatchSpec declares them
        return from_crd(WatchSpec, without_empty(spec), "spec", source=source,
                        source_fields={k: v for k, v in src.items() if k != "uri"}, template_spec=template_spec,
                        template_labels=dict(meta.get("labels") or {}),
                        template_annotations=dict(meta.get("annotations") or {}), metrics=metrics,
                        on_failure=on_failure)
    except InvalidOptions as exc:
        raise InvalidWatch(str(exc)) from None
