"""How an operator resource's spec fields are declared once, in the dataclass the operator reads
them into, and how a CRD's schema is generated from that declaration (charts/generate_crds.py
writes crds/ with it; tests/chart fails when a file is stale).

A scalar field is an option, as in moe_proxy.options (`option(..., crd="name")`: type, default,
range and enum, read and checked by `from_crd`). A field whose schema is more than that (an
object, a list, a ProxyModel template) is a `crd_field`: its schema as written here, checked by
the spec's parser.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from moe_proxy.options import crd_properties


@dataclass(frozen=True)
class CrdField:
    """A spec field that is no option: its CRD name, description and schema."""

    crd: str
    help: str
    schema: dict


def crd_field(crd: str, help: str, schema: dict, default: Any = MISSING) -> Any:
    return field(default=default, metadata={"crd_field": CrdField(crd, help, schema)})


def properties(cls, helps: dict[str, str] | None = None, only: tuple[str, ...] | None = None) -> dict[str, dict]:
    """The CRD properties of a model's declared fields, in declaration order (`only`: these CRD
    names; `helps`: descriptions by CRD name, where a resource says it in its own words)."""
    options, props = crd_properties(cls), {}
    for f in fields(cls):
        if "option" in f.metadata and f.metadata["option"].crd:
            props[f.metadata["option"].crd] = options[f.metadata["option"].crd]
        elif "crd_field" in f.metadata:
            declared: CrdField = f.metadata["crd_field"]
            typed = {"type": declared.schema["type"]} if "type" in declared.schema else {}
            props[declared.crd] = typed | {"description": declared.help} | declared.schema
    if only is not None:
        props = {name: props[name] for name in only}
    for name, text in (helps or {}).items():
        props[name] = props[name] | {"description": text}
    return props


def crd_names(cls) -> list[str]:
    """The CRD names of a model's declared fields."""
    return list(properties(cls))


def object_schema(cls, required: tuple[str, ...] = (), rules: tuple[tuple[str, str], ...] = (),
                  helps: dict[str, str] | None = None) -> dict:
    """An object field whose fields are `cls`'s; `rules`: (CEL rule, message) the API server checks."""
    schema: dict = {"type": "object"}
    if required:
        schema["required"] = list(required)
    if rules:
        schema["x-kubernetes-validations"] = [{"rule": rule, "message": message} for rule, message in rules]
    return schema | {"properties": properties(cls, helps)}


def without_empty(raw: dict) -> dict:
    """A spec with its empty strings dropped: the operator has always read "" as absent."""
    return {k: v for k, v in raw.items() if v != ""}
