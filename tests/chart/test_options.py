"""One options model per stage (moe_proxy.options): the CLI's flags, the operator's Job args and
the ProxyModel CRD's schema all come from it, and this fails when any of them drifts."""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from moe_proxy.cli import build_parser, subcommands
from moe_proxy.investigate.diagnose import AtOnce, Seeds
from moe_proxy.metrics.detect import FailOnOption
from moe_proxy.options import (CLI_ONLY, OutputOptions, PruningOptions, StoreOptions, TokenOptions, crd_properties,
                               from_args, options_of, spelled)
from moe_proxy.rl.config import Faults, ReproConfig
from moe_proxy.rl.run_options import FaultOptions, PlacementOptions, RunOptions
from proxymodel_operator.reproduction import repro_args
from proxymodel_operator.settings import Settings
from proxymodel_operator.spec import parse
from proxymodel_operator.transformer_job import build_args, calibrate_args

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "proxymodels.moeproxy.io.yaml"
SPEC = {"source": {"uri": "s3://ckpt/m"}}


def generator():
    spec = importlib.util.spec_from_file_location("generate_crds", ROOT / "charts" / "generate_crds.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_crd_is_generated_from_the_options_models():
    assert CRD.read_text() == generator().render(CRD.read_text()), \
        "crds/proxymodels.moeproxy.io.yaml is stale: run python charts/generate_crds.py"
    spec = generator().spec_schema(yaml.safe_load(CRD.read_text()))
    assert crd_properties(PruningOptions).items() <= spec["pruning"]["properties"].items()
    assert set(spec["pruning"]["properties"]) - set(crd_properties(PruningOptions)) == {"sequential"}
    assert spec["calibration"]["properties"] == crd_properties(TokenOptions)
    assert crd_properties(ReproConfig).items() <= spec["reproduction"]["properties"].items()


# Every options model; test_every_options_model_is_listed keeps the list whole.
MODELS = (PruningOptions, TokenOptions, OutputOptions, StoreOptions, ReproConfig, RunOptions, FailOnOption,
          PlacementOptions, FaultOptions, Seeds, AtOnce)


def _flags(command: str) -> set[str]:
    sub = subcommands(build_parser())[command]
    return {s for a in sub._actions for s in a.option_strings if s.startswith("--") and s != "--help"}


def test_every_options_model_is_listed():
    """Each dataclass in src/ with option() fields is in MODELS (found by reading the source)."""
    found = set()
    for path in (ROOT / "src" / "moe_proxy").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    isinstance(c, ast.Call) and getattr(c.func, "id", None) == "option"
                    for stmt in node.body if isinstance(stmt, ast.AnnAssign) for c in [stmt.value]):
                found.add(node.name)
    assert found == {m.__name__ for m in MODELS}


@pytest.mark.parametrize("command", sorted(subcommands(build_parser())))
def test_every_cli_flag_is_an_option_or_listed_as_cli_only(command):
    """Each flag of every command is spelled by an options model's option (which reaches a CRD or
    says why not), or is in options.CLI_ONLY with its reason; CLI_ONLY names no flag that is gone."""
    generated = set()
    for model in MODELS:
        for name, opt, default in options_of(model):
            assert opt.crd or opt.cli_only, f"{model.__name__}.{name}: neither a CRD field nor a reason"
            generated |= set(spelled(name, opt, default))
    flags = _flags(command)
    assert flags - generated <= set(CLI_ONLY[command]), flags - generated - set(CLI_ONLY[command])
    assert set(CLI_ONLY[command]) <= flags - generated, set(CLI_ONLY[command]) - (flags - generated)
    assert set(CLI_ONLY) == set(subcommands(build_parser()))


def _cli(argv: list[str]):
    return build_parser().parse_args(argv)


@pytest.mark.parametrize("pruning, stated", [  # spec.pruning, and the options it states (not defaults)
    ({"experts": 16, "method": "saliency", "representative": "medoid", "keepSuper": False, "merge": True,
      "pin": ["3:17", "3:2", "10:5"], "topK": 4, "seed": 3, "clustering": "agglomerative", "features": "weights",
      "superRangeShare": 0.25, "superOutlier": 40},
     {"experts": 16, "method": "saliency", "representative": "medoid", "keep_super": False, "merge": True,
      "pins": {3: [17, 2], 10: [5]}, "top_k": 4, "seed": 3, "clustering": "agglomerative", "features": "weights",
      "super_range_share": 0.25, "super_outlier": 40.0}),
    ({"keepRatio": 0.25, "heal": True, "reconstruct": False}, {"keep_ratio": 0.25, "heal": True, "reconstruct": False}),
    ({"experts": "auto", "maxKL": 0.05}, {"experts": "auto", "max_kl": 0.05}),
    ({"experts": 8}, {"experts": 8}),
])
def test_the_jobs_args_parse_back_to_the_specs_options(pruning, stated):
    """spec.pruning -> the Job's `moe-proxy build` args -> the CLI's parser -> the same options,
    and each value the spec states among them (a field the spec parser dropped would default on
    both sides of the round trip)."""
    fields = {opt.crd: name for name, opt, _ in options_of(PruningOptions) if opt.crd}
    assert {fields[key] for key in pruning} == set(stated)  # the table states every key of the spec
    calibrated = pruning != {"experts": 8}
    spec = parse({**SPEC, "pruning": pruning, **({"calibration": {"samples": 8}} if calibrated else {})},
                 "ns", "pm", Settings())
    args = build_args(spec)
    parsed = from_args(PruningOptions, _cli(args)).resolved()  # as build_proxy takes them
    want = replace(spec.pruning.options, calibration=spec.calibration_uri if calibrated else None)
    assert parsed == want, args
    assert {name: getattr(parsed, name) for name in stated} == stated, args
    if calibrated and (spec.pruning.experts is not None or not spec.pruning.sequential):  # (else: once planned)
        tokens = from_args(TokenOptions, _cli(calibrate_args(spec)))
        assert replace(tokens, batch_size=spec.calibration.batch_size) == spec.calibration


def test_merge_is_settable_on_a_proxymodel_and_reaches_the_job():
    spec = parse({**SPEC, "pruning": {"experts": 8, "merge": True}, "calibration": {}}, "ns", "pm", Settings())
    assert spec.pruning.merge and "--merge" in build_args(spec) and _cli(build_args(spec)).merge
    with pytest.raises(ValueError, match="merge.*needs spec.calibration"):
        parse({**SPEC, "pruning": {"experts": 8, "merge": True}}, "ns", "pm", Settings())
    with pytest.raises(ValueError, match="--merge with --method random"):
        parse({**SPEC, "pruning": {"experts": 8, "merge": True, "method": "random"}, "calibration": {}},
              "ns", "pm", Settings())


def test_the_reproductions_rl_settings_reach_its_job():
    """spec.reproduction's RL settings -> the Job's `moe-proxy repro` args -> the same config."""
    settings = {"lr": 3e-4, "batchSize": 16, "groupSize": 8, "klCoef": 0.0, "routerZCoef": 0.001,
                "lrSchedule": "cosine", "precision": "fp16", "lossScaling": "none", "maxSteps": 12}
    spec = parse({**SPEC, "pruning": {"experts": 8}, "reproduction": settings}, "ns", "pm", Settings())
    assert (spec.reproduction.max_steps, spec.reproduction.precision) == (12, "fp16")
    parsed = from_args(ReproConfig, _cli(repro_args(spec, "s3://b/proxy")), faults=Faults())
    assert parsed == spec.reproduction.config
    default = parse({**SPEC, "pruning": {"experts": 8}}, "ns", "pm", Settings()).reproduction
    assert (default.max_steps, default.precision) == (50, "bf16")  # the ProxyModel's defaults, not the CLI's
    with pytest.raises(ValueError, match="spec.reproduction.lr -1"):
        parse({**SPEC, "pruning": {"experts": 8}, "reproduction": {"lr": -1}}, "ns", "pm", Settings())
    mismatch = {"rolloutPrecision": "bf16", "rolloutKernels": "grouped", "routingReplay": "R3", "rolloutIs": "sequence",
                "rolloutIsThreshold": 3.0, "rolloutIsMode": "mask", "ratioLevel": "sequence", "routerDtype": "fp32",
                "lmHeadDtype": "fp32", "adamEps": 1e-6, "skipNonfinite": False}
    spec = parse({**SPEC, "pruning": {"experts": 8}, "reproduction": mismatch}, "ns", "pm", Settings())
    assert from_args(ReproConfig, _cli(repro_args(spec, "s3://b/proxy")), faults=Faults()) == spec.reproduction.config
    assert spec.reproduction.config.routing_replay == "R3" and spec.reproduction.config.skip_nonfinite is False
    with pytest.raises(ValueError, match="spec.reproduction.routingReplay 'R9'"):
        parse({**SPEC, "pruning": {"experts": 8}, "reproduction": {"routingReplay": "R9"}}, "ns", "pm", Settings())
