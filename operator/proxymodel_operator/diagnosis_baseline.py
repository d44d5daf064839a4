"""The baseline a Diagnosis pins when its runs start, and what changed since.

Every run of a matrix is made from the ProxyModel (its proxy, plan and reproduction), read again
at each tick a run is created. Edited or rebuilt mid-way, it would give runs of another baseline
than the runs before: so `_start` records in status.proxyModel what the runs are made from (`pin`:
the ProxyModel's uid, its spec.reproduction settings, digests of the rest of its spec, and the
proxy's URI and manifest sha256), and before creating any later run the Diagnosis compares the
ProxyModel with it (`changes`). Once they differ no new run starts (diagnosis_matrix).

spec.reproduction's plain settings (lr, precision, maxSteps, ...) are kept as they are, so the
message can say `lr: 0.1 -> 0.2`; its structured ones (template, env, accelerator, failOn, ...)
as digests: a pod template can be large, and env values have no place in another object's status.
"""

from __future__ import annotations

import hashlib
import json

from .pipeline import RUN_CONTROL_FIELDS

SHOWN = 80  # characters of a changed value shown in the message


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _setting(value):
    """A spec.reproduction value as pinned: plain ones as they are, structured ones as a digest."""
    return f"sha256:{_digest(value)}" if isinstance(value, (dict, list)) else value


def pin(proxymodel: dict) -> dict:
    """What status.proxyModel records of the ProxyModel the runs are made from. Spec fields that
    only control the ProxyModel's own run (suspend, TTL) are left out: they change no run."""
    spec, status = proxymodel.get("spec") or {}, proxymodel.get("status") or {}
    proxy = status.get("proxy") or {}
    return {"uid": proxymodel["metadata"].get("uid"), "uri": proxy.get("uri"),
            "manifestSha256": proxy.get("manifestSha256"),
            "reproduction": {k: _setting(v) for k, v in (spec.get("reproduction") or {}).items()},
            "specDigests": {k: _digest(v) for k, v in spec.items() if k not in ("reproduction", *RUN_CONTROL_FIELDS)}}


def _changed(key: str, before, after) -> str:
    if any(isinstance(v, str) and v.startswith("sha256:") for v in (before, after)):
        return f"spec.reproduction.{key} changed"
    return f"spec.reproduction.{key}: {_shown(before)} -> {_shown(after)}"


def _shown(value) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= SHOWN else text[: SHOWN - 3] + "..."


def changes(pinned: dict, proxymodel: dict) -> list[str]:
    """What differs between the pinned baseline and the ProxyModel as read now, one phrase each
    (empty: the same). Only what `pinned` records is compared (an older operator pinned less)."""
    now, out = pin(proxymodel), []
    if pinned.get("uid") and now["uid"] != pinned["uid"]:
        out.append("it was deleted and created again")
    if now["uri"] != pinned.get("uri"):
        phase = (proxymodel.get("status") or {}).get("phase") or "Pending"
        out.append(f"proxy URI {pinned.get('uri')} -> {now['uri'] or f'none (phase {phase}: being rebuilt)'}")
    elif "manifestSha256" in pinned and now["manifestSha256"] != pinned["manifestSha256"]:
        out.append(f"proxy rebuilt: manifest sha256 {str(pinned['manifestSha256'])[:12]} -> "
                   f"{str(now['manifestSha256'])[:12]}")
    if "reproduction" in pinned:
        before, after = pinned["reproduction"], now["reproduction"]
        out += [_changed(k, before.get(k), after.get(k)) for k in sorted(set(before) | set(after))
                if before.get(k) != after.get(k)]
    if "specDigests" in pinned:
        before, after = pinned["specDigests"], now["specDigests"]
        out += [f"spec.{k} changed" for k in sorted(set(before) | set(after)) if before.get(k) != after.get(k)]
    return out
