"""docs/operator.md's table of the Diagnosis spec fields is the CRD's (crds/diagnoses.moeproxy.io.yaml):
one row per field (spec.checkpoints' fields as `checkpoints.X`), with the CRD's default and range,
and an object field's own fields named in its row. A field added to the CRD without a row, or a
default changed in one place only, fails here. The README names the resource and its short name."""

from __future__ import annotations

import re

from ..checkpoints.crd_schema import ROOT, load_crd, openapi

DOC = ROOT / "docs" / "operator.md"
NESTED = ("checkpoints",)  # object fields whose own fields get rows of their own


def spec_fields() -> dict[str, dict]:
    """The Diagnosis CRD's spec fields by documented name: `seeds`, `checkpoints.watch`, ..."""
    spec = openapi(load_crd("diagnoses.moeproxy.io"))["properties"]["spec"]["properties"]
    out = dict(spec)
    for name in NESTED:
        out.update({f"{name}.{k}": v for k, v in spec[name]["properties"].items()})
    return out


def spec_table() -> dict[str, tuple[str, str]]:
    """The rows of the table after `**Spec**` in the Diagnosis section: field -> (values, meaning)."""
    section = DOC.read_text().split("\n## Diagnosis", 1)[1].split("\n## ", 1)[0]
    lines = section.split("**Spec**", 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        field, values, meaning = (cell.strip() for cell in line.strip("|").split(" | ", 2))
        rows[field.strip("`")] = (values, meaning)
    return rows


def _range(schema: dict) -> str | None:
    low = schema.get("minimum", schema.get("minItems"))
    high = schema.get("maximum", schema.get("maxItems"))
    if low is not None and high is not None:
        return f"{low} to {high}"
    return f"at least {low}" if low is not None else None


def test_the_table_has_a_row_for_every_spec_field_and_no_other():
    assert sorted(spec_table()) == sorted(spec_fields())


def test_each_row_gives_the_crds_default_range_and_fields():
    rows = spec_table()
    for name, schema in spec_fields().items():
        values, meaning = rows[name]
        if "default" in schema:
            assert f"default {schema['default']}" in values, (name, values)
        if (span := _range(schema)) is not None:
            assert span in values, (name, span, values)
        for sub in (schema.get("properties") or {}) if name not in NESTED else ():
            assert f"`{sub}`" in values + meaning, (name, sub)


def test_the_printed_columns_are_the_crds():
    """Every `kubectl get pxd` shown (README, docs/operator.md) has the CRD's printer columns."""
    version = load_crd("diagnoses.moeproxy.io")["spec"]["versions"][0]
    columns = ["NAME", *(c["name"].upper() for c in version["additionalPrinterColumns"])]
    for doc in (ROOT / "README.md", DOC):
        lines = doc.read_text().splitlines()
        shown = [lines[i + 1] for i, line in enumerate(lines) if line.endswith("get pxd")]
        assert shown, f"{doc.name} shows no kubectl get pxd"
        for header in shown:
            assert re.split(r"\s{2,}", header.strip()) == columns, (doc.name, header)


def test_the_readme_names_the_diagnosis_resource_and_its_short_name():
    readme = (ROOT / "README.md").read_text()
    crd = load_crd("diagnoses.moeproxy.io")["spec"]["names"]
    assert f"kind: {crd['kind']}" in readme and f"kubectl -n rl-team get {crd['shortNames'][0]}" in readme
    install = readme.split("## Install on a cluster", 1)[1].split("\n## ", 1)[0]
    assert re.search(r"ProxyModel and Diagnosis CRDs", install), "the install section names the CRDs it installs"
