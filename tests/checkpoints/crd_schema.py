"""Validate objects against a CRD's structural schema the way the API server would: the
OpenAPI schema as JSON Schema (with strict field validation: unknown fields are errors, as
`kubectl apply` reports them), defaults left out, and the x-kubernetes-validations CEL
rules evaluated with cel-python."""

from __future__ import annotations

from pathlib import Path

import celpy
import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[2]


def load_crd(name: str) -> dict:
    return yaml.safe_load((ROOT / "crds" / f"{name}.yaml").read_text())


def openapi(crd: dict, version: str = "v1alpha1") -> dict:
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            return v["schema"]["openAPIV3Schema"]
    raise KeyError(version)


def to_json_schema(node: dict) -> dict:
    """One OpenAPI v3 (Kubernetes structural) schema node as JSON Schema."""
    out: dict = {}
    for key, value in node.items():
        if key == "properties":
            out["properties"] = {k: to_json_schema(v) for k, v in value.items()}
        elif key == "items":
            out["items"] = to_json_schema(value)
        elif key == "additionalProperties" and isinstance(value, dict):
            out["additionalProperties"] = to_json_schema(value)
        elif key in ("type", "required", "enum", "pattern", "minimum", "maximum", "maxLength", "minLength",
                     "maxItems", "minItems", "format"):
            out[key] = value
        elif key == "exclusiveMinimum" and value is True:
            out["exclusiveMinimum"] = node["minimum"]
            out.pop("minimum", None)
    if node.get("x-kubernetes-int-or-string"):
        out["type"] = ["integer", "string"]
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"] if isinstance(out["type"], str) else [*out["type"], "null"]
    if node.get("type") == "object" and "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields") \
            and "additionalProperties" not in node:
        out["additionalProperties"] = False
    if "minimum" in out and "exclusiveMinimum" in out:
        out.pop("minimum")
    return out


def cel_errors(node: dict, value, path: str = "") -> list[str]:
    """The messages of every x-kubernetes-validations rule that `value` breaks."""
    errors = []
    env = celpy.Environment()
    for rule in node.get("x-kubernetes-validations", []):
        program = env.program(env.compile(rule["rule"]))
        if not bool(program.evaluate({"self": celpy.json_to_cel(value)})):
            errors.append(f"{path or '.'}: {rule.get('message', rule['rule'])}")
    if isinstance(value, dict):
        for key, child in (node.get("properties") or {}).items():
            if key in value:
                errors += cel_errors(child, value[key], f"{path}.{key}")
    if isinstance(value, list) and "items" in node:
        for i, item in enumerate(value):
            errors += cel_errors(node["items"], item, f"{path}[{i}]")
    return errors


def errors(crd: dict, obj: dict) -> list[str]:
    """Why the API server would reject `obj` (empty: it would accept it)."""
    schema = openapi(crd)
    validator = jsonschema.Draft7Validator(to_json_schema(schema))
    found = [f"{'.'.join(str(p) for p in e.absolute_path) or '.'}: {e.message}" for e in validator.iter_errors(obj)]
    if found:
        return found
    return cel_errors(schema, obj)
