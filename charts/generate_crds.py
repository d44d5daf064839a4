#!/usr/bin/env python3
"""Write the option fields of the ProxyModel CRD (crds/proxymodels.moeproxy.io.yaml) from the
options models (transformer/moe_proxy/options.py): spec.pruning from PruningOptions,
spec.calibration from TokenOptions. The fields only the operator has (OPERATOR_ONLY) are kept
as they are; every other field of those sections is generated. tests/chart fails when the
file is stale.

    python charts/generate_crds.py          # rewrite the file
    python charts/generate_crds.py --check  # exit 1 when it is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from moe_proxy.options import PruningOptions, TokenOptions, crd_properties

CRD = Path(__file__).resolve().parents[1] / "crds" / "proxymodels.moeproxy.io.yaml"
# spec section -> (its options model, the fields of that section only the operator has)
SECTIONS = {"pruning": (PruningOptions, ("sequential",)), "calibration": (TokenOptions, ())}


def spec_schema(crd: dict) -> dict:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]


def render(text: str) -> str:
    crd = yaml.safe_load(text)
    spec = spec_schema(crd)
    for section, (model, operator_only) in SECTIONS.items():
        props = spec[section]["properties"]
        spec[section]["properties"] = crd_properties(model) | {k: props[k] for k in operator_only if k in props}
    return yaml.safe_dump(crd, sort_keys=False, width=110, allow_unicode=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the CRD file is stale")
    args = parser.parse_args()
    current = CRD.read_text()
    wanted = render(current)
    if args.check:
        return int(current != wanted)
    CRD.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
