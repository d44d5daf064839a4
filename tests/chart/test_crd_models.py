"""The three CRDs' spec schemas come from the models that declare their fields (charts/generate_crds.py):
every CRD spec field comes from a model or is listed as the operator's own with a reason, every
model field reaches its CRD, the shared blocks (source, S3 location, failOn, a workload's pod
fields) are one declaration,
the failOn signatures are the detectors', and the candidates' description names the catalogue.
The parsers read the same declarations (defaults, ranges)."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from dataclasses import fields

import pytest
import yaml

from moe_proxy.investigate.catalogue import CATALOGUE
from moe_proxy.metrics.detect import SIGNATURES as DETECTED
from moe_proxy.options import S3_URI
from proxymodel_operator.crd_fields import crd_names
from proxymodel_operator.diagnosis_spec import INLINE, BisectSpec, DiagnosisSpec, InvalidDiagnosis, parse_diagnosis
from proxymodel_operator.settings import Settings
from proxymodel_operator.shared_fields import FailOnFields, SourceFields, WorkloadFields
from proxymodel_operator.spec import parse
from proxymodel_operator.watch_spec import WatchSpec, parse_watch

from .conftest import CRDS, ROOT

PROXYMODEL, DIAGNOSIS, WATCH = "proxymodels", "diagnoses", "checkpointwatches"


def generator():
    spec = importlib.util.spec_from_file_location("generate_crds", ROOT / "charts" / "generate_crds.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def spec_of(name: str) -> dict:
    crd = yaml.safe_load((CRDS / f"{name}.moeproxy.io.yaml").read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]


def dotted(props: dict, depth: int) -> set[str]:
    """Field names to `depth` levels: `reproduction`, `reproduction.lr`, ..."""
    out = set()
    for name, schema in props.items():
        out.add(name)
        if depth > 1 and "properties" in schema:
            out |= {f"{name}.{sub}" for sub in dotted(schema["properties"], depth - 1)}
    return out


def test_no_crd_file_is_stale():
    gen = generator()
    for path, render in gen.RENDERERS.items():
        assert path.read_text() == render(path.read_text()), f"{path.name} is stale: run python charts/generate_crds.py"


def test_check_exits_1_on_any_stale_file(tmp_path, monkeypatch):
    gen = generator()
    for path in gen.RENDERERS:
        shutil.copy(path, tmp_path / path.name)
    monkeypatch.setattr(gen, "RENDERERS", {tmp_path / p.name: r for p, r in gen.RENDERERS.items()})
    monkeypatch.setattr(sys, "argv", ["generate_crds.py", "--check"])
    assert gen.main() == 0
    watch = tmp_path / f"{WATCH}.moeproxy.io.yaml"
    watch.write_text(watch.read_text().replace("minimum: 30", "minimum: 10"))  # a hand edit of a generated field
    assert gen.main() == 1
    monkeypatch.setattr(sys, "argv", ["generate_crds.py"])
    assert gen.main() == 0 and "minimum: 30" in watch.read_text()
    monkeypatch.setattr(sys, "argv", ["generate_crds.py", "--check"])
    assert gen.main() == 0


def test_the_diagnosis_and_watch_specs_are_their_models_fields_and_no_other():
    spec = spec_of(DIAGNOSIS)
    assert list(spec) == crd_names(DiagnosisSpec)
    assert list(spec["checkpoints"]["properties"]) == ["watch", *INLINE, "good", "bad"]
    assert set(crd_names(BisectSpec)) | set(INLINE) == set(spec["checkpoints"]["properties"])
    assert set(INLINE) <= set(crd_names(WatchSpec))  # a bisection's inline fields are a watch's
    assert list(spec_of(WATCH)) == crd_names(WatchSpec)


def test_every_proxymodel_field_is_generated_or_hand_written_with_a_reason():
    gen = generator()
    generated = set(gen.proxymodel_generated())
    fields = dotted(spec_of(PROXYMODEL), 2)
    sections = {name.split(".")[0] for name in generated | set(gen.HAND_WRITTEN) if "." in name}
    leaves = {f for f in fields if "." in f or f not in sections}  # a section is its fields
    leaves -= {f for f in leaves if f.split(".")[0] in gen.HAND_WRITTEN}  # a hand-written block's own fields
    leaves -= {f for f in leaves if f.split(".")[0] == "source" and "." in f}  # the source block, generated whole
    assert leaves <= generated | set(gen.HAND_WRITTEN), leaves - generated - set(gen.HAND_WRITTEN)
    assert set(gen.HAND_WRITTEN) <= fields, set(gen.HAND_WRITTEN) - fields  # no reason for a field that is gone
    assert generated <= fields, generated - fields  # every model field reaches the CRD
    assert all(reason for reason in gen.HAND_WRITTEN.values())


def _schemas(node, path=""):
    """(path, schema) of every property schema under node."""
    if isinstance(node, dict):
        for key, value in (node.get("properties") or {}).items():
            yield f"{path}.{key}", value
            yield from _schemas(value, f"{path}.{key}")


@pytest.mark.parametrize("name", [PROXYMODEL, DIAGNOSIS, WATCH])
def test_every_s3_location_and_source_is_the_shared_one(name):
    spec = {"properties": spec_of(name)}
    s3 = [path for path, s in _schemas(spec) if str(s.get("pattern", "")).startswith("^s3://")]
    assert s3, name
    for path, schema in _schemas(spec):
        if str(schema.get("pattern", "")).startswith("^s3://"):
            assert (schema["pattern"], schema["maxLength"]) == (S3_URI, 1024), path
        if path.endswith(".source") and "properties" in schema:
            assert list(schema["properties"]) == crd_names(SourceFields), path
            assert schema["required"] == ["uri"]


def test_failon_is_the_detectors_signatures_in_both_crds():
    for fail_on in (spec_of(PROXYMODEL)["reproduction"]["properties"]["failOn"], spec_of(DIAGNOSIS)["failOn"]):
        assert fail_on["properties"]["signature"]["enum"] == [*DETECTED, "threshold"]
        assert list(fail_on["properties"]) == crd_names(FailOnFields)


def test_the_candidates_description_names_the_catalogue():
    text = " ".join(spec_of(DIAGNOSIS)["candidates"]["description"].split())
    named = text.split("catalogue (", 1)[1].split(";", 1)[0].split(", ")
    assert named == list(CATALOGUE)


def test_the_parsers_read_the_models_defaults_and_ranges():
    """The defaults the CRD declares are the ones the operator applies when a field is absent
    (the API server fills them in; the emulator in tests and a client skipping it do not)."""
    spec = spec_of(DIAGNOSIS)
    d = parse_diagnosis({"proxyModel": "pm", "candidates": ["fp32"]})
    assert (d.seeds, d.parallelism, d.steps) == (spec["seeds"]["default"], spec["parallelism"]["default"], None)
    with pytest.raises(InvalidDiagnosis, match=r"spec.seeds 17: must be at most 16"):
        parse_diagnosis({"proxyModel": "pm", "candidates": ["fp32"], "seeds": 17})
    w = parse_watch({"source": {"uri": "s3://ckpt/run"}, "template": {"spec": {"pruning": {"experts": 8}}}})
    watch = spec_of(WATCH)
    assert (w.poll_interval, w.suspend, w.delete_proxy_data) == (
        watch["pollInterval"]["default"], watch["suspend"]["default"], watch["deleteProxyData"]["default"])


def test_both_workload_sections_are_the_one_declaration_and_the_parser_reads_every_field():
    """spec.transformer and spec.reproduction take WorkloadFields (the transformer less the
    scheduler and queue), and spec.parse reads each field under the declaration's own name: into
    the Workload, schedulerName and queue into the Reproduction."""
    spec, names = spec_of(PROXYMODEL), crd_names(WorkloadFields)
    transformer, reproduction = spec["transformer"]["properties"], spec["reproduction"]["properties"]
    assert [n for n in transformer if n in names] == [n for n in names if n not in ("schedulerName", "queue")]
    assert [n for n in reproduction if n in names] == names
    assert all(transformer[n] | {"description": ""} == reproduction[n] | {"description": ""} for n in transformer
               if n in names)
    by_type = {"string": "x", "integer": 7, "array": [{"name": "A", "value": "1"}],
               "object": {"disktype": "ssd"}}
    values = {f.name: by_type[reproduction[crd]["type"]] for f, crd in zip(fields(WorkloadFields), names)}
    raw = {crd: values[f.name] for f, crd in zip(fields(WorkloadFields), names)}
    raw["imagePullPolicy"] = values["image_pull_policy"] = "Never"
    parsed = parse({"source": {"uri": "s3://bucket/model"}, "pruning": {"experts": 8},
                    "transformer": {n: v for n, v in raw.items() if n in transformer}, "reproduction": raw},
                   "ns", "pm", Settings())
    for name, value in values.items():
        if name in ("scheduler_name", "volcano_queue"):
            assert getattr(parsed.reproduction, name) == value, name
        else:
            assert getattr(parsed.reproduction.workload, name) == value, name
            assert getattr(parsed.transformer, name) == value, name
