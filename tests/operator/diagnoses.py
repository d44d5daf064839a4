"""What the Diagnosis tests share: an operator that serves Diagnoses, and a Diagnosis's status."""

from __future__ import annotations

import kopf

from proxymodel_operator import diagnosis
from proxymodel_operator.resources import DIAGNOSES

from .harness import Api, registry_copy


def with_diagnoses(tick: float) -> kopf.OperatorRegistry:
    """The ProxyModel handlers and the Diagnosis timer, every `tick` seconds."""
    registry = registry_copy()
    diagnosis.register(tick, registry)
    return registry


def diagnosis_status(cluster: Api, namespace: str, name: str) -> dict:
    return (cluster.get(DIAGNOSES, namespace, name) or {}).get("status") or {}
