"""A Diagnosis's status as a whole, the same in both modes (the matrix and a bisection): its
phases and conditions, the decision a tick makes (`DiagnosisDecision`: what to write, create
and say) and the refusal of a spec that cannot run.

Status is the single source of truth: a decision's `status` is written before anything in its
`create` is, so a restarted operator finds every workload it made (diagnosis_rows).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .resources import Resource
from .status import ACCEPTED, condition, with_condition

# Diagnosis phases.
WAITING_FOR_PROXY = "WaitingForProxy"  # the ProxyModel's proxy is not built yet (or it is missing)
DIAGNOSING = "Running"
DIAGNOSED = "Complete"
DIAGNOSIS_FAILED = "Failed"
DIAGNOSIS_PENDING = "Pending"
# Condition types besides Accepted.
RUNNING_CONDITION, COMPLETE_CONDITION, FAILED_CONDITION = "Running", "Complete", "Failed"


@dataclass
class DiagnosisDecision:
    status: dict = field(default_factory=dict)  # merged into status (written before anything is created)
    create: list[tuple[Resource, dict]] = field(default_factory=list)  # in order, after status
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    # workloads to delete (runs stopped early: diagnosis_rows.stop_early), after status is written
    delete: list[tuple[Resource, str]] = field(default_factory=list)


def set_condition(status: dict, out: dict, kind: str, ok: bool | None, reason: str, message: str,
                  generation: int) -> None:
    out["conditions"] = with_condition(out.get("conditions", status.get("conditions")),
                                       condition(kind, ok, reason, message, generation))


def condition_changed(status: dict, kind: str, ok: bool, reason: str) -> bool:
    before = next((c for c in status.get("conditions") or [] if c.get("type") == kind), None)
    return before is None or (before.get("status"), before.get("reason")) != ("True" if ok else "False", reason)


def refused(status: dict, generation: int, reason: str, message: str, temporary: bool) -> DiagnosisDecision:
    """Accepted False: bad input (Failed), or a ProxyModel that may still come (Pending/waiting)."""
    out = DiagnosisDecision()
    s = out.status
    s["observedGeneration"] = generation
    s["phase"] = WAITING_FOR_PROXY if temporary else DIAGNOSIS_FAILED
    s["message"] = message[:1024]
    set_condition(status, s, ACCEPTED, False, reason, message, generation)
    if not temporary:
        set_condition(status, s, FAILED_CONDITION, True, reason, message, generation)
        set_condition(status, s, RUNNING_CONDITION, False, reason, "nothing runs: the spec is refused", generation)
    if condition_changed(status, ACCEPTED, False, reason):
        out.events.append(("Warning", reason, message))
    return out
