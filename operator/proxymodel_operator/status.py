"""Status: the phase, standard conditions (one per type), and the summaries `kubectl get`
prints. Pure functions over dicts; `pipeline.decide` says when to write them.

Phases: Pending -> Transforming -> ProxyReady -> Reproducing -> Reproduced | NotReproduced,
or Failed at any step, or Suspended.
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


def plan_summary(plan, notes: tuple[str, ...] = ()) -> dict:
    """A moe_proxy.sizing.Sizing, in status's camelCase; `notes`: the spec's own (Pruning.notes)
    after the plan's."""

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
    }
