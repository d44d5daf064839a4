"""The transformer Job: one pod running `moe-proxy build SRC DST ...`.

It reports through its termination message (a short JSON, see `outcome.py`). Bad input
(exit code 2: unsupported architecture, invalid expert count, access denied...) fails the
Job at once through a pod failure policy instead of burning the retries on the same error.
"""

from __future__ import annotations

from .children import (TERMINATION_LOG, TRANSFORMER, child_name, container_basics, labels, merge_env,
                       pod_spec_basics, s3_env)
from .spec import ProxyModelSpec

BAD_INPUT_EXIT_CODE = 2  # moe-proxy exits 2 on a MoeProxyError (see moe_proxy.cli)


def build_args(spec: ProxyModelSpec) -> list[str]:
    """`moe-proxy build` arguments, mirroring spec.pruning one flag per field."""
    p = spec.pruning
    args = ["build", spec.source.uri, spec.destination]
    args += ["--experts", str(p.experts)] if p.experts is not None else ["--keep-ratio", f"{p.keep_ratio:g}"]
    args += ["--method", p.method, "--features", p.features, "--clustering", p.clustering, "--seed", str(p.seed)]
    if p.top_k is not None:
        args += ["--top-k", str(p.top_k)]
    if p.pins:
        args += ["--pin", ",".join(p.pins)]
    if spec.calibration is not None:
        args += ["--calibration", spec.calibration_uri] + ["--heal"] * p.heal + ["--no-keep-super"] * (not p.keep_super)
        args += ["--representative", p.representative] if p.representative else []
    if spec.source.endpoint:
        args += ["--endpoint-url", spec.source.endpoint]
    return args + ["--termination-log", TERMINATION_LOG]


def calibrate_args(spec: ProxyModelSpec) -> list[str]:
    """`moe-proxy calibrate` arguments (the init container; it does nothing when the statistics
    beside the proxy already match the source and the tokens)."""
    c = spec.calibration
    args = ["calibrate", spec.source.uri, "--out", spec.calibration_uri, "--samples", str(c.samples),
            "--seq-len", str(c.seq_len), "--seed", str(c.seed), "--no-progress"]
    args += ["--dataset", c.dataset] if c.dataset else []
    return args + (["--endpoint-url", spec.source.endpoint] if spec.source.endpoint else [])


def transformer_job(proxymodel: str, namespace: str, generation: int, spec: ProxyModelSpec) -> dict:
    name = child_name(proxymodel, TRANSFORMER, generation)
    meta_labels = labels(proxymodel, TRANSFORMER, name, generation, spec, kueue=True)
    workload = spec.transformer
    container = container_basics(workload, "transformer")
    container["command"] = workload.command or ["moe-proxy"]
    container["args"] = workload.args or build_args(spec)
    container["env"] = merge_env(s3_env(spec.source), workload.env)
    pod = {**pod_spec_basics(workload), "containers": [container]}
    if spec.calibration is not None and not workload.args:  # calibrate first, same image and credentials
        pod["initContainers"] = [{**container, "name": "calibrate", "args": calibrate_args(spec)}]
    job_spec: dict = {
        "backoffLimit": workload.backoff_limit,
        "podFailurePolicy": {"rules": [{
            "action": "FailJob",
            "onExitCodes": {"containerName": c["name"], "operator": "In", "values": [BAD_INPUT_EXIT_CODE]},
        } for c in pod.get("initContainers", []) + [container]]},
        "template": {
            "metadata": {"labels": labels(proxymodel, TRANSFORMER, name, generation)},
            "spec": pod,
        },
    }
    if workload.active_deadline_seconds:
        job_spec["activeDeadlineSeconds"] = workload.active_deadline_seconds
    if spec.ttl_seconds_after_finished is not None:
        job_spec["ttlSecondsAfterFinished"] = spec.ttl_seconds_after_finished
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": namespace, "labels": meta_labels},
        "spec": job_spec,
    }
