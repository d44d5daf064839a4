"""What a CheckpointWatch should do after a listing, as pure functions: which checkpoints
become ProxyModels now, which wait for a slot, which ProxyModels retention removes, and the
ProxyModel manifest itself. The kopf handler (checkpoint_watch.py) does the I/O around them.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass, field

import kopf

from moe_proxy.checkpoint.listing import MOE, PROXY, ListedCheckpoint

from . import proxy_key
from .children import MAX_NAME
from .diagnosis_status import DIAGNOSED, DIAGNOSIS_FAILED
from .resources import GROUP, PROXYMODELS
from .settings import Settings
from .status import PENDING, TRANSFORMING
from .watch_spec import WatchSpec

LABEL_WATCH = f"{GROUP}/checkpoint-watch"  # the watch that made a ProxyModel
LABEL_STEP = f"{GROUP}/step"  # the training step of its source checkpoint
ANNOTATION_CHECKPOINT = f"{GROUP}/checkpoint-uri"
# ProxyModel phases that hold a transformation slot (maxConcurrent): not started or building.
ACTIVE_PHASES = (None, "", PENDING, TRANSFORMING)
CONFIG_MISSING = "config.json missing"
MAX_LISTED = 20  # waiting/skipped entries kept in status
MAX_PROXYMODELS = 200  # entries of status.proxyModels


def short_name(base: str, suffix: str = "") -> str:
    """`base + suffix`, cut to 63 characters with a hash of `base` to keep it unique."""
    if len(base) + len(suffix) <= MAX_NAME:
        return base + suffix
    digest = hashlib.sha256(base.encode()).hexdigest()[:6]
    return f"{base[: MAX_NAME - len(suffix) - 7].rstrip('-.')}-{digest}{suffix}"


def proxymodel_name(watch: str, step: int) -> str:
    """Deterministic, so a restarted operator finds what it made: `<watch>-step-<N>`."""
    return short_name(watch, f"-step-{step}")


def watch_label(watch: str) -> str:
    """Label values stop at 63 characters too."""
    return short_name(watch)


def proxymodel_for(watch_body: dict, watch: WatchSpec, step: int, uri: str, fingerprint: str | None = None,
                   settings: Settings | None = None) -> dict:
    """The ProxyModel for checkpoint `uri` at `step` (`fingerprint`: its listing's): the template's
    spec with the watch's source, labelled with the watch, step and content key, owned by the watch."""
    watch_name = watch_body["metadata"]["name"]
    name = proxymodel_name(watch_name, step)
    spec = copy.deepcopy(watch.template_spec)
    spec["source"] = {"uri": uri, **watch.source_fields}
    prefix = (spec.get("destination") or {}).get("uri")
    if prefix:  # one prefix for all: each ProxyModel writes under <prefix>/<name>/
        spec["destination"] = {**spec["destination"], "uri": f"{prefix.rstrip('/')}/{name}/"}
    if watch.delete_proxy_data:
        spec["cleanup"] = {**(spec.get("cleanup") or {}), "deleteProxy": True}
    body = {
        "apiVersion": PROXYMODELS.api_version,
        "kind": PROXYMODELS.kind,
        "metadata": {
            "name": name,
            "labels": {**watch.template_labels, LABEL_WATCH: watch_label(watch_name), LABEL_STEP: str(step)},
            "annotations": {**watch.template_annotations, ANNOTATION_CHECKPOINT: uri},
        },
        "spec": spec,
    }
    proxy_key.label(body, fingerprint, settings or Settings())  # found again by a Diagnosis's probe of `uri`
    kopf.adopt(body, owner=watch_body)  # namespace and owner reference: deleting the watch deletes it
    return body


@dataclass(frozen=True)
class MadeProxyModel:
    """A ProxyModel this watch made, as it is now."""

    name: str
    step: int
    phase: str | None
    uri: str

    @property
    def active(self) -> bool:
        return self.phase in ACTIVE_PHASES


@dataclass
class Decision:
    create: list[ListedCheckpoint] = field(default_factory=list)  # become ProxyModels now, oldest first
    delete: list[MadeProxyModel] = field(default_factory=list)  # retired by keepLast
    pending: list[int] = field(default_factory=list)  # complete sources waiting for a slot
    waiting: list[ListedCheckpoint] = field(default_factory=list)  # incomplete: retried next poll
    skipped: list[ListedCheckpoint] = field(default_factory=list)  # no source: dense, unsupported, unreadable
    retired_through: int | None = None
    last_seen_step: int | None = None


def considered(watch: WatchSpec, step: int | None, made: set[int], retired_through: int | None) -> bool:
    """Whether a checkpoint at `step` is still to be decided (before reading anything of it)."""
    if step is None or step in made or not watch.proxy_per_checkpoint:
        return False
    if watch.start_after_step is not None and step <= watch.start_after_step:
        return False
    return retired_through is None or step > retired_through


def decide(watch: WatchSpec, children: list[MadeProxyModel], found: list[ListedCheckpoint],
           retired_through: int | None, in_use: frozenset[str] = frozenset()) -> Decision:
    """From the ProxyModels that exist and the checkpoints listed, what to do now. `in_use`: the
    ProxyModels an unfinished Diagnosis names (a probe reused it): retention deletes them later."""
    made = {c.step for c in children}
    out = Decision(retired_through=retired_through)
    fresh = [c for c in found if considered(watch, c.step, made, retired_through)]
    for c in fresh:
        if c.kind == PROXY:
            continue  # our own output (or someone's proxy): never a source, nothing to report
        if not c.complete and (c.kind == MOE or c.reason == CONFIG_MISSING):
            out.waiting.append(c)
        elif not c.source:
            out.skipped.append(c)
    sources = sorted((c for c in fresh if c.source), key=lambda c: c.step)
    seen = [c.step for c in sources] + list(made)
    out.last_seen_step = max(seen) if seen else None

    # `every`: a new checkpoint is taken only at least that many steps from every one taken.
    taken, chosen = set(made), []
    for c in sources:
        if watch.every and any(abs(c.step - t) < watch.every for t in taken):
            continue
        chosen.append(c)
        taken.add(c.step)

    # keepLast: the newest steps stay; older ProxyModels go, older new ones are never made.
    keep = taken
    if watch.keep_last:
        keep = set(sorted(taken)[-watch.keep_last:])
        dropped = taken - keep
        if dropped:
            out.retired_through = max(retired_through or 0, max(dropped))
    out.delete = sorted((c for c in children if c.step not in keep and c.name not in in_use), key=lambda c: c.step)
    chosen = [c for c in chosen if c.step in keep]

    # maxConcurrent: new ProxyModels only while fewer than that are transforming.
    if watch.max_concurrent:
        active = sum(1 for c in children if c.active and c.step in keep)
        slots = max(0, watch.max_concurrent - active)
        out.create, out.pending = chosen[:slots], [c.step for c in chosen[slots:]]
    else:
        out.create = chosen
    return out


# --- what a poll writes to status ------------------------------------------------------------------


def in_use_by(diagnoses: list[dict]) -> frozenset[str]:
    """The ProxyModels the unfinished Diagnoses name: spec.proxyModel, their probes' (a probe may
    use a watch's, proxy_key) and the candidates' (candidatesOn). A finished one needs none."""
    names = set()
    for d in diagnoses:
        st = d.get("status") or {}
        if st.get("phase") in (DIAGNOSED, DIAGNOSIS_FAILED) and st.get("observedGeneration") == (
                d.get("metadata") or {}).get("generation"):
            continue
        names.add((d.get("spec") or {}).get("proxyModel"))
        names.update(p.get("proxyModel") for p in st.get("probes") or [])
        names.add((st.get("candidatesOn") or {}).get("proxyModel"))
    return frozenset(n for n in names if isinstance(n, str) and n)


def children_status(children: list[MadeProxyModel]) -> dict:
    """status.proxies and status.proxyModels: the ProxyModels the watch made, oldest step first."""
    ordered = sorted(children, key=lambda c: c.step)
    return {"proxies": len(ordered),
            "proxyModels": [{"name": c.name, "step": c.step, "phase": c.phase or "Pending", "uri": c.uri}
                            for c in ordered][-MAX_PROXYMODELS:]}


def status_after(status: dict, decision: Decision, kept: list[MadeProxyModel], not_made: list[int]) -> dict:
    """The status a poll writes once `decision` is carried out: `kept`, the ProxyModels that exist
    now; `not_made`, the steps whose ProxyModel the API server refused (pending again). Skipped
    steps accumulate over polls (the newest MAX_LISTED)."""
    skipped = {s["step"]: s for s in status.get("skipped") or []}
    skipped.update({c.step: {"step": c.step, "kind": c.kind, "reason": (c.reason or "")[:256]}
                    for c in decision.skipped})
    pending = not_made + decision.pending
    return children_status(kept) | {
        "lastSeenStep": max(decision.last_seen_step or 0, status.get("lastSeenStep") or 0) or None,
        "pending": pending,
        "pendingSummary": ",".join(map(str, pending)),
        "waiting": [{"step": c.step, "reason": (c.reason or "")[:256]} for c in decision.waiting[:MAX_LISTED]],
        "skipped": [skipped[k] for k in sorted(skipped)][-MAX_LISTED:],
        "retiredThrough": decision.retired_through,
    }


def newly_skipped(decision: Decision, warned: set[int]) -> list[ListedCheckpoint]:
    """The skipped checkpoints not reported yet (one Event each); `warned`: the steps reported,
    by this process or in status (which keeps only the newest few)."""
    return [c for c in decision.skipped if c.step not in warned]
