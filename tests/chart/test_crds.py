"""The chart ships the CRDs of crds/, the one source of truth: files/crds is a link to that
folder, Helm reads the same bytes through it, a packaged chart carries them, and the rendered
CustomResourceDefinitions are those objects (plus the chart's labels and keep annotation)."""

from __future__ import annotations

import os
import shutil

import pytest
import yaml

from ..checkpoints.crd_schema import errors
from .conftest import CHART, CRDS, by_kind, helm, load_chart, render_objects

CHART_LABELS = {"app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component",
                "app.kubernetes.io/version", "app.kubernetes.io/managed-by", "app.kubernetes.io/part-of",
                "helm.sh/chart"}


def crd_files() -> dict[str, bytes]:
    files = {p.name: p.read_bytes() for p in sorted(CRDS.glob("*.yaml"))}
    assert files, "crds/ holds no CRD"
    return files


def crd_objects() -> dict[str, dict]:
    out = {}
    for data in crd_files().values():
        for doc in yaml.safe_load_all(data):
            if doc:
                assert doc["kind"] == "CustomResourceDefinition"
                out[doc["metadata"]["name"]] = doc
    return out


def test_chart_folder_is_a_link_to_crds():
    link = CHART / "files" / "crds"
    assert link.is_symlink(), "charts/moe-proxy/files/crds must link to crds/, not copy it"
    assert os.readlink(link) == "../../../crds"  # relative: works in every checkout
    assert link.resolve() == CRDS.resolve()


def test_helm_reads_the_same_bytes(chart):
    shipped = {f["name"].removeprefix("files/crds/"): f["data"].encode()
               for f in chart.files if f["name"].startswith("files/crds/")}
    assert shipped == crd_files()


def test_packaged_chart_carries_the_same_bytes(tmp_path):
    archive = helm.package(str(CHART), destination=str(tmp_path))
    with helm.Chart.load_archive(open(archive, "rb").read()) as packaged:
        shipped = {f["name"].removeprefix("files/crds/"): f["data"].encode()
                   for f in packaged.files if f["name"].startswith("files/crds/")}
    assert shipped == crd_files()


def test_rendered_crds_are_the_crds_of_the_repository(chart):
    objects = render_objects(chart, {"checkpointWatch": {"enabled": True}})
    rendered = {o["metadata"]["name"]: o for o in by_kind(objects, "CustomResourceDefinition")}
    expected = crd_objects()
    assert sorted(rendered) == sorted(expected)
    assert "proxymodels.moeproxy.io" in rendered
    for name, crd in rendered.items():
        meta = crd["metadata"]
        source_meta = expected[name]["metadata"]
        # Only the chart's labels and the keep annotation are added; the rest is untouched.
        added_labels = set(meta.get("labels", {})) - set(source_meta.get("labels", {}))
        assert added_labels == CHART_LABELS
        assert meta["annotations"] == {**source_meta.get("annotations", {}), "helm.sh/resource-policy": "keep"}
        strip = {k: v for k, v in meta.items() if k not in ("labels", "annotations")}
        source_strip = {k: v for k, v in source_meta.items() if k not in ("labels", "annotations")}
        assert strip == source_strip
        assert {k: v for k, v in crd.items() if k != "metadata"} == \
               {k: v for k, v in expected[name].items() if k != "metadata"}


def test_checkpointwatch_crd_comes_with_checkpoint_watching(chart):
    kinds = {c["metadata"]["name"]: c["spec"]["names"]["kind"] for c in crd_objects().values()}
    off = {c["spec"]["names"]["kind"] for c in by_kind(render_objects(chart), "CustomResourceDefinition")}
    on = {c["spec"]["names"]["kind"]
          for c in by_kind(render_objects(chart, {"checkpointWatch": {"enabled": True}}), "CustomResourceDefinition")}
    assert "ProxyModel" in off and "CheckpointWatch" not in off
    assert on == set(kinds.values())


def test_crds_can_be_left_out_or_released_on_uninstall(chart):
    assert not by_kind(render_objects(chart, {"crds": {"install": False}}), "CustomResourceDefinition")
    for crd in by_kind(render_objects(chart, {"crds": {"keep": False}}), "CustomResourceDefinition"):
        assert "helm.sh/resource-policy" not in crd["metadata"].get("annotations", {})


def test_crds_are_templates_not_helm_crds_folder(chart):
    """Helm never upgrades CRDs from a chart's crds/ folder; these are templates so that
    `helm upgrade` updates the API along with the operator."""
    assert chart.crds == []
    assert not (CHART / "crds").exists()


def test_multi_document_crd_files_and_broken_ones(tmp_path):
    """A crds/ file may hold several CRDs (`---`); a file that is not YAML fails the render
    with its name instead of shipping a broken CRD."""
    copy = tmp_path / "moe-proxy"
    shutil.copytree(CHART, copy, symlinks=False)  # files/crds becomes real files here
    first, second = (yaml.safe_load(CRDS.joinpath("proxymodels.moeproxy.io.yaml").read_text()) for _ in range(2))
    second["metadata"]["name"] = "widgets.moeproxy.io"
    second["spec"]["names"].update(kind="Widget", listKind="WidgetList", plural="widgets", singular="widget",
                                   shortNames=["wdg"])
    (copy / "files" / "crds" / "proxymodels.moeproxy.io.yaml").write_text(
        yaml.safe_dump(first) + "---\n" + yaml.safe_dump(second))
    with load_chart(copy) as chart:
        names = {c["metadata"]["name"] for c in by_kind(render_objects(chart), "CustomResourceDefinition")}
    assert {"proxymodels.moeproxy.io", "widgets.moeproxy.io"} <= names

    (copy / "files" / "crds" / "broken.yaml").write_text("spec: [unclosed\n")
    with load_chart(copy) as chart:
        with pytest.raises(helm.HelmRenderError, match="files/crds/broken.yaml"):
            render_objects(chart)


def test_rendered_proxymodel_crd_takes_the_build_options(chart):
    """The CRD the chart installs knows the build options the operator passes on (issue #16):
    booleans, each accepted and a non-boolean rejected by its schema; heal off unless set, and
    sequential and reconstruct without a schema default (absent: on with spec.calibration, the
    operator decides)."""
    (crd,) = [c for c in by_kind(render_objects(chart), "CustomResourceDefinition")
              if c["metadata"]["name"] == "proxymodels.moeproxy.io"]
    pruning = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["pruning"]
    obj = {"apiVersion": "moeproxy.io/v1alpha1", "kind": "ProxyModel", "metadata": {"name": "x", "namespace": "n"},
           "spec": {"source": {"uri": "s3://ckpt/m"}, "calibration": {"samples": 8}}}
    for field in ("sequential", "reconstruct", "heal"):
        assert pruning["properties"][field]["type"] == "boolean"
        assert pruning["properties"][field].get("default") is (False if field == "heal" else None), field
        obj["spec"]["pruning"] = {"experts": 8, field: True}
        assert errors(crd, obj) == [], field
        obj["spec"]["pruning"] = {"experts": 8, field: "true"}
        assert any(field in e for e in errors(crd, obj)), field
