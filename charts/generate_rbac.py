#!/usr/bin/env python3
"""Write charts/moe-proxy/files/rbac-rules.yaml from the operator's rbac.PERMISSIONS.

PERMISSIONS (operator/proxymodel_operator/rbac.py) is the one list of the Kubernetes calls
the operator makes; its API client refuses any call not on it. The chart's ClusterRole /
Roles are rendered from the file this script writes, and tests/chart fails when the file and
PERMISSIONS differ, so the chart can neither grant less than the code needs nor more.

    python charts/generate_rbac.py          # rewrite the file
    python charts/generate_rbac.py --check  # exit 1 when it is stale

What the chart adds to each permission, and only this:
- `clusterScoped`: whether the resource is cluster-scoped. In namespaced mode (the chart's
  `watchNamespaces`), namespaced resources are granted by a Role in each watched namespace
  and only cluster-scoped ones by a ClusterRole.
- `features`: the chart values that need the permission. Empty: always granted. Otherwise
  granted when any of them is enabled (`preflight` = operator.preflight,
  `checkpointWatch` = checkpointWatch.enabled, a runtime's = runtimes.<name>.enabled). A Permission may carry its own
  `features` attribute; FEATURES below covers those that do not.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "charts" / "moe-proxy" / "files" / "rbac-rules.yaml"
CRDS = ROOT / "crds"

# Built-in and well-known cluster-scoped resources. Custom resources of this project take
# their scope from their CRD in crds/; anything else is namespaced.
CLUSTER_SCOPED = {
    ("", "namespaces"), ("", "nodes"), ("", "persistentvolumes"),
    ("apiextensions.k8s.io", "customresourcedefinitions"),
    ("rbac.authorization.k8s.io", "clusterroles"), ("rbac.authorization.k8s.io", "clusterrolebindings"),
    ("storage.k8s.io", "storageclasses"), ("scheduling.k8s.io", "priorityclasses"),
    ("admissionregistration.k8s.io", "validatingwebhookconfigurations"),
    ("admissionregistration.k8s.io", "mutatingwebhookconfigurations"),
    ("kopf.dev", "clusterkopfpeerings"), ("scheduling.volcano.sh", "queues"),
}

# Permissions only some configurations need: (apiGroup, resource) -> features.
# The Secret `get` serves the preflight read of a ProxyModel's source (operator.preflight)
# and, with issue 11, a CheckpointWatch's listing (checkpointWatch.enabled).
FEATURES = {
    ("", "secrets"): ("preflight", "checkpointWatch"),
}
# The reproduction runtimes the chart turns on (runtimes.<name>: volcanoJob, ascendJob, rayJob,
# trainJob, jobSet), each from its entry in the operator's runtimes table.
RUNTIME_FEATURES = ("volcanoJob", "ascendJob", "rayJob", "trainJob", "jobSet")
KNOWN_FEATURES = ("preflight", "checkpointWatch", *RUNTIME_FEATURES)

HEADER = """\
# Generated from operator/proxymodel_operator/rbac.py (PERMISSIONS) by charts/generate_rbac.py.
# Do not edit by hand: run `python charts/generate_rbac.py`; tests/chart fails when stale.
"""


def _crd_scopes() -> dict[tuple[str, str], bool]:
    scopes: dict[tuple[str, str], bool] = {}
    for path in sorted(CRDS.glob("*.y*ml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "CustomResourceDefinition":
                spec = doc["spec"]
                scopes[(spec["group"], spec["names"]["plural"])] = spec.get("scope") == "Cluster"
    return scopes


def _permissions():
    sys.path.insert(0, str(ROOT / "operator"))
    try:
        from proxymodel_operator.rbac import PERMISSIONS
    finally:
        sys.path.remove(str(ROOT / "operator"))
    return PERMISSIONS


def rules(permissions=None) -> list[dict]:
    """PERMISSIONS as the chart's rule list, in PERMISSIONS order."""
    permissions = _permissions() if permissions is None else permissions
    crd_scopes = _crd_scopes()
    out = []
    for p in permissions:
        base = p.resource.split("/")[0]
        key = (p.api_group, base)
        if "*" in (p.api_group, p.resource) or "*" in p.verbs:
            raise SystemExit(f"rbac.PERMISSIONS has a wildcard in {p}: the chart grants no wildcard")
        features = tuple(getattr(p, "features", ()) or FEATURES.get(key, ()))
        unknown = set(features) - set(KNOWN_FEATURES)
        if unknown:
            raise SystemExit(f"{key}: unknown chart feature(s) {sorted(unknown)}; known: {KNOWN_FEATURES}")
        out.append({
            "apiGroup": p.api_group,
            "resource": p.resource,
            "verbs": list(p.verbs),
            "clusterScoped": crd_scopes.get(key, key in CLUSTER_SCOPED),
            "features": list(features),
            "why": p.why,
        })
    return out


def render(permissions=None) -> str:
    return HEADER + yaml.safe_dump({"rules": rules(permissions)}, sort_keys=False, width=120, default_flow_style=None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUTPUT.exists() or OUTPUT.read_text() != text:
            print(f"{OUTPUT.relative_to(ROOT)} is stale: run python charts/generate_rbac.py", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(ROOT)} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
