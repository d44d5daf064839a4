#!/usr/bin/env python3
"""Write the option fields of the ProxyModel CRD (crds/proxymodels.moeproxy.io.yaml) from the
options models (src/moe_proxy/options.py): spec.pruning from PruningOptions,
spec.calibration from TokenOptions, spec.reproduction's RL settings from rl.config.ReproConfig.
The fields only the operator has are kept as they are (for pruning and calibration: only those
listed below), after the generated ones. The Diagnosis CRD (crds/diagnoses.moeproxy.io.yaml)
takes its spec.failOn from the ProxyModel's spec.reproduction.failOn, its description kept.
tests/chart fails when a file is stale.

    python charts/generate_crds.py          # rewrite the file
    python charts/generate_crds.py --check  # exit 1 when it is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from moe_proxy.options import PruningOptions, TokenOptions, crd_properties
from moe_proxy.rl.config import ReproConfig

CRD = Path(__file__).resolve().parents[1] / "crds" / "proxymodels.moeproxy.io.yaml"
DIAGNOSIS_CRD = CRD.with_name("diagnoses.moeproxy.io.yaml")
# spec section -> (its options model, the fields of that section only the operator has; None:
# the section is mostly the operator's own, whatever is not generated is kept)
SECTIONS = {"pruning": (PruningOptions, ("sequential",)), "calibration": (TokenOptions, ()),
            "reproduction": (ReproConfig, None)}


def spec_schema(crd: dict) -> dict:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]


def render(text: str) -> str:
    crd = yaml.safe_load(text)
    spec = spec_schema(crd)
    for section, (model, operator_only) in SECTIONS.items():
        props, generated = spec[section]["properties"], crd_properties(model)
        kept = [k for k in props if k not in generated] if operator_only is None else operator_only
        spec[section]["properties"] = generated | {k: props[k] for k in kept if k in props}
    return yaml.safe_dump(crd, sort_keys=False, width=110, allow_unicode=True)


def render_diagnosis(text: str, proxymodel_crd: str) -> str:
    """The Diagnosis CRD with spec.failOn as the ProxyModel's spec.reproduction.failOn."""
    crd = yaml.safe_load(text)
    fail_on = spec_schema(yaml.safe_load(proxymodel_crd))["reproduction"]["properties"]["failOn"]
    spec = spec_schema(crd)
    spec["failOn"] = {**fail_on, "description": spec["failOn"].get("description", fail_on.get("description"))}
    return yaml.safe_dump(crd, sort_keys=False, width=110, allow_unicode=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a CRD file is stale")
    args = parser.parse_args()
    current = CRD.read_text()
    wanted = render(current)
    diagnosis = DIAGNOSIS_CRD.read_text()
    wanted_diagnosis = render_diagnosis(diagnosis, wanted)
    if args.check:
        return int(current != wanted or diagnosis != wanted_diagnosis)
    CRD.write_text(wanted)
    DIAGNOSIS_CRD.write_text(wanted_diagnosis)
    return 0


if __name__ == "__main__":
    sys.exit(main())
