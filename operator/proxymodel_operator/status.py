"""Status: the phase, standard conditions (one per type), and the summaries `kubectl get`
prints. Pure functions over dicts; `pipeline.decide` says when to write them.

Phases: Pending -> Transforming -> ProxyReady -> Reproducing -> Reproduced | NotReproduced,
or Failed at any step, or Suspended.

The `Ready` condition summarises them for `kubectl wait --for=condition=Ready` and Argo CD
(`ready`): True once everything the spec asks for is done (the proxy is built and, when
a reproduction is asked for, it finished with a verdict), False with a reason otherwise. It is
derived from the rest of status only, never set on its own (`with_ready`).
"""

from __future__ import annotations

import datetime

PENDING, TRANSFORMING, PROXY_READY = "Pending", "Transforming", "ProxyReady"
REPRODUCING, REPRODUCED, NOT_REPRODUCED = "Reproducing", "Reproduced", "NotReproduced"
FAILED, SUSPENDED = "Failed", "Suspended"
TERMINAL = (REPRODUCED, NOT_REPRODUCED, FAILED)

# Condition types.
# Accepted: the spec is valid; a ProxyModel's source checkpoint fits it, a CheckpointWatch's
# template makes valid ProxyModels.
ACCEPTED = "Accepted"
PROXY_READY_CONDITION = "ProxyReady"  # the proxy checkpoint is built
REPRODUCED_CONDITION = "FailureReproduced"  # the reproduction saw the failure signature
SUSPENDED_CONDITION = "Suspended"
READY = "Ready"  # everything the spec asks for is done (`ready`)

# Ready's reasons. True: the phase that finished the pipeline.
READY_PROXY_BUILT = "ProxyBuilt"  # the proxy, and no reproduction asked for (spec.reproduction.enabled false)
# (and REPRODUCED, NOT_REPRODUCED: the reproduction's verdict either way)
# False: what it waits for, or why it never will.
READY_PENDING = "Pending"  # the spec is being validated (before the first Job)
READY_BUILDING = "Building"  # a transformer step runs (calibrate, fit, build, workers, finalize)
READY_REPRODUCING = "Reproducing"  # the proxy is built, the reproduction runs (or waits for its Service)
READY_SUSPENDED = "Suspended"  # spec.suspend holds the next child back
READY_REFUSED = "Refused"  # the spec is refused (the Accepted condition says why)
READY_FAILED = "Failed"  # a step failed (status.message and that step's condition say why)
READY_REASONS = (READY_PROXY_BUILT, REPRODUCED, NOT_REPRODUCED, READY_PENDING, READY_BUILDING, READY_REPRODUCING,
                 READY_SUSPENDED, READY_REFUSED, READY_FAILED)

MAX_MESSAGE = 1024  # keep status small: the full story is in the child's logs


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(kind: str, ok: bool | None, reason: str, message: str, generation: int) -> dict:
    return {
        "type": kind,
        "status": "Unknown" if ok is None else ("True" if ok else "False"),
        "reason": reason,
        "message": message[:MAX_MESSAGE],
        "observedGeneration": generation,
        "lastTransitionTime": now(),
    }


def with_condition(conditions: list[dict] | None, new: dict) -> list[dict]:
    """`conditions` with `new` in place of its type; lastTransitionTime kept while the status
    does not change, as Kubernetes conventions ask."""
    out, replaced = [], False
    for c in conditions or []:
        if c.get("type") != new["type"]:
            out.append(c)
            continue
        replaced = True
        if c.get("status") == new["status"]:
            new = {**new, "lastTransitionTime": c.get("lastTransitionTime", new["lastTransitionTime"])}
        out.append(new)
    if not replaced:
        out.append(new)
    return out


def _find(status: dict, kind: str) -> dict:
    return next((c for c in status.get("conditions") or [] if c.get("type") == kind), {})


def _said(c: dict) -> str:
    """A condition as a message: `reason: message`."""
    return ": ".join(part for part in (c.get("reason"), c.get("message")) if part)


def ready(status: dict, reproduce: bool = True) -> dict:
    """The Ready condition that `status` implies; `reproduce`: whether the spec asks for a
    reproduction (spec.reproduction.enabled, true by default).

    True: phase Reproduced or NotReproduced (the reproduction finished with a verdict, either
    way; FailureReproduced says which), or ProxyReady when no reproduction is asked for.
    False otherwise, with the reason: Refused (the spec is refused: status.refusal, the Accepted
    condition; also while it waits for a Secret or a source that may appear), Failed, Suspended,
    Pending (being validated), Building (a transformer step runs), Reproducing. Its message is
    that of the condition or status field that says more; its observedGeneration the spec
    generation status describes (status.observedGeneration)."""
    phase = status.get("phase")
    generation = status.get("observedGeneration") or (status.get("pipeline") or {}).get("generation") or 1
    accepted, refusal = _find(status, ACCEPTED), status.get("refusal") or {}
    if refusal and refusal.get("generation") in (None, generation):  # not an older spec's
        waits = " (judged again when what it depends on changes)" if refusal.get("temporary") else ""
        return condition(READY, False, READY_REFUSED, f"the spec is refused: {_said(accepted)}{waits}", generation)
    if phase == FAILED:
        return condition(READY, False, READY_FAILED, status.get("message") or "a step failed", generation)
    if phase == SUSPENDED:
        return condition(READY, False, READY_SUSPENDED, "spec.suspend is true: no new child is created", generation)
    if phase in (REPRODUCED, NOT_REPRODUCED):
        verdict = _find(status, REPRODUCED_CONDITION)
        return condition(READY, True, phase, f"the reproduction finished: {_said(verdict) or phase}", generation)
    proxy = _find(status, PROXY_READY_CONDITION)
    if phase == PROXY_READY and not reproduce:
        return condition(READY, True, READY_PROXY_BUILT, _said(proxy) or "the proxy is built", generation)
    if phase in (PROXY_READY, REPRODUCING):
        running = _find(status, REPRODUCED_CONDITION)
        return condition(READY, False, READY_REPRODUCING,
                         status.get("message") or _said(running) or "the proxy is built; the reproduction is next",
                         generation)
    if phase == TRANSFORMING:
        return condition(READY, False, READY_BUILDING,
                         status.get("message") or _said(proxy) or "building the proxy", generation)
    return condition(READY, False, READY_PENDING, _said(accepted) or "the spec is being validated", generation)


def _same(a: dict, b: dict) -> bool:
    return all(a.get(k) == b.get(k) for k in ("status", "reason", "message", "observedGeneration"))


def with_ready(status: dict, reproduce: bool = True) -> list[dict] | None:
    """`status`'s conditions with Ready as the rest of status implies (`ready`), None when it is
    so already. A changed Ready goes last, after the condition of the step that changed it, so
    the first False condition (the wide `Reason` column) stays the most specific one; its
    lastTransitionTime is kept while its status does not change."""
    conditions = status.get("conditions") or []
    new, old = ready(status, reproduce), _find(status, READY)
    if old and _same(old, new):
        return None
    if old.get("status") == new["status"]:
        new["lastTransitionTime"] = old.get("lastTransitionTime", new["lastTransitionTime"])
    return [*(c for c in conditions if c.get("type") != READY), new]


def arrow(before, after) -> str:
    """`256->32`: how the printer columns show a reduction."""
    return f"{before}->{after}"


def proxy_summary(report: dict) -> dict:
    """The transformer's termination report, in status's camelCase."""
    experts = report.get("experts_per_layer") or {}
    params = report.get("params") or {}
    size = report.get("bytes") or {}
    return {
        "uri": report.get("proxy_uri"),
        "manifestSha256": report.get("manifest_sha256"),
        "architecture": report.get("architecture"),
        "expertsPerLayer": {"before": experts.get("before"), "after": experts.get("after"),
                            "topK": experts.get("top_k")},
        "params": {"totalBefore": params.get("total_before"), "totalAfter": params.get("total_after"),
                   "activeBefore": params.get("active_before"), "activeAfter": params.get("active_after")},
        "bytes": {"before": size.get("before"), "after": size.get("after")},
        # a calibrated build's fidelity figure (`kubectl get pxm -o wide` shows it)
        **({"fidelity": {"kl": fidelity.get("kl"), "lossDelta": fidelity.get("loss_delta")}}
           if isinstance(fidelity := report.get("fidelity"), dict) else {}),
    }


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def plan_summary(plan, notes: tuple[str, ...] = (), prices: dict[str, float] | None = None) -> dict:
    """A moe_proxy.sizing.Sizing, in status's camelCase; `notes`: the spec's own (Pruning.notes)
    after the plan's; `prices`: the proxy's device-hours per RL step by precision
    (preflight.precision_prices), what a run at another precision is priced by."""

    def side(s) -> dict:
        return {"devices": s.devices, "nodes": s.nodes, "expertsPerLayer": s.experts_per_layer, "topK": s.top_k,
                "paramsTotal": s.params.total, "paramsActive": s.params.active,
                "memoryGiB": round(s.memory.static / (1 << 30), 1)}

    return {
        "architecture": plan.architecture, "accelerator": plan.accelerator,
        "deviceMemoryGB": plan.device_memory_gb, "devicesPerNode": plan.devices_per_node,
        "precision": plan.precision, "original": side(plan.original), "proxy": side(plan.proxy),
        "deviceReduction": f"{plan.device_reduction:.1%}",
        "deviceHoursRatio": f"{plan.device_hours_ratio:.3f}",
        # by phase of an RL step (moe_proxy.step_cost): rolloutDecode, optimizer, allToAll, ..., total
        "deviceHoursPerStep": {_camel(name): {"original": f"{row['original']:.4g}", "proxy": f"{row['proxy']:.4g}",
                                              "ratio": "-" if row["ratio"] is None else f"{row['ratio']:.3f}"}
                               for name, row in plan.phase_table().items()},
        # precision -> the proxy's total per step there: a Diagnosis's candidate may change the precision
        **({"proxyDeviceHoursPerStep": {p: f"{x:.4g}" for p, x in prices.items()}} if prices else {}),
        # e.g. kept experts raised to 2 x top-k; one-pass statistics where sequential cannot serve
        **({"notes": [*plan.notes, *notes]} if plan.notes or notes else {}),
    }


def reproduction_summary(report: dict) -> dict:
    """The reproduction's termination report; metric values as strings (NaN and inf included)."""
    metrics = report.get("metrics") or {}
    return {
        "reproduced": bool(report.get("reproduced")),
        "signature": report.get("signature"),
        "step": report.get("step"),
        "metrics": {str(k): str(v) for k, v in list(metrics.items())[:32]} if isinstance(metrics, dict) else {},
        # a user's framework that crashed after the watcher's verdict (outcome.with_crash)
        **({"crash": report["crash"]} if isinstance(report.get("crash"), dict) else {}),
    }
