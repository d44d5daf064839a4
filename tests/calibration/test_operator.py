"""ProxyModel `spec.calibration`: the transformer Job calibrates (an init container), then
builds with the statistics; arguments checked against the real CLI parsers, the Job against
the Kubernetes schema, the spec against the CRD."""

from __future__ import annotations

import argparse
import importlib

import kubernetes_validate
import pytest

from proxymodel_operator.settings import Settings
from proxymodel_operator.spec import InvalidSpec, parse
from proxymodel_operator.transformer_job import build_args, calibrate_args, transformer_job
from tests.checkpoints.crd_schema import errors, load_crd

SPEC = {
    "source": {"uri": "s3://ckpt/dsv3/step-800", "endpoint": "https://s3.internal"},
    "pruning": {"experts": 16, "method": "saliency", "heal": True, "keepSuper": False},
    "calibration": {"dataset": "s3://data/rl-prompts.parquet", "samples": 128, "seqLen": 1024, "seed": 4},
}


def cli(module: str, args: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    importlib.import_module(f"moe_proxy.commands.{module}").add_parser(parser.add_subparsers())
    return parser.parse_args(args)


def test_calibrate_then_build_with_the_statistics():
    spec = parse(SPEC, "ns", "pm", Settings())
    stats = "s3://ckpt/dsv3/step-800-proxies/ns/pm-calibration/"
    assert spec.calibration_uri == stats
    c = cli("calibrate", calibrate_args(spec))
    assert (c.src, c.out, c.dataset, c.samples, c.seq_len, c.seed, c.endpoint_url) == \
        ("s3://ckpt/dsv3/step-800", stats, "s3://data/rl-prompts.parquet", 128, 1024, 4, "https://s3.internal")
    b = cli("build", build_args(spec))
    assert (b.calibration, b.method, b.heal, b.keep_super) == (stats, "saliency", True, False)

    job = transformer_job("pm", "ns", 1, spec)
    kubernetes_validate.validate(job, "1.31.0", strict=True)
    pod = job["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["name"] == "calibrate" and init["args"][0] == "calibrate" and init["image"] == pod["containers"][0]["image"]
    assert init["env"] == pod["containers"][0]["env"]  # the same S3 credentials
    # Bad input in either step fails the Job at once.
    assert {r["onExitCodes"]["containerName"] for r in job["spec"]["podFailurePolicy"]["rules"]} == \
        {"calibrate", "transformer"}


def test_without_calibration_the_job_is_unchanged():
    spec = parse({**SPEC, "pruning": {"experts": 16}, "calibration": None} | {}, "ns", "pm", Settings())
    job = transformer_job("pm", "ns", 1, spec)
    assert "initContainers" not in job["spec"]["template"]["spec"]
    assert "--calibration" not in build_args(spec)


def test_crd_accepts_calibration_and_usage_options():
    crd = load_crd("proxymodels.moeproxy.io")
    obj = {"apiVersion": "moeproxy.io/v1alpha1", "kind": "ProxyModel", "metadata": {"name": "pm", "namespace": "ns"},
           "spec": SPEC}
    assert errors(crd, obj) == []
    bad = {**obj, "spec": {**SPEC, "calibration": {"samples": 0}}}
    assert errors(crd, bad)


@pytest.mark.parametrize("spec,match", [
    ({**SPEC, "calibration": None}, "needs spec.calibration"),
    ({**SPEC, "pruning": {"experts": 16, "features": "output"}, "calibration": None}, "features output: needs"),
    ({**SPEC, "calibration": {"dataset": "/local/file.jsonl"}}, "expected s3://"),
])
def test_invalid_calibration_specs(spec, match):
    spec = {k: v for k, v in spec.items() if v is not None}
    with pytest.raises(InvalidSpec, match=match):
        parse(spec, "ns", "pm", Settings())
