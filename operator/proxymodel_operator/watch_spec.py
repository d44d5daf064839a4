"""A CheckpointWatch's spec, read into a dataclass with the defaults applied.

The CRD's schema rejects what a schema can (required fields, minimums, the s3:// pattern, a
source in the template). What it cannot check (a step regex that does not compile) is
checked here and reported with its field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from .settings import Settings
from .spec import InvalidSpec, parse as parse_proxymodel
from .spec_types import Source

DEFAULT_POLL_INTERVAL = 300  # seconds
MIN_POLL_INTERVAL = 30  # the CRD's minimum; the emulator in tests does not apply it


class InvalidWatch(ValueError):
    """The spec passed the schema but cannot work; the message names the field."""


@dataclass(frozen=True)
class WatchSpec:
    source: Source  # uri is the run's prefix; endpoint and region with the operator's defaults
    source_fields: dict  # spec.source as written, less uri: what each ProxyModel's source repeats
    template_spec: dict  # a ProxyModel spec without source
    template_labels: dict[str, str] = field(default_factory=dict)
    template_annotations: dict[str, str] = field(default_factory=dict)
    pattern: str | None = None
    step_regex: str | None = None
    every: int | None = None
    start_after_step: int | None = None
    keep_last: int | None = None
    delete_proxy_data: bool = False
    max_concurrent: int | None = None
    poll_interval: int = DEFAULT_POLL_INTERVAL
    suspend: bool = False


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
    return WatchSpec(
        source=source, source_fields={k: v for k, v in src.items() if k != "uri"}, template_spec=template_spec,
        template_labels=dict(meta.get("labels") or {}), template_annotations=dict(meta.get("annotations") or {}),
        pattern=spec.get("pattern") or None, step_regex=step_regex,
        every=spec.get("every"), start_after_step=spec.get("startAfterStep"),
        keep_last=spec.get("keepLast"), delete_proxy_data=bool(spec.get("deleteProxyData", False)),
        max_concurrent=spec.get("maxConcurrent"),
        poll_interval=int(spec.get("pollInterval") or DEFAULT_POLL_INTERVAL),
        suspend=bool(spec.get("suspend", False)),
    )
