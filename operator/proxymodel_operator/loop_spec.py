"""The watched run's two spec blocks of a CheckpointWatch (issue 43): `spec.metrics` (where the
training run writes its metrics) and `spec.onFailure` (which failures open an incident, and the
Diagnosis that answers it: candidates, budget, webhook). Declared once here (crd_fields), so the
CRD's schema is generated from them (charts/generate_crds.py) and `parse_metrics` /
`parse_on_failure` read each field's type, default and range from the same declaration.

What a schema cannot check (a failOn string the detectors do not read, an unknown candidate) is
checked here and InvalidWatch names the field.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_proxy.errors import InvalidOptions, InvalidReproConfig, MoeProxyError
from moe_proxy.investigate.catalogue import pick, suggested
from moe_proxy.metrics.detect import FAIL_ON_CHOICES, Signature
from moe_proxy.metrics.readers import FORMATS
from moe_proxy.options import from_crd, option

from .crd_fields import crd_field, object_schema, without_empty
from .shared_fields import NAME, S3_LOCATION

DEFAULT_PROBES = 20  # probe builds + runs an incident may start, by default
DEFAULT_SEEDS = 1  # seeds per candidate of an incident's Diagnosis (its budget is runs)


class InvalidLoop(ValueError):
    """spec.metrics or spec.onFailure cannot work: the message names the field."""


@dataclass(frozen=True)
class MetricsSpec:
    """spec.metrics: the training run's own metrics, followed on every poll."""

    uri: str | None = option(None, "str", "s3://bucket/key of the run's metrics: a JSON lines file (verl's "
                             "FileLogger), a TensorBoard event file or log directory, a trainer_state.json or a "
                             "directory of those; read with spec.source's endpoint and Secret", crd="uri",
                             crd_schema=S3_LOCATION)
    format: str | None = option(None, "str", "the metrics' format (default: detected)", crd="format",
                                choices=tuple(FORMATS))
    profile: str | None = option(None, "str", "the metric names' profile (verl, trl, megatron, ...; default: "
                                 "detected from the names)", crd="profile", crd_schema={"maxLength": 64})
    last_step: int | None = option(None, "int", "the run's last step: logged, the run is finished (verl logs no "
                                   "end of its own)", crd="lastStep", minimum=0)


@dataclass(frozen=True)
class BudgetSpec:
    """spec.onFailure.budget: what one incident may spend."""

    probes: int = option(DEFAULT_PROBES, "int", "reproduction runs at most (each bisection probe and each candidate "
                         "run counts one): the bisection's ceil(log2 n) + 3 first, then the candidates that fit, in "
                         "order", crd="probes", minimum=1, maximum=1000)
    parallelism: int = option(1, "int", "runs at once (the Diagnosis's parallelism; a bisection probes one at a "
                              "time)", crd="parallelism", minimum=1, maximum=64)
    device_hours: str | None = option(None, "str", "device-hours at most, as the probes' ProxyModels' plan prices a "
                                      "step (status.plan.deviceHoursPerStep.total.proxy): planned x steps x runs, "
                                      "spent x the steps each run completed; a number",
                                      crd="deviceHours", crd_schema={"pattern": r"^[0-9]+(\.[0-9]*)?$"})

    @property
    def hours(self) -> float | None:
        return None if self.device_hours is None else float(self.device_hours)


SECRET_REF = {"type": "object", "required": ["name", "key"], "properties": {
    "name": {"type": "string", "description": "a Secret in the watch's namespace"} | NAME,
    "key": {"type": "string", "description": "its key holding the webhook URL", "maxLength": 253}}}
WEBHOOK = {"type": "object", "required": ["secretRef"], "properties": {"secretRef": {
    "description": "where the URL is: read with get, kept in memory, never logged, written to status or an Event"}
    | SECRET_REF}}
FAIL_ON_LIST = {"type": "array", "minItems": 1, "maxItems": 16, "items": {"type": "string", "maxLength": 256}}
CANDIDATE_LIST = {"type": "array", "minItems": 1, "maxItems": 32, "items": {"type": "string", "maxLength": 64}}


@dataclass(frozen=True)
class OnFailureSpec:
    """spec.onFailure: which failures of the run open an incident, and its Diagnosis."""

    fail_on: tuple[str, ...] = crd_field("failOn", f"the failures that open an incident: {FAIL_ON_CHOICES} (as "
                                         "--fail-on takes them)", FAIL_ON_LIST)
    candidates: tuple[str, ...] | None = crd_field(
        "candidates", "catalogue names to try on the first bad checkpoint's proxy (default: the catalogue's "
        "suggestions for the failure's signature, moe_proxy.investigate.catalogue.suggested)", CANDIDATE_LIST, None)
    confirm_steps: int = option(0, "int", "steps the run must log after a failure is detected before the incident "
                                "opens; when none of them shows the failure again the run recovered by itself "
                                "(no Diagnosis). 0: open at once", crd="confirmSteps", minimum=0, maximum=10000)
    budget: BudgetSpec = crd_field("budget", "what one incident may spend", object_schema(BudgetSpec), BudgetSpec())
    webhook: dict | None = crd_field("webhook", "POST the answer as JSON (a Slack-style `text` and an "
                                     "Alertmanager-style `alerts` list) to the URL in this Secret", WEBHOOK, None)

    def candidates_for(self, signature: str) -> list[str]:
        return list(self.candidates) if self.candidates else [s.name for s in suggested(signature)]

    @property
    def webhook_secret(self) -> tuple[str, str] | None:
        ref = (self.webhook or {}).get("secretRef") or {}
        return (ref["name"], ref["key"]) if ref.get("name") and ref.get("key") else None


def metrics_schema() -> dict:
    return object_schema(MetricsSpec, required=("uri",))


def on_failure_schema() -> dict:
    return object_schema(OnFailureSpec, required=("failOn",))


def parse_metrics(raw: dict | None) -> MetricsSpec | None:
    if not raw:
        return None
    try:
        m = from_crd(MetricsSpec, without_empty(raw), "spec.metrics")
    except InvalidOptions as exc:
        raise InvalidLoop(str(exc)) from None
    if not (m.uri or "").startswith("s3://"):
        raise InvalidLoop(f"spec.metrics.uri {m.uri!r}: expected s3://bucket/key")
    return m


def parse_on_failure(raw: dict | None) -> OnFailureSpec | None:
    if not raw:
        return None
    fail_on = raw.get("failOn")
    if not isinstance(fail_on, list) or not fail_on or not all(isinstance(f, str) for f in fail_on):
        raise InvalidLoop(f"spec.onFailure.failOn: a list of failure signatures ({FAIL_ON_CHOICES})")
    for i, text in enumerate(fail_on):
        try:
            Signature.parse(text)
        except InvalidReproConfig as exc:
            raise InvalidLoop(f"spec.onFailure.failOn[{i}]: {exc}") from None
    candidates = raw.get("candidates")
    if candidates is not None:
        try:
            pick(list(candidates))
        except MoeProxyError as exc:
            raise InvalidLoop(f"spec.onFailure.candidates: {exc}") from None
    webhook = raw.get("webhook")
    if webhook is not None and not ((webhook.get("secretRef") or {}).get("name")
                                    and (webhook.get("secretRef") or {}).get("key")):
        raise InvalidLoop("spec.onFailure.webhook.secretRef: {name, key} of a Secret holding the URL")
    try:
        budget = from_crd(BudgetSpec, without_empty(raw.get("budget") or {}), "spec.onFailure.budget")
        return from_crd(OnFailureSpec, without_empty(raw), "spec.onFailure", fail_on=tuple(fail_on),
                        candidates=tuple(candidates) if candidates else None, budget=budget, webhook=webhook)
    except InvalidOptions as exc:
        raise InvalidLoop(str(exc)) from None
