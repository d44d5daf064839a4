#!/usr/bin/env python3
"""Write the spec schemas of the three CRDs in crds/ from the models that declare their fields
(the chart ships crds/ through its files/crds link, so it needs no copy):

- ProxyModel (crds/proxymodels.moeproxy.io.yaml): spec.pruning from PruningOptions,
  spec.calibration from TokenOptions, spec.reproduction's RL settings from rl.config.ReproConfig
  (src/moe_proxy/options.py), spec.source, spec.destination.uri and spec.reproduction.failOn
  from the shared blocks (operator/proxymodel_operator/shared_fields.py), and the pod fields of
  spec.transformer and spec.reproduction from the shared WorkloadFields. The fields only the
  operator has are kept as they are, after the generated ones: HAND_WRITTEN names each, and why.
- Diagnosis (crds/diagnoses.moeproxy.io.yaml): the whole spec from diagnosis_spec.DiagnosisSpec
  (spec.checkpoints from BisectSpec and the CheckpointWatch's fields).
- CheckpointWatch (crds/checkpointwatches.moeproxy.io.yaml): the whole spec from watch_spec.WatchSpec.

The rest of each file (names, printer columns, status, the rules across spec fields) is written
by hand and kept. tests/chart fails when a file is stale.

    python charts/generate_crds.py          # rewrite the files
    python charts/generate_crds.py --check  # exit 1 when one is stale
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import yaml

from moe_proxy.options import PruningOptions, TokenOptions, crd_properties
from moe_proxy.rl.config import ReproConfig
from proxymodel_operator.crd_fields import crd_names, properties
from proxymodel_operator.diagnosis_spec import DiagnosisSpec
from proxymodel_operator.shared_fields import S3_LOCATION, WorkloadFields, fail_on_schema, source_schema
from proxymodel_operator.watch_spec import WatchSpec

CRDS = Path(__file__).resolve().parents[1] / "crds"
CRD = CRDS / "proxymodels.moeproxy.io.yaml"
DIAGNOSIS_CRD = CRDS / "diagnoses.moeproxy.io.yaml"
WATCH_CRD = CRDS / "checkpointwatches.moeproxy.io.yaml"
# ProxyModel spec section -> its options model (the section's other fields are in HAND_WRITTEN)
SECTIONS = {"pruning": PruningOptions, "calibration": TokenOptions, "reproduction": ReproConfig}
# The ProxyModel's spec fields no model declares, each with why (tests/chart checks the list).
HAND_WRITTEN = {
    "destination": "only its uri, generated as the shared S3 location",
    "pruning.sequential": "the operator's choice of calibration statistics (calibrate --experts N or one pass), "
                          "no build option",
    "transformer.parallelism": "the operator's parallelism of the build (an Indexed Job of workers)",
    "reproduction.enabled": "whether the operator runs the reproduction at all",
    "reproduction.runtime": "the operator's workload kind (Job, JobSet, VolcanoJob, ...)",
    "reproduction.template": "a user's own training pod, run as it is",
    "reproduction.sharedVolumeClaim": "the operator's run volume, shared by every pod of the workload",
    "reproduction.trainingRuntime": "the TrainJob runtime's (Kubeflow Trainer's ClusterTrainingRuntime)",
    "reproduction.accelerator": "the operator's device plan (moe-proxy repro takes devices from its launcher)",
    "suspend": "the operator's: no new child while true",
    "ttlSecondsAfterFinished": "passed to the child Jobs",
    "queueName": "Kueue's, for every child workload",
    "cleanup": "the operator's, on deletion",
}


def spec_schema(crd: dict) -> dict:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]


def proxymodel_generated() -> dict[str, dict]:
    """The ProxyModel's generated spec fields by dotted name (the hand-written ones are not here)."""
    source = source_schema("s3://bucket/prefix of the checkpoint directory (holding config.json).",
                           "Secret in this namespace with AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and optionally "
                           "AWS_SESSION_TOKEN. Pods get them through secretKeyRef; they are never copied.",
                           endpoint="S3 endpoint URL (default the operator's, else AWS).")
    out = {"source": {"type": "object", "description": "The original checkpoint (Hugging Face layout) in "
                      "S3-compatible storage."} | source,
           "destination.uri": {"type": "string", "description": "Where the proxy goes (default "
                               "<source>-proxies/<namespace>/<name>/)."} | S3_LOCATION,
           "reproduction.failOn": {"type": "object", "description": "the failure signature that counts as "
                                   "reproduced"} | fail_on_schema()}
    for section, model in SECTIONS.items():
        out |= {f"{section}.{k}": v for k, v in crd_properties(model).items()}
    for section, props in workload_properties().items():
        out |= {f"{section}.{k}": v for k, v in props.items()}
    return out


def workload_properties() -> dict[str, dict]:
    """The pod fields of spec.transformer and spec.reproduction: one declaration (WorkloadFields),
    and what differs between the two sections stated here."""
    # The scheduler and the Volcano queue are the reproduction runtime's; the build's Jobs take the cluster's.
    build = tuple(name for name in crd_names(WorkloadFields) if name not in ("schedulerName", "queue"))
    return {
        "transformer": properties(WorkloadFields, only=build, helps={
            "backoffLimit": "retries of the build's pod (with parallelism above 1, of each worker's pod)"}),
        "reproduction": properties(WorkloadFields, helps={
            "env": "e.g. the numeric mode of the failing run (INF_NAN_MODE_ENABLE, HCCL_DETERMINISTIC)"}),
    }


def render(text: str) -> str:
    """The ProxyModel CRD: each section's generated fields first, then its hand-written ones."""
    crd = yaml.safe_load(text)
    spec = spec_schema(crd)
    generated = proxymodel_generated()
    spec["source"] = generated["source"]
    spec["destination"]["properties"]["uri"] = generated["destination.uri"]
    for section in (*SECTIONS, "transformer"):
        props = spec[section]["properties"]
        mine = {k.split(".", 1)[1]: v for k, v in generated.items() if k.startswith(f"{section}.")}
        spec[section]["properties"] = mine | {k: v for k, v in props.items() if k not in mine}
    return _dump(crd)


def _whole_spec(model) -> Callable[[str], str]:
    def render_spec(text: str) -> str:
        crd = yaml.safe_load(text)
        crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"] = properties(model)
        return _dump(crd)
    return render_spec


render_diagnosis = _whole_spec(DiagnosisSpec)
render_watch = _whole_spec(WatchSpec)
RENDERERS: dict[Path, Callable[[str], str]] = {CRD: render, DIAGNOSIS_CRD: render_diagnosis, WATCH_CRD: render_watch}


def _dump(crd: dict) -> str:
    return yaml.safe_dump(crd, sort_keys=False, width=110, allow_unicode=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a CRD file is stale")
    args = parser.parse_args()
    stale = [path for path, render_file in RENDERERS.items() if path.read_text() != render_file(path.read_text())]
    if args.check:
        for path in stale:
            print(f"{path.name} is stale: run python charts/generate_crds.py", file=sys.stderr)
        return int(bool(stale))
    for path in stale:
        path.write_text(RENDERERS[path](path.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
