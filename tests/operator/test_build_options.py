"""`spec.pruning.sequential` and `spec.pruning.reconstruct` (issue #16's build options, issue
#16 on the operator): the schema, the spec's refusals, and the Jobs' arguments, checked with
the real `moe-proxy calibrate` / `moe-proxy build` parsers, so that the statistics the
calibrate step makes are those the build accepts (it refuses sequential statistics made for
another proxy)."""

from __future__ import annotations

import copy

import pytest

from proxymodel_operator.pipeline import VALIDATED, CreateChild, Observed, decide
from proxymodel_operator.resources import JOBS, PROXYMODELS
from proxymodel_operator.settings import Settings
from proxymodel_operator.spec import InvalidSpec, parse
from proxymodel_operator.transformer_job import build_args, calibrate_args

from ..checkpoints.crd_schema import errors, load_crd
from .harness import eventually, proxymodel
from .test_decide import NAME, SETTINGS, accepted, only, pxm
from .test_fidelity import _object
from .test_manifests import _cli
from .test_pipeline import NS, _apply

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
    # no schema default: the API server would store it, and an absent field means "true with calibration"
    assert "default" not in pruning["properties"]["sequential"]
    assert "default" not in pruning["properties"]["reconstruct"]


def test_spec_parses_them_on_with_calibration_off_without_and_as_asked():
    plain = parse(_spec({"experts": 16}, calibrated=False), "ns", NAME, SETTINGS).pruning
    assert (plain.sequential, plain.reconstruct) == (False, False)
    default = parse(_spec({"experts": 16}), "ns", NAME, SETTINGS).pruning
    assert (default.sequential, default.reconstruct, default.notes) == (True, True, ())
    both = parse(_spec({**SEQUENTIAL, "reconstruct": True}), "ns", NAME, SETTINGS).pruning
    assert (both.sequential, both.reconstruct) == (True, True)
    off = parse(_spec({"experts": 16, "sequential": False, "reconstruct": False}), "ns", NAME, SETTINGS).pruning
    assert (off.sequential, off.reconstruct, off.notes) == (False, False, ())
    healed = parse(_spec({"experts": 16, "heal": True}), "ns", NAME, SETTINGS).pruning
    assert (healed.sequential, healed.reconstruct) == (True, False)  # the build takes one of heal, reconstruct


def test_by_default_a_calibrated_build_calibrates_for_its_count_and_reconstructs():
    """No sequential/reconstruct in the spec: the Jobs say both flags, for the build's defaults."""
    body = accepted(pxm(_spec({"experts": 16})))
    [create] = only(decide(body, Observed(VALIDATED), SETTINGS), CreateChild)
    args = _containers(create)
    assert "--sequential" in args["calibrate"] and "--reconstruct" in args["transformer"]
    calibrate, build = _cli("calibrate", args["calibrate"]), _cli("build", args["transformer"])
    assert calibrate.experts == 16 and not calibrate.one_pass and build.reconstruct is True
    _same_proxy(calibrate, build)


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


def test_a_smaller_top_k_calibrates_behind_the_proxy_of_that_top_k():
    """pruning.topK changes the proxy the sequential statistics are scored behind (each later layer
    sees the earlier ones routing to topK experts): the calibrate Job asks for it too, else the
    build refuses the statistics. It fell back to one-pass statistics with a note when calibrate
    had no --top-k; now topK gets the default's sequential statistics and reconstruction."""
    spec = parse(_spec({"experts": 16, "topK": 4}), "ns", NAME, SETTINGS)
    assert (spec.pruning.sequential, spec.pruning.reconstruct, spec.pruning.notes) == (True, True, ())
    body = accepted(pxm(_spec({"experts": 16, "topK": 4})))
    [create] = only(decide(body, Observed(VALIDATED), SETTINGS), CreateChild)
    args = _containers(create)
    calibrate, build = _cli("calibrate", args["calibrate"]), _cli("build", args["transformer"])
    assert calibrate.top_k == build.top_k == 4
    _same_proxy(calibrate, build)


def _same_proxy(calibrate, build) -> None:
    """What `moe-proxy calibrate --sequential` makes its statistics for (its PruningOptions, the
    rest at their defaults) is what the build's selection key asks (calibrate.statistics)."""
    for field in ("experts", "top_k", "method", "features", "representative", "keep_super"):
        assert getattr(calibrate, field) == getattr(build, field), field
    assert (build.clustering, build.seed) == ("kmeans", 0)


def test_turned_off_the_jobs_say_one_pass_and_no_reconstruct():
    spec = parse(_spec({"experts": 16, "method": "saliency", "sequential": False, "reconstruct": False}),
                 "ns", NAME, SETTINGS)
    calibrate, build = calibrate_args(spec), build_args(spec)
    assert "--one-pass" in calibrate and "--experts" not in calibrate and "--sequential" not in calibrate
    assert "--no-reconstruct" in build and "--reconstruct" not in build
    assert _cli("build", build).reconstruct is False and _cli("calibrate", calibrate).one_pass


@pytest.mark.parametrize("pruning, settings, why", [
    ({"experts": "auto", "maxKL": 0.05}, SETTINGS, "tries several"),
    ({"keepRatio": 0.1}, Settings(preflight=False), "planned expert count"),
    ({"experts": 16, "seed": 7}, SETTINGS, "seed 0"),
])
def test_what_sequential_cannot_serve_falls_back_to_one_pass_with_a_note(pruning, settings, why):
    spec = parse(_spec(pruning), "ns", NAME, settings)
    assert (spec.pruning.sequential, spec.pruning.reconstruct) == (False, True)
    (note,) = spec.pruning.notes
    assert note.startswith("one-pass calibration statistics, not sequential") and why in note, note
    assert "--one-pass" in calibrate_args(spec) and "--reconstruct" in build_args(spec)


@pytest.mark.parametrize("pruning, calibrated, extra, settings, message", [
    (SEQUENTIAL, False, {}, SETTINGS, "sequential: needs spec.calibration"),
    ({"experts": 16, "reconstruct": True}, False, {}, SETTINGS, "reconstruct: needs spec.calibration"),
    ({"experts": "auto", "maxKL": 0.05, "method": "saliency", "sequential": True}, True, {}, SETTINGS,
     "tries several"),
    ({"keepRatio": 0.1, "method": "saliency", "sequential": True}, True, {}, Settings(preflight=False),
     "planned expert count"),
    ({"experts": 16, "method": "cluster", "seed": 7, "sequential": True}, True, {}, SETTINGS, "seed 0"),
])
def test_spec_refuses_what_the_cli_cannot_make(pruning, calibrated, extra, settings, message):
    with pytest.raises(InvalidSpec, match=message):
        parse(_spec(pruning, calibrated, **extra), "ns", NAME, settings)


def test_sequential_statistics_cluster_as_the_build_does():
    """calibrate takes --clustering: a sequential build with agglomerative clustering gets
    statistics made with it (it was refused when calibrate clustered with kmeans only)."""
    spec = parse(_spec({"experts": 16, "method": "cluster", "clustering": "agglomerative", "sequential": True},
                       True), "ns", NAME, SETTINGS)
    calibrate, build = _cli("calibrate", calibrate_args(spec)), _cli("build", build_args(spec))
    assert calibrate.clustering == build.clustering == "agglomerative" and calibrate.experts == 16


def test_several_workers_reconstruct_with_a_fit_step_before_them():
    """Reconstruction (the default with spec.calibration) stays on at any parallelism: a fit Job
    before the workers fits each layer once, and the workers and finalize read its fits (issue
    #25; before, the default was off with several workers, each of which would have refitted)."""
    from proxymodel_operator.transformer_job import fit_job, steps

    spec = parse(_spec({"experts": 16}, transformer={"parallelism": 3}), "ns", NAME, SETTINGS)
    assert (spec.pruning.sequential, spec.pruning.reconstruct, spec.pruning.notes) == (True, True, ())
    assert steps(spec) == ("calibrate", "fit", "workers", "finalize")
    fit = _cli("build", fit_job("pm", "ns", 1, spec)["spec"]["template"]["spec"]["containers"][0]["args"])
    assert (fit.fit, fit.workers, fit.reconstruct, fit.worker) == (True, 3, True, None)
    assert "--reconstruct" in build_args(spec, ["--worker", "0", "--workers", "3"])
    plain = parse(_spec({"experts": 16, "reconstruct": False}, transformer={"parallelism": 3}), "ns", NAME, SETTINGS)
    assert steps(plain) == ("calibrate", "workers", "finalize")  # nothing to fit


async def test_the_operator_says_where_it_falls_back_to_one_pass(cluster, operator):
    """experts "auto" with calibration: accepted (not refused), one-pass statistics and a note
    saying why in status.plan.notes and the Accepted condition; the build still reconstructs."""
    await _apply(cluster, "fallback", pruning={"experts": "auto", "maxKL": 0.05, "seed": 0},
                 calibration={"samples": 16})
    job = await eventually(lambda: cluster.get(JOBS, NS, "fallback-transform-g1"), what="transformer Job")
    pod = job["spec"]["template"]["spec"]
    assert "--one-pass" in pod["initContainers"][0]["args"] and "--reconstruct" in pod["containers"][0]["args"]
    status = cluster.get(PROXYMODELS, NS, "fallback")["status"]
    note = status["plan"]["notes"][-1]
    assert note.startswith("one-pass calibration statistics, not sequential") and "auto" in note, note
    (accepted_condition,) = [c for c in status["conditions"] if c["type"] == "Accepted"]
    assert accepted_condition["status"] == "True" and note in accepted_condition["message"]
