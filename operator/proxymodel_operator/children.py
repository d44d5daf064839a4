"""What every child workload shares: its name, its labels, and the S3 credentials its
containers get. Pure functions, so manifests are tested without a cluster."""

from __future__ import annotations

import hashlib

from .resources import KUEUE_QUEUE_LABEL, LABEL_CHILD, LABEL_GENERATION, LABEL_PROXYMODEL, LABEL_ROLE
from .spec_types import ProxyModelSpec, Source, Workload

TRANSFORMER = "transformer"
REPRODUCTION = "reproduction"
# The scale-out transformer's steps before and after its workers (the workers Job is named
# like a single transformer Job). Their Jobs carry the transformer role.
CALIBRATE, FIT, FINALIZE = "calibrate", "fit", "finalize"
_SHORT = {TRANSFORMER: "transform", REPRODUCTION: "repro", CALIBRATE: "calibrate", FIT: "fit", FINALIZE: "finalize"}
MAX_NAME = 63  # Job names become pod label values, which stop at 63 characters
TERMINATION_LOG = "/dev/termination-log"


def child_name(proxymodel: str, kind: str, generation: int, reserve: int = 0) -> str:
    """Deterministic, so a retry or a restarted operator finds the child it made before:
    `<proxymodel>-transform-g<generation>`, shortened with a hash when too long. `reserve`
    characters stay free: an Indexed Job's pods take `<job>-<index>` as their hostname."""
    limit = MAX_NAME - reserve
    suffix = f"-{_SHORT[kind]}-g{generation}"
    if len(proxymodel) + len(suffix) <= limit:
        return proxymodel + suffix
    digest = hashlib.sha256(proxymodel.encode()).hexdigest()[:6]
    return f"{proxymodel[: limit - len(suffix) - 7].rstrip('-.')}-{digest}{suffix}"


def labels(proxymodel: str, role: str, name: str, generation: int, spec: ProxyModelSpec | None = None,
           kueue: bool = False) -> dict[str, str]:
    out = {LABEL_PROXYMODEL: proxymodel, LABEL_ROLE: role, LABEL_CHILD: name, LABEL_GENERATION: str(generation)}
    if kueue and spec is not None and spec.queue_name:
        out[KUEUE_QUEUE_LABEL] = spec.queue_name
    return out


def s3_env(source: Source) -> list[dict]:
    """The standard AWS_* variables. Credentials come from the named Secret by secretKeyRef,
    so their values never pass through the operator, the manifest, or the status."""
    env: list[dict] = []
    if source.credentials_secret:
        for key, optional in (("AWS_ACCESS_KEY_ID", False), ("AWS_SECRET_ACCESS_KEY", False),
                              ("AWS_SESSION_TOKEN", True)):
            ref = {"name": source.credentials_secret, "key": key}
            if optional:
                ref["optional"] = True
            env.append({"name": key, "valueFrom": {"secretKeyRef": ref}})
    if source.region:
        env += [{"name": "AWS_REGION", "value": source.region}, {"name": "AWS_DEFAULT_REGION", "value": source.region}]
    if source.endpoint:
        env.append({"name": "AWS_ENDPOINT_URL", "value": source.endpoint})
    return env


def merge_env(base: list[dict], extra: list[dict]) -> list[dict]:
    """`extra` wins over `base` for a name both set (the user's env overrides defaults)."""
    names = {e["name"] for e in extra}
    return [e for e in base if e["name"] not in names] + list(extra)


def container_basics(workload: Workload, name: str) -> dict:
    """The container fields every child sets the same way."""
    out = {
        "name": name,
        "image": workload.image,
        "terminationMessagePath": TERMINATION_LOG,
        # File, not FallbackToLogsOnError: the message is our JSON and never a log tail.
        "terminationMessagePolicy": "File",
    }
    if workload.image_pull_policy:
        out["imagePullPolicy"] = workload.image_pull_policy
    if workload.resources:
        out["resources"] = workload.resources
    return out


def pod_spec_basics(workload: Workload) -> dict:
    out: dict = {"restartPolicy": "Never"}
    if workload.service_account:
        out["serviceAccountName"] = workload.service_account
    if workload.node_selector:
        out["nodeSelector"] = workload.node_selector
    if workload.tolerations:
        out["tolerations"] = workload.tolerations
    return out
