"""`spec.pruning.experts: auto` with `maxKL` (issue #16 item 4): the schema, the spec, the
plan, the transformer Job's arguments (checked with the real `moe-proxy build` parser), and
the build's fidelity figure in status and in `kubectl get pxm -o wide`."""

from __future__ import annotations

import copy

import pytest
import yaml
from moe_proxy.sizing import SizingOptions, auto_counts, estimate

from proxymodel_operator.pipeline import VALIDATED, Observed, decide
from proxymodel_operator.preflight import plan_for
from proxymodel_operator.spec import InvalidSpec, parse
from proxymodel_operator.status import proxy_summary
from proxymodel_operator.transformer_job import build_args

from ..checkpoints.crd_schema import ROOT, errors, load_crd
from .harness import QWEN3, TRANSFORMER_REPORT, proxymodel
from .test_decide import NAME, SETTINGS, accepted, child, pxm, succeeded, walk
from .test_manifests import _cli

AUTO = {"experts": "auto", "maxKL": 0.05, "method": "frequency"}
CALIBRATION = {"samples": 16}


def _spec(pruning: dict, calibration: dict | None = CALIBRATION, **extra) -> dict:
    spec = copy.deepcopy(proxymodel(NAME)["spec"])
    spec["pruning"] = pruning
    if calibration is not None:
        spec["calibration"] = calibration
    return spec | extra


@pytest.fixture(scope="module")
def crd() -> dict:
    return load_crd("proxymodels.moeproxy.io")


def _object(spec: dict) -> dict:
    base = yaml.safe_load((ROOT / "examples" / "proxymodel-qwen3-job.yaml").read_text())
    return {**base, "spec": spec}


def test_schema_accepts_auto_with_max_kl_and_rejects_the_halves(crd):
    assert errors(crd, _object(_spec(AUTO))) == []
    assert errors(crd, _object(_spec({"experts": 8}))) == []
    for pruning, expected in [({"experts": "auto"}, "go together"), ({"experts": 8, "maxKL": 0.1}, "go together"),
                              ({"experts": "all", "maxKL": 0.1}, "experts"), ({**AUTO, "maxKL": 0}, "maxKL"),
                              ({"experts": 0}, "experts")]:
        found = errors(crd, _object(_spec(pruning)))
        assert any(expected in e for e in found), (pruning, found)


def test_fidelity_printer_columns_are_wide_only(crd):
    (version,) = crd["spec"]["versions"]
    columns = {c["name"]: c for c in version["additionalPrinterColumns"]}
    assert columns["KL"]["jsonPath"] == ".status.proxy.fidelity.kl" and columns["KL"]["priority"] == 1
    assert columns["LossDelta"]["jsonPath"] == ".status.proxy.fidelity.lossDelta"
    assert columns["LossDelta"]["priority"] == 1 and columns["KL"]["type"] == columns["LossDelta"]["type"] == "number"


def test_spec_parses_auto_and_max_kl():
    p = parse(_spec(AUTO), "ns", NAME, SETTINGS).pruning
    assert (p.experts, p.keep_ratio, p.max_kl, p.auto) == (None, None, 0.05, True)
    plain = parse(_spec({"experts": 8}), "ns", NAME, SETTINGS).pruning
    assert (plain.experts, plain.max_kl, plain.auto) == (8, None, False)


@pytest.mark.parametrize("spec,message", [
    (_spec(AUTO, calibration=None), "experts auto: needs spec.calibration"),
    (_spec({"experts": "auto", "method": "frequency"}), "go together"),
    (_spec({"experts": 8, "maxKL": 0.1}), "go together"),
    (_spec({**AUTO, "maxKL": -1}), "above 0"),
    (_spec(AUTO, transformer={"parallelism": 2}), "parallelism to 1"),
])
def test_spec_refuses_what_cannot_work(spec, message):
    with pytest.raises(InvalidSpec, match=message):
        parse(spec, "ns", NAME, SETTINGS)


def test_auto_counts_are_those_within_the_device_budget():
    every, within = auto_counts(QWEN3, SizingOptions()), auto_counts(QWEN3, SizingOptions(max_devices=8))
    assert every == list(range(9, 128))  # above top-k 8, below all 128
    assert within == [c for c in every if estimate(QWEN3, SizingOptions(experts=c)).proxy.devices <= 8]
    assert 0 < len(within) < len(every)


def test_the_plan_is_sized_for_the_largest_count_the_build_may_choose():
    spec = parse(_spec(AUTO, reproduction={"accelerator": {"devices": 8}}), "ns", NAME, SETTINGS)
    plan = plan_for(QWEN3, spec, SETTINGS)
    assert plan.proxy.devices <= 8 and plan.proxy.experts_per_layer > 8  # above top-k 8
    assert "experts auto: the build picks the smallest of" in plan.notes[-1]
    assert plan_for(QWEN3, parse(_spec(AUTO), "ns", NAME, SETTINGS), SETTINGS).proxy.experts_per_layer == 127


def test_the_job_asks_the_cli_for_auto_within_the_planned_count():
    body = accepted(pxm(_spec(AUTO)))  # the plan (test_decide.PLAN) is 16 experts per layer
    _, create = decide(body, Observed(VALIDATED), SETTINGS)
    args = create.manifest["spec"]["template"]["spec"]["containers"][0]["args"]
    parsed = _cli("build", args)
    assert (parsed.experts, parsed.max_kl, parsed.max_experts, parsed.keep_ratio) == ("auto", 0.05, 16, None)
    assert parsed.calibration and parsed.method == "frequency"
    # before any plan exists (preflight off), no ceiling but the CLI's own rules
    assert _cli("build", build_args(parse(_spec(AUTO), "ns", NAME, SETTINGS))).max_experts is None


def test_status_shows_the_fidelity_figure_from_the_termination_report():
    report = {**TRANSFORMER_REPORT, "fidelity": {"kl": 0.0123, "loss_delta": 0.045}}
    assert proxy_summary(report)["fidelity"] == {"kl": 0.0123, "lossDelta": 0.045}
    assert "fidelity" not in proxy_summary(TRANSFORMER_REPORT)  # an uncalibrated build has none
    body = accepted(pxm(_spec(AUTO)))
    body = walk(body, decide(body, Observed(VALIDATED), SETTINGS))
    after = walk(body, decide(body, child("q3-transform-g1", succeeded(report)), SETTINGS))
    assert after["status"]["proxy"]["fidelity"] == {"kl": 0.0123, "lossDelta": 0.045}
