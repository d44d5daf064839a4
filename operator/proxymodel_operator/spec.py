"""A ProxyModel's spec, read into spec_types' dataclasses with the operator's defaults applied.

The CRD's schema rejects what a schema can (types, enums, minimums, required fields, one of
experts/keepRatio). What it cannot check is checked here, and each problem is reported with
the field it is about, so `kubectl describe` tells the user what to change.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from moe_proxy.errors import InvalidOptions, MoeProxyError
from moe_proxy.options import S3_URI, PruningOptions, TokenOptions, calibration_needs, from_crd, reconstructs
from moe_proxy.rl.config import ReproConfig
from moe_proxy.metrics.detect import SIGNATURES as DETECTED_SIGNATURES
from moe_proxy.storage import overlap

from .runtimes import RUNTIMES
from .settings import Settings
from .spec_types import AcceleratorRequest, FailOn, ProxyModelSpec, Pruning, Reproduction, Source, Workload

# The detector's built-in signatures (what `moe-proxy repro --fail-on` accepts by name), and
# a user threshold on any metric.
SIGNATURES = (*DETECTED_SIGNATURES, "threshold")
_S3 = re.compile(S3_URI)
# spec.transformer.parallelism: the CRD's maximum too. Workers beyond the proxy's shard count
# would only idle (each writes whole shards), and 64 keeps an Indexed Job's pod names short.
MAX_WORKERS = 64


class InvalidSpec(ValueError):
    """The spec passed the schema but cannot work; the message names the field."""


def default_destination(source_uri: str, namespace: str, name: str) -> str:
    """Next to the source checkpoint, never inside it: `<source>-proxies/<namespace>/<name>/`."""
    return f"{source_uri.rstrip('/')}-proxies/{namespace}/{name}/"


def _workload(raw: dict, image: str, backoff_limit: int) -> Workload:
    # The fields shared_fields.WorkloadFields declares, under its names (tests/chart checks each is read).
    return Workload(
        image=raw.get("image") or image,
        image_pull_policy=raw.get("imagePullPolicy"),
        resources=dict(raw.get("resources") or {}),
        node_selector=dict(raw.get("nodeSelector") or {}),
        tolerations=list(raw.get("tolerations") or []),
        service_account=raw.get("serviceAccountName"),
        backoff_limit=raw.get("backoffLimit", backoff_limit),
        active_deadline_seconds=raw.get("activeDeadlineSeconds"),
        env=list(raw.get("env") or []),
        command=raw.get("command"),
        args=raw.get("args"),
    )


def _fail_on(raw: dict | None) -> FailOn | None:
    if not raw:
        return None
    signature = raw.get("signature")
    if signature not in SIGNATURES:
        raise InvalidSpec(f"spec.reproduction.failOn.signature {signature!r}: expected one of {', '.join(SIGNATURES)}")
    stop = bool(raw.get("stopOnReproduce", False))
    if signature != "threshold":
        return FailOn(signature, stop_on_reproduce=stop)
    metric, value = raw.get("metric"), raw.get("value")
    if not metric:
        raise InvalidSpec("spec.reproduction.failOn: a threshold needs `metric` (e.g. actor/grad_norm)")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise InvalidSpec(f"spec.reproduction.failOn.value {value!r}: a threshold needs a number") from None
    return FailOn("threshold", metric, raw.get("operator", ">"), number, int(raw.get("steps", 1)), stop)


def parse_fail_on(raw: dict | None, where: str = "spec.reproduction.failOn") -> FailOn | None:
    """A failOn object as the CRD has it (a ProxyModel's spec.reproduction.failOn, a Diagnosis's
    spec.failOn); InvalidSpec names `where`."""
    try:
        return _fail_on(raw)
    except InvalidSpec as exc:
        raise InvalidSpec(str(exc).replace("spec.reproduction.failOn", where)) from None


def _repro_config(raw: dict) -> ReproConfig:
    try:
        return from_crd(ReproConfig, raw, "spec.reproduction")
    except MoeProxyError as exc:  # a field out of range, or settings that do not combine (ReproConfig)
        raise InvalidSpec(f"spec.reproduction: {exc}" if not str(exc).startswith("spec.") else str(exc)) from None


def _accelerator(raw: dict, settings: Settings) -> AcceleratorRequest:
    per_node = raw.get("devicesPerNode") or settings.devices_per_node
    devices = raw.get("devices", "auto")
    if devices == "auto":
        count = None
    else:
        try:
            count = int(devices)
        except (TypeError, ValueError):
            raise InvalidSpec(f"spec.reproduction.accelerator.devices {devices!r}: a whole number or \"auto\"") from None
        if count < 1:
            raise InvalidSpec(f"spec.reproduction.accelerator.devices {devices!r}: must be at least 1")
        if count > per_node and count % per_node:
            raise InvalidSpec(
                f"spec.reproduction.accelerator.devices {count}: more than one node's {per_node} devices "
                f"must be whole nodes (a multiple of devicesPerNode)")
    return AcceleratorRequest(raw.get("resource") or settings.accelerator, per_node, count, raw.get("memoryGB"))


def parse(spec: dict[str, Any], namespace: str, name: str, settings: Settings) -> ProxyModelSpec:
    """The spec with defaults applied; InvalidSpec names the first field that cannot work."""
    source = _source(spec.get("source") or {}, settings)
    destination = _destination(spec, source.uri, namespace, name)
    transformer = spec.get("transformer") or {}
    pruning, calibration, workers = _build(spec, transformer, settings)
    reproduction = _reproduction(spec.get("reproduction") or {}, settings)
    return ProxyModelSpec(
        source=source, destination=destination, pruning=pruning,
        transformer=_workload(transformer, settings.transformer_image, 1),
        reproduction=reproduction, suspend=bool(spec.get("suspend", False)),
        ttl_seconds_after_finished=spec.get("ttlSecondsAfterFinished"),
        queue_name=spec.get("queueName"),
        calibration=calibration,
        workers=workers,
    )


def _source(src: dict, settings: Settings) -> Source:
    uri = src.get("uri", "")
    if not _S3.match(uri):
        raise InvalidSpec(f"spec.source.uri {uri!r}: expected s3://bucket/prefix")
    endpoint = src.get("endpoint") or settings.s3_endpoint
    if endpoint and not endpoint.startswith(("http://", "https://")):
        raise InvalidSpec(f"spec.source.endpoint {endpoint!r}: must start with http:// or https://")
    return Source(uri, endpoint, src.get("region") or settings.s3_region, src.get("credentialsSecret") or "")


def _destination(spec: dict[str, Any], uri: str, namespace: str, name: str) -> str:
    destination = (spec.get("destination") or {}).get("uri") or default_destination(uri, namespace, name)
    if not _S3.match(destination):
        raise InvalidSpec(f"spec.destination.uri {destination!r}: expected s3://bucket/prefix")
    if overlap(destination, uri):  # however spelled: s3://b//x/ is s3://b/x
        raise InvalidSpec(f"spec.destination.uri {destination!r} overlaps the source {uri!r}: "
                          "a proxy must never be written into its source checkpoint")
    return destination


def _build(spec: dict[str, Any], transformer: dict, settings: Settings) -> tuple[Pruning, TokenOptions | None, int]:
    """spec.pruning, spec.calibration and the transformer's worker count, checked together as
    `moe-proxy build` would check them."""
    p = spec.get("pruning") or {}
    if ("experts" in p) == ("keepRatio" in p):
        raise InvalidSpec("spec.pruning: give exactly one of `experts` (per layer) or `keepRatio`")
    if (p.get("experts") == "auto") != (p.get("maxKL") is not None):
        raise InvalidSpec("spec.pruning.experts \"auto\" and spec.pruning.maxKL go together: the build picks the "
                          "smallest expert count whose KL(original || proxy) per token is at most maxKL")
    try:
        pruning = Pruning(from_crd(PruningOptions, p, "spec.pruning"), sequential=bool(p.get("sequential", False)))
    except InvalidOptions as exc:
        raise InvalidSpec(str(exc)) from None
    calibration = _calibration(spec.get("calibration"), pruning)
    workers = _workers(transformer)
    pruning = _deep_pruning(pruning, p, calibration is not None, settings)
    try:  # the build's own rules (merge, heal, ...), as `moe-proxy build` would check them
        replace(pruning.options, calibration="spec.calibration" if calibration else None).validate()
    except InvalidOptions as exc:
        raise InvalidSpec(f"spec.pruning: {exc}") from None
    if pruning.auto and workers > 1:
        raise InvalidSpec("spec.pruning.experts \"auto\" measures expert counts before anything is written, in one "
                          "build: set spec.transformer.parallelism to 1, or give a number of experts")
    return pruning, calibration, workers


def _reproduction(r: dict, settings: Settings) -> Reproduction:
    runtime = r.get("runtime", "Job")
    if runtime not in RUNTIMES:
        raise InvalidSpec(f"spec.reproduction.runtime {runtime!r}: expected one of {', '.join(RUNTIMES)}")
    if settings.runtimes and runtime not in settings.runtimes:
        raise InvalidSpec(f"spec.reproduction.runtime {runtime!r} is not enabled in this operator (the chart's "
                          f"runtimes.{RUNTIMES[runtime].feature}; enabled: {', '.join(settings.runtimes)})")
    template = r.get("template")
    if template is not None and not (template.get("spec") or {}).get("containers"):
        raise InvalidSpec("spec.reproduction.template: a pod template needs spec.containers")
    out = Reproduction(
        enabled=r.get("enabled", True), runtime=runtime,
        workload=_workload(r, settings.repro_image, 0),
        accelerator=_accelerator(r.get("accelerator") or {}, settings),
        config=_repro_config(r),
        fail_on=_fail_on(r.get("failOn")), template=template,
        scheduler_name=r.get("schedulerName"), volcano_queue=r.get("queue"),
        shared_volume_claim=r.get("sharedVolumeClaim"),
        training_runtime=r.get("trainingRuntime") or settings.training_runtime,
    )
    _runtime_fits(out)
    return out


def _runtime_fits(r: Reproduction) -> None:
    """What a runtime cannot run: InvalidSpec says why and what to do instead."""
    one_node = r.accelerator.devices is not None and r.accelerator.devices <= r.accelerator.devices_per_node
    if r.runtime == "TrainJob" and r.template is not None:
        raise InvalidSpec("spec.reproduction.template: a TrainJob's pods come from its ClusterTrainingRuntime, with "
                          "no room for the watch sidecar that judges a framework; run your own pod template as a "
                          "RayJob or a JobSet, or give a TrainJob spec.reproduction.command/args")
    if r.runtime == "RayJob" and r.template is not None and not one_node and not r.shared_volume_claim:
        raise InvalidSpec("spec.reproduction.sharedVolumeClaim: a RayJob over more than one node needs a "
                          "ReadWriteMany PersistentVolumeClaim every pod mounts at /run/moe-proxy: verl's "
                          "TaskRunner (its FileLogger) runs off the head, where the watcher reads the metrics")


def _deep_pruning(p: Pruning, raw: dict, calibrated: bool, settings: Settings) -> Pruning:
    """sequential and reconstruct as asked, else true with spec.calibration (the fidelity lab's
    best proxies, docs/fidelity.md; reconstruct not with heal, which the build cannot combine).
    Sequential statistics hold for one proxy only (the build refuses others): where the calibrate
    Job cannot name it, an explicit `sequential: true` is refused and the default falls back to
    one-pass statistics with a note saying why. Reconstruction stays on at any parallelism: the
    fit step before the workers fits each layer once (transformer_job.steps)."""
    notes = []
    if p.options.reconstruct is not None:
        reconstruct = p.options.reconstruct
    else:
        reconstruct = reconstructs(calibrated, p.options.heal)  # any parallelism: a fit step fits once
    unservable = _unservable_sequential(p, settings) if calibrated else None
    if p.sequential and unservable:
        raise InvalidSpec(f"spec.pruning.sequential: {unservable[0]}: {unservable[1]}, or drop sequential")
    sequential = p.sequential
    if raw.get("sequential") is None and calibrated:
        sequential = unservable is None
        if unservable:
            notes.insert(0, f"one-pass calibration statistics, not sequential (the default with "
                            f"spec.calibration): {unservable[0]}")
    return replace(p, options=replace(p.options, reconstruct=reconstruct), sequential=sequential,
                   notes=p.notes + tuple(notes))


def _unservable_sequential(p: Pruning, settings: Settings) -> tuple[str, str] | None:
    """Why the calibrate Job cannot make sequential statistics for this proxy, with the flags
    `moe-proxy calibrate --experts N` has (--top-k, --method, --features, --clustering, --representative,
    --no-keep-super), and what would let it; None where it can."""
    if p.auto:
        return ("experts \"auto\" tries several expert counts, and sequential statistics hold for one",
                "give a number of experts")
    if p.experts is None and not settings.preflight:
        return ("keepRatio needs the planned expert count, which needs the preflight read of config.json "
                "(disabled in this operator)", "give spec.pruning.experts")
    if p.method == "cluster" and p.seed != 0:  # calibrate's --seed is its tokens'; it clusters with seed 0
        return ("with method cluster, `moe-proxy calibrate --experts N` clusters with seed 0 only",
                "set seed 0, or use method saliency or frequency")
    return None


def _workers(transformer: dict) -> int:
    workers = transformer.get("parallelism", 1)
    if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= MAX_WORKERS:
        raise InvalidSpec(f"spec.transformer.parallelism {workers!r}: a whole number from 1 to {MAX_WORKERS}")
    if workers > 1 and transformer.get("args"):
        # The workers and the finalize step each need their own flags on the operator's arguments.
        raise InvalidSpec("spec.transformer.parallelism > 1 runs the operator's own `moe-proxy build` arguments "
                          "(per worker, then --finalize): remove spec.transformer.args or set parallelism to 1")
    return workers


def _calibration(raw: dict | None, pruning: Pruning) -> TokenOptions | None:
    needs = calibration_needs(pruning.options) + ["sequential"] * pruning.sequential
    if raw is None:
        if needs:
            raise InvalidSpec(f"spec.pruning {', '.join(needs)}: needs spec.calibration (usage statistics)")
        return None
    dataset = raw.get("dataset")
    if dataset is not None and not _S3.match(dataset):
        raise InvalidSpec(f"spec.calibration.dataset {dataset!r}: expected s3://bucket/key of a JSONL, parquet or text file")
    try:
        return from_crd(TokenOptions, raw, "spec.calibration")
    except InvalidOptions as exc:
        raise InvalidSpec(str(exc)) from None
