"""What the CLI tells the operator, in one place: exit codes, the termination-message payloads
and the kubelet's size limit. The CLI writes these, the operator reads them; torch-free.

A container's termination message (`/dev/termination-log`) is how a Job's result reaches the
operator without reading logs. The kubelet keeps at most 4 KiB of it, so every payload here is
encoded to fit: long free text is cut, then optional detail (metrics) is dropped.
"""

from __future__ import annotations

import json
from pathlib import Path

# Exit codes of every `moe-proxy` command.
EXIT_OK = 0
EXIT_FAILED = 1  # the command ran and its answer is "no" (verify found a problem)
EXIT_BAD_INPUT = 2  # a MoeProxyError: retrying the same input cannot help (the operator's podFailurePolicy)
EXIT_NOT_REPRODUCED = 3  # diagnose: the baseline did not reproduce the failure on any seed, nothing to cure

TERMINATION_LOG_LIMIT = 4096  # bytes the kubelet keeps of a termination message
ERROR_MESSAGE_LIMIT = 3000  # an error's text, leaving room for the rest of its payload

def build_report(manifest: dict, proxy_uri: str, manifest_sha256: str | None = None) -> dict:
    """A finished build: where the proxy is and what it is. `manifest_sha256`: the sha256 of
    the proxy-manifest.json file as published (its bytes, not a re-encoding of `manifest`)."""
    experts = manifest["experts"]
    return {
        "proxy_uri": proxy_uri,
        "manifest_sha256": manifest_sha256,
        "architecture": manifest["source"]["architecture"],
        "experts_per_layer": {"before": experts["before"], "after": experts["after"], "top_k": experts["top_k_after"]},
        "params": manifest["params"],
        "bytes": manifest["bytes"],
        # the proxy measured against the original (a calibrated build): KL per token, loss difference
        **({"fidelity": {"kl": f["kl"], "loss_delta": f["loss_delta"]}} if (f := manifest.get("fidelity")) else {}),
    }


def worker_report(worker: int, workers: int, files: int) -> dict:
    """One scale-out worker's share is written; the finalize step publishes the proxy."""
    return {"worker": worker, "workers": workers, "files": files}


def error_report(exc: BaseException) -> dict:
    """A refusal: the error's class names the cause (e.g. S3AccessDenied), the message says why."""
    return {"error": type(exc).__name__, "message": str(exc)[:ERROR_MESSAGE_LIMIT]}


def repro_report(reproduced: bool, signature: str | None, step: int | None, metrics: dict,
                 steps_completed: int | None = None, stopped: str | None = None,
                 also_seen: dict[str, int] | None = None) -> dict:
    """A reproduction's verdict and its headline metrics (finite floats or None); with how many
    steps ran, why it stopped and the failures seen besides the verdict's own (name -> onset
    step), where known: a run stopped early or showing another failure is no clean cure, and the
    operator's Diagnosis judges with them."""
    return {"reproduced": reproduced, "signature": signature, "step": step, "metrics": metrics,
            **({"steps_completed": steps_completed} if steps_completed is not None else {}),
            **({"stopped": stopped[:200]} if stopped else {}),
            **({"also_seen": dict(also_seen)} if also_seen else {})}


def encode(payload: dict) -> str:
    """Compact JSON that fits the kubelet's limit: metrics are dropped first, then text is cut."""
    text = json.dumps(payload, separators=(",", ":"), allow_nan=False)
    if len(text.encode()) > TERMINATION_LOG_LIMIT and payload.get("metrics"):
        payload = {**payload, "metrics": {}}
        text = json.dumps(payload, separators=(",", ":"), allow_nan=False)
    if len(text.encode()) > TERMINATION_LOG_LIMIT and "message" in payload:
        room = len(payload["message"]) - (len(text.encode()) - TERMINATION_LOG_LIMIT) - 16
        payload = {**payload, "message": payload["message"][:max(room, 0)]}
        text = json.dumps(payload, separators=(",", ":"), allow_nan=False)
    return text


def write_termination_log(path: str | Path, payload: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(encode(payload))


def parse_termination_log(text: str | None) -> dict:
    """A termination message as a JSON object; {} when absent, too long or not ours."""
    if not text or len(text.encode()) > TERMINATION_LOG_LIMIT:
        return {}
    try:
        report = json.loads(text)
    except ValueError:
        return {}
    return report if isinstance(report, dict) else {}
