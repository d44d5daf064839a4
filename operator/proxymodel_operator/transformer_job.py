"""The transformer's Jobs: `moe-proxy build SRC DST ...` with the spec's pruning options.

One worker (spec.transformer.parallelism 1, the default): one Job of one pod, with
`moe-proxy calibrate` as its init container when spec.calibration asks for statistics.

W workers: up to three Jobs, each created once the one before it succeeded (see handlers.py):
1. calibrate (with spec.calibration only): `moe-proxy calibrate`, once, before any worker, so
   the W workers all read the same statistics instead of racing to write them;
2. fit (when the build fits tensors: reconstruct, the default with spec.calibration, heal or
   merge): `moe-proxy build --fit`, once, so that the workers and finalize read the fitted
   tensors instead of each fitting every layer again;
3. workers: an Indexed Job of W pods, `--worker $(JOB_COMPLETION_INDEX) --workers W`, each
   writing its deterministic share of the shards. A failed pod is retried for its own index
   only (backoffLimitPerIndex), and its journal skips the shards it had finished. An index out
   of retries fails the Job at once (maxFailedIndexes 0): the proxy cannot be finished without it;
4. finalize: `--workers W --finalize`, once: checks every worker's shards, writes config,
   index and manifest, and reports like a single build.

Each Job reports through its termination message (a short JSON, see `moe_proxy.reports`).
Bad input (exit code 2: unsupported architecture, invalid expert count, access denied...) fails
the Job at once through a pod failure policy instead of burning the retries on the same error.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from moe_proxy.options import statistics_flags, to_args
from moe_proxy.reports import EXIT_BAD_INPUT

from .children import (CALIBRATE, FINALIZE, FIT, TERMINATION_LOG, TRANSFORMER, child_name, container_basics, labels,
                       merge_env, pod_spec_basics, s3_env)
from .spec_types import ProxyModelSpec

BUILD, WORKERS = "build", "workers"  # the single build; the Indexed Job of the scale-out build
# Kubernetes sets JOB_COMPLETION_INDEX in an Indexed Job's pods, but `$(VAR)` in args expands
# only variables the container declares: declared from the pod's annotation, as its docs do.
INDEX_ENV = {"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {
    "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}}


class StepText(NamedTuple):
    created: str  # the Event reason when its Job is created
    running: str  # the ProxyReady condition's reason while it runs
    what: str  # how failures name the step


STEP_TEXT = {
    BUILD: StepText("TransformerCreated", "TransformerRunning", "transformer"),
    CALIBRATE: StepText("CalibrationCreated", "Calibrating", "calibration"),
    FIT: StepText("FitCreated", "Fitting", "fit"),
    WORKERS: StepText("WorkersCreated", "WorkersRunning", "transformer workers"),
    FINALIZE: StepText("FinalizeCreated", "Finalizing", "finalize"),
}


def steps(spec: ProxyModelSpec) -> tuple[str, ...]:
    """The transformer's Jobs, in the order they run."""
    if spec.workers == 1:
        return (BUILD,)
    fit = (FIT,) if spec.pruning.options.fits else ()  # fitted tensors: made once, before the workers
    return ((CALIBRATE,) if spec.calibration is not None else ()) + fit + (WORKERS, FINALIZE)


def next_step(spec: ProxyModelSpec, step: str) -> str | None:
    """The step after `step`; None after the last one (its Job reports the proxy)."""
    order = steps(spec)
    position = order.index(step) + 1
    return order[position] if position < len(order) else None


def step_message(step: str, job_name: str, spec: ProxyModelSpec) -> str:
    """What the step's Job does, for its condition and Event."""
    if step == BUILD:
        return f"Job {job_name} builds the proxy at {spec.destination}"
    if step == CALIBRATE:
        return f"Job {job_name} computes usage statistics at {spec.calibration_uri} for the {spec.workers} workers"
    if step == FIT:
        return f"Job {job_name} selects the experts and fits them once, for the {spec.workers} workers"
    if step == WORKERS:
        return f"Indexed Job {job_name}: {spec.workers} workers build the proxy at {spec.destination}"
    return f"all {spec.workers} workers done; Job {job_name} checks their shards and writes the index and manifest"


def build_args(spec: ProxyModelSpec, scale_out: list[str] | None = None) -> list[str]:
    """`moe-proxy build` arguments: spec.pruning's options as the CLI spells them (the same
    model, moe_proxy.options); `scale_out`: the worker or finalize flags of a step of a build
    with several workers."""
    p = spec.pruning
    options = replace(p.options, calibration=spec.calibration_uri if spec.calibration is not None else None)
    args = ["build", spec.source.uri, spec.destination]
    args += to_args(options, only=("experts", "keep_ratio"))
    if p.auto:  # at most the count the devices were planned for
        args += ["--max-experts", str(p.max_experts)] if p.max_experts is not None else []
    # said either way: `build --calibration` reconstructs unless told not to
    calibrated = spec.calibration is not None
    args += to_args(options, skip=("experts", "keep_ratio") + ("reconstruct",) * (not calibrated),
                    always=("method", "features", "clustering", "seed") + ("reconstruct",) * calibrated)
    if spec.source.endpoint:
        args += ["--endpoint-url", spec.source.endpoint]
    return args + list(scale_out or []) + ["--termination-log", TERMINATION_LOG]


def calibrate_args(spec: ProxyModelSpec) -> list[str]:
    """`moe-proxy calibrate` arguments (it does nothing when the statistics beside the proxy
    already match the source and the tokens)."""
    args = ["calibrate", spec.source.uri, "--out", spec.calibration_uri, "--no-progress"]
    args += to_args(spec.calibration, always=("samples", "seq_len", "seed"))
    p = spec.pruning
    if p.sequential and p.experts is None:  # statistics for the proxy the build makes: the planned count
        raise ValueError("spec.pruning.sequential: no expert count planned yet to calibrate for")
    # else e.g. experts "auto": one pass, for any count (Pruning.notes says why, in status.plan.notes)
    args += statistics_flags(p.options, sequential=p.sequential)
    return args + (["--endpoint-url", spec.source.endpoint] if spec.source.endpoint else [])


def step_job(step: str, proxymodel: str, namespace: str, generation: int, spec: ProxyModelSpec) -> dict:
    """The Job of one of `steps(spec)`."""
    if step == CALIBRATE:
        return calibrate_job(proxymodel, namespace, generation, spec)
    if step == FIT:
        return fit_job(proxymodel, namespace, generation, spec)
    if step == FINALIZE:
        return finalize_job(proxymodel, namespace, generation, spec)
    return transformer_job(proxymodel, namespace, generation, spec)


def transformer_job(proxymodel: str, namespace: str, generation: int, spec: ProxyModelSpec) -> dict:
    """The Job that writes the shards: the single build, or the Indexed Job of the workers."""
    workload = spec.transformer
    if spec.workers == 1:
        container = _container(spec, "transformer", workload.args or build_args(spec))
        init = []
        if spec.calibration is not None and not workload.args:  # calibrate first, same image and credentials
            init = [{**container, "name": "calibrate", "args": calibrate_args(spec)}]
        return _job(proxymodel, TRANSFORMER, namespace, generation, spec, container, init)

    workers = spec.workers
    container = _container(spec, "transformer", build_args(
        spec, ["--worker", f"$({INDEX_ENV['name']})", "--workers", str(workers)]))
    container["env"] = merge_env(container["env"], [INDEX_ENV])  # ours wins: the shares depend on it
    job = _job(proxymodel, TRANSFORMER, namespace, generation, spec, container, reserve=len(f"-{workers - 1}"))
    del job["spec"]["backoffLimit"]  # per index instead: a retry redoes one worker's share only
    job["spec"].update(completionMode="Indexed", completions=workers, parallelism=workers,
                       backoffLimitPerIndex=workload.backoff_limit, maxFailedIndexes=0)
    return job


def calibrate_job(proxymodel: str, namespace: str, generation: int, spec: ProxyModelSpec) -> dict:
    """Before the workers of a calibrated build: the statistics, computed once."""
    return _job(proxymodel, CALIBRATE, namespace, generation, spec,
                _container(spec, "calibrate", calibrate_args(spec)))


def fit_job(proxymodel: str, namespace: str, generation: int, spec: ProxyModelSpec) -> dict:
    """Before the workers of a build that fits tensors (reconstruct, heal, merge): select and fit
    once; the workers and finalize read the fits (`moe-proxy build --fit`)."""
    return _job(proxymodel, FIT, namespace, generation, spec,
                _container(spec, "fit", build_args(spec, ["--workers", str(spec.workers), "--fit"])))


def finalize_job(proxymodel: str, namespace: str, generation: int, spec: ProxyModelSpec) -> dict:
    """After all workers succeeded: check their shards, write config, index and manifest."""
    return _job(proxymodel, FINALIZE, namespace, generation, spec,
                _container(spec, "finalize", build_args(spec, ["--workers", str(spec.workers), "--finalize"])))


def _container(spec: ProxyModelSpec, name: str, args: list[str]) -> dict:
    workload = spec.transformer
    container = container_basics(workload, name)
    container["command"] = workload.command or ["moe-proxy"]
    container["args"] = args
    container["env"] = merge_env(s3_env(spec.source), workload.env)
    return container


def _job(proxymodel: str, kind: str, namespace: str, generation: int, spec: ProxyModelSpec, container: dict,
         init_containers: list[dict] | None = None, reserve: int = 0) -> dict:
    """A batch/v1 Job of one pod template with the transformer's workload settings."""
    name = child_name(proxymodel, kind, generation, reserve)
    workload = spec.transformer
    pod = {**pod_spec_basics(workload), "containers": [container]}
    if init_containers:
        pod["initContainers"] = init_containers
    job_spec: dict = {
        "backoffLimit": workload.backoff_limit,
        "podFailurePolicy": {"rules": [{
            "action": "FailJob",
            "onExitCodes": {"containerName": c["name"], "operator": "In", "values": [EXIT_BAD_INPUT]},
        } for c in pod.get("initContainers", []) + [container]]},
        "template": {
            "metadata": {"labels": labels(proxymodel, TRANSFORMER, name, generation)},
            "spec": pod,
        },
    }
    job_spec.update(workload.deadline(), **spec.admission())
    if spec.ttl_seconds_after_finished is not None:
        job_spec["ttlSecondsAfterFinished"] = spec.ttl_seconds_after_finished
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": labels(proxymodel, TRANSFORMER, name, generation, spec, kueue=True)},
        "spec": job_spec,
    }
