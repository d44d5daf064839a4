"""Render the chart with Helm's own engine (helm-python-sdk: Helm v4 through its C ABI)."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import yaml

from ..promised import require

helm = require("helm_python", "helm-python-sdk")

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "moe-proxy"
CRDS = ROOT / "crds"
RELEASE = "moe-proxy"
NAMESPACE = "moe-proxy"
# Kubernetes versions every rendered object must be valid for: the chart's minimum
# (Chart.yaml kubeVersion) and the newest kubernetes-validate knows.
KUBE_VERSIONS = ("1.31.0", "1.37.0")

if str(ROOT / "operator") not in sys.path:
    sys.path.insert(0, str(ROOT / "operator"))

helm.disable_logging()


def load_chart(path: Path = CHART):
    return helm.Chart.load(str(path))


@pytest.fixture(scope="session")
def chart():
    with load_chart() as c:
        yield c


def render_objects(chart, values: dict | None = None, *, name: str = RELEASE,
                   namespace: str = NAMESPACE) -> list[dict]:
    """Every object the chart renders with `values`, parsed, in template order."""
    manifests = chart.render(copy.deepcopy(values) if values else None, name=name, namespace=namespace,
                             is_install=True)
    objects = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                objects.append(doc)
    return objects


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict], kind: str) -> dict:
    found = by_kind(objects, kind)
    assert len(found) == 1, f"expected one {kind}, got {[o['metadata']['name'] for o in found]}"
    return found[0]


def grants(rules: list[dict]) -> set[tuple[str, str, str]]:
    """RBAC rules as the set of (apiGroup, resource, verb) they grant."""
    out = set()
    for rule in rules:
        assert not rule.get("resourceNames"), rule
        assert not rule.get("nonResourceURLs"), rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    out.add((group, resource, verb))
    return out


def operator_env(objects: list[dict]) -> dict[str, str]:
    container = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value") for e in container["env"]}


def kubeconfig_for(server: str) -> str:
    """A kubeconfig (JSON is YAML) for an emulated API server, with a bearer token."""
    return json.dumps({"apiVersion": "v1", "kind": "Config", "current-context": "e",
                       "clusters": [{"name": "e", "cluster": {"server": server}}],
                       "users": [{"name": "e", "user": {"token": "emulator-token"}}],
                       "contexts": [{"name": "e", "context": {"cluster": "e", "user": "e"}}]})
