"""The examples apply as they are: `kubectl apply -f examples/` gives objects whose references
(a Diagnosis's ProxyModel and CheckpointWatch, every Secret named) all resolve within the
examples, in the referring object's own namespace, and each object names its namespace (none
lands wherever the reader's kubectl context points)."""

from __future__ import annotations

from pathlib import Path

import yaml

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# keys whose value names a Secret in the object's namespace, wherever they appear
SECRET_KEYS = {"credentialsSecret"}
SECRET_REFS = {"secretKeyRef", "secretRef"}  # {name: ...} objects of a pod's env / envFrom


def objects() -> list[tuple[str, dict]]:
    """(file name, object) of every document in examples/*.yaml."""
    out = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        out += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return out


def _secrets(node) -> list[str]:
    found: list[str] = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in SECRET_KEYS and isinstance(value, str):
                found.append(value)
            elif key in SECRET_REFS and isinstance(value, dict) and value.get("name"):
                found.append(value["name"])
            elif key == "imagePullSecrets" and isinstance(value, list):
                found += [v["name"] for v in value if isinstance(v, dict) and v.get("name")]
            else:
                found += _secrets(value)
    elif isinstance(node, list):
        for item in node:
            found += _secrets(item)
    return found


def references(obj: dict) -> list[tuple[str, str]]:
    """(kind, name) of every object `obj` needs in its own namespace."""
    spec = obj.get("spec") or {}
    refs = [("Secret", name) for name in _secrets(spec)]
    if obj.get("kind") == "Diagnosis":
        if spec.get("proxyModel"):
            refs.append(("ProxyModel", spec["proxyModel"]))
        if (spec.get("checkpoints") or {}).get("watch"):
            refs.append(("CheckpointWatch", spec["checkpoints"]["watch"]))
    return refs


def unresolved(found: list[tuple[str, dict]]) -> list[str]:
    """What `kubectl apply` of these objects would leave dangling, one line each."""
    defined = {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for _, o in found}
    problems = []
    for where, o in found:
        namespace, name = o["metadata"].get("namespace"), o["metadata"]["name"]
        if not namespace:
            problems.append(f"{where}: {o['kind']} {name} names no namespace")
            continue
        problems += [f"{where}: {o['kind']} {namespace}/{name} refers to {kind} {ref}, which no example "
                     f"defines in {namespace}" for kind, ref in references(o) if (kind, namespace, ref) not in defined]
    return problems


def test_every_reference_of_the_examples_resolves_within_them():
    found = objects()
    assert {o["kind"] for _, o in found} >= {"ProxyModel", "CheckpointWatch", "Diagnosis", "Secret"}
    assert unresolved(found) == []
    # what this check finds: a dangling reference, or an object that names no namespace
    secret = {"kind": "Secret", "metadata": {"name": "s3-creds", "namespace": "rl-team"}}
    diagnosis = {"kind": "Diagnosis", "metadata": {"name": "d", "namespace": "default"},
                 "spec": {"proxyModel": "pm", "checkpoints": {"watch": "w", "source": {"credentialsSecret": "s3-creds"}}}}
    pod = {"kind": "ProxyModel", "metadata": {"name": "pm"}, "spec": {"reproduction": {"template": {"spec": {
        "containers": [{"env": [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "t"}}}]}]}}}}}
    assert unresolved([("s.yaml", secret), ("d.yaml", diagnosis), ("p.yaml", pod)]) == [
        "d.yaml: Diagnosis default/d refers to Secret s3-creds, which no example defines in default",
        "d.yaml: Diagnosis default/d refers to ProxyModel pm, which no example defines in default",
        "d.yaml: Diagnosis default/d refers to CheckpointWatch w, which no example defines in default",
        "p.yaml: ProxyModel pm names no namespace"]
    pod["metadata"]["namespace"] = "rl-team"
    assert unresolved([("s.yaml", secret), ("p.yaml", pod)]) == [
        "p.yaml: ProxyModel rl-team/pm refers to Secret hf, which no example defines in rl-team"]


def test_the_diagnosis_examples_refer_to_objects_of_the_examples():
    by_name = {where: o for where, o in objects()}
    assert references(by_name["diagnosis.yaml"]) == [("ProxyModel", "qwen3-30b-step1200")]
    assert references(by_name["diagnosis-bisect.yaml"]) == [("Secret", "s3-creds")]
