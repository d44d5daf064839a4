"""`spec.pruning.sequential` and `spec.pruning.reconstruct` (issue #16's build options, issue
#16 on the operator): the schema, the spec's refusals, and the Jobs' arguments, checked with
the real `moe-proxy calibrate` / `moe-proxy build` parsers, so that the statistics the
calibrate step makes are those the build accepts (it refuses sequential statistics made for
another proxy)."""

from __future__ import annotations

import copy

import pytest

from proxymodel_operator.pipeline import VALIDATED, CreateChild, Observed, decide
from proxymodel_operator.settings import Settings
from proxymodel_operator.spec import InvalidSpec, parse
from proxymodel_operator.transformer_job import build_args, calibrate_args

from ..checkpoints.crd_schema import errors, load_crd
from .harness import proxymodel
from .test_decide import NAME, SETTINGS, accepted, only, pxm
from .test_fidelity import _object
from .test_manifests import _cli

CALIBRATED = {"calibration": {"samples": 16}}
SEQUENTIAL = {"experts": 16, "method": "saliency", "sequential": True}


def _spec(pruning: dict, calibrated: bool = True, **extra) -> dict:
    spec = copy.deepcopy(proxymodel(NAME)["spec"])
    spec["pruning"] = pruning
    return spec | (CALIBRATED if calibrated else {}) | extra


def _containers(create) -> dict[str, list[str]]:
    """The args of every container of a created Job, init containers included, by name."""
    pod = create.manifest["spec"]["template"]["spec"]
    return {c["name"]: c["args"] for c in [*pod.get("initContainers", []), *pod["containers"]]}


def test_schema_accepts_the_booleans_and_nothing_else():
    crd = load_crd("proxymodels.moeproxy.io")
    assert errors(crd, _object(_spec({**SEQUENTIAL, "reconstruct": True}))) == []
    for field in ("sequential", "reconstruct"):
        found = errors(crd, _object(_spec({"experts": 16, field: "yes"})))
        assert any(field in e for e in found), found
    pruning = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["pruning"]
    assert pruning["properties"]["sequential"]["default"] is False
    assert pruning["properties"]["reconstruct"]["default"] is False


def test_spec_parses_them_off_by_default():
    plain = parse(_spec({"experts": 16}, calibrated=False), "ns", NAME, SETTINGS).pruning
    assert (plain.sequential, plain.reconstruct) == (False, False)
    both = parse(_spec({**SEQUENTIAL, "reconstruct": True}), "ns", NAME, SETTINGS).pruning
    assert (both.sequential, both.reconstruct) == (True, True)


def test_a_single_build_calibrates_sequentially_for_its_count_then_reconstructs():
    body = accepted(pxm(_spec({**SEQUENTIAL, "reconstruct": True})))
    [create] = only(decide(body, Observed(VALIDATED), SETTINGS), CreateChild)
    args = _containers(create)
    calibrate, build = _cli("calibrate", args["calibrate"]), _cli("build", args["transformer"])
    assert calibrate.sequential and (calibrate.experts, calibrate.method) == (16, "saliency")
    assert build.reconstruct and not build.heal and build.calibration == calibrate.out
    _same_proxy(calibrate, build)


def test_a_keep_ratio_calibrates_for_the_planned_count():
    """The planner may keep more than the ratio says: the statistics are made for what is built."""
    body = accepted(pxm(_spec({"keepRatio": 0.1, "method": "frequency", "sequential": True})))
    [create] = only(decide(body, Observed(VALIDATED), SETTINGS), CreateChild)
    args = _containers(create)
    calibrate, build = _cli("calibrate", args["calibrate"]), _cli("build", args["transformer"])
    assert calibrate.experts == build.experts == 16  # test_decide.PLAN: 16 per layer
    _same_proxy(calibrate, build)


def test_several_workers_calibrate_sequentially_in_the_calibrate_job():
    spec = _spec({"experts": 16, "method": "cluster", "features": "routing", "representative": "medoid",
                  "keepSuper": False, "sequential": True, "reconstruct": True}, transformer={"parallelism": 3})
    body = accepted(pxm(spec))
    [create] = only(decide(body, Observed(VALIDATED), SETTINGS), CreateChild)
    assert create.manifest["metadata"]["name"] == "q3-calibrate-g1"
    calibrate = _cli("calibrate", _containers(create)["calibrate"])
    build = _cli("build", build_args(parse(spec, "ns", NAME, SETTINGS)))
    assert calibrate.sequential and build.reconstruct
    _same_proxy(calibrate, build)


def _same_proxy(calibrate, build) -> None:
    """What `moe-proxy calibrate --sequential` makes its statistics for (its PruningOptions, the
    rest at their defaults) is what the build's selection key asks (calibrate.statistics)."""
    for field in ("experts", "method", "features", "representative", "keep_super"):
        assert getattr(calibrate, field) == getattr(build, field), field
    assert (build.clustering, build.seed, build.top_k) == ("kmeans", 0, None)


def test_without_them_the_jobs_say_nothing_of_them():
    spec = parse(_spec({"experts": 16, "method": "saliency"}), "ns", NAME, SETTINGS)
    assert "--sequential" not in calibrate_args(spec) and "--reconstruct" not in build_args(spec)


@pytest.mark.parametrize("pruning, calibrated, extra, settings, message", [
    (SEQUENTIAL, False, {}, SETTINGS, "sequential: needs spec.calibration"),
    ({"experts": 16, "reconstruct": True}, False, {}, SETTINGS, "reconstruct: needs spec.calibration"),
    ({"experts": "auto", "maxKL": 0.05, "method": "saliency", "sequential": True}, True, {}, SETTINGS,
     "tries several"),
    ({"keepRatio": 0.1, "method": "saliency", "sequential": True}, True, {}, Settings(preflight=False),
     "planned expert count"),
    ({**SEQUENTIAL, "topK": 4}, True, {}, SETTINGS, "remove spec.pruning.topK"),
    ({"experts": 16, "method": "cluster", "seed": 7, "sequential": True}, True, {}, SETTINGS, "seed 0"),
    ({"experts": 16, "method": "cluster", "clustering": "agglomerative", "sequential": True}, True, {}, SETTINGS,
     "kmeans"),
])
def test_spec_refuses_what_the_cli_cannot_make(pruning, calibrated, extra, settings, message):
    with pytest.raises(InvalidSpec, match=message):
        parse(_spec(pruning, calibrated, **extra), "ns", NAME, settings)
