"""A Diagnosis's spec, read and checked beyond the CRD's schema (`parse_diagnosis`). What the
Diagnosis then does is diagnosis_matrix's (the decision), diagnosis_runs' (the runs) and
diagnosis_rows' (what status records of them).
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_proxy.errors import MoeProxyError
from moe_proxy.investigate.catalogue import CATALOGUE, pick
from moe_proxy.investigate.diagnose import BASELINE

from .spec import InvalidSpec, parse_fail_on


class InvalidDiagnosis(ValueError):
    """The Diagnosis's spec cannot run: `reason` for the Accepted condition, the message says why."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class CandidateSpec:
    """A candidate as spec.candidates gives it: a catalogue name, or the user's own flags/env."""

    name: str
    args: tuple[str, ...] | None = None  # None: the catalogue entry of that name
    env: tuple[dict, ...] = ()


@dataclass(frozen=True)
class DiagnosisSpec:
    proxy_model: str
    candidates: tuple[CandidateSpec, ...]
    fail_on: dict | None = None  # None: the ProxyModel's spec.reproduction.failOn
    seeds: int = 2
    parallelism: int = 1
    steps: int | None = None  # None: the ProxyModel's maxSteps


def _positive(spec: dict, key: str, default: int | None) -> int | None:
    value = spec.get(key, default)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidDiagnosis("InvalidSpec", f"spec.{key} {value!r}: a whole number, at least 1")
    return value


def parse_diagnosis(spec: dict) -> DiagnosisSpec:
    """spec as the CRD has it, checked beyond the schema; InvalidDiagnosis says what is wrong
    (an unknown candidate lists the catalogue)."""
    proxy_model = spec.get("proxyModel")
    if not isinstance(proxy_model, str) or not proxy_model:
        raise InvalidDiagnosis("InvalidSpec", "spec.proxyModel: the name of a ProxyModel in this namespace")
    raw = spec.get("candidates") or []
    if not isinstance(raw, list) or not raw:
        raise InvalidDiagnosis("InvalidSpec", "spec.candidates: at least one (catalogue names: "
                               f"{', '.join(CATALOGUE)}; or {{name, args: [repro flags]}})")
    candidates: list[CandidateSpec] = []
    for i, item in enumerate(raw):
        where = f"spec.candidates[{i}]"
        if isinstance(item, str):
            item = {"name": item}
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            raise InvalidDiagnosis("InvalidSpec", f"{where}: a catalogue name or {{name, args, env}}")
        args, env = item.get("args"), item.get("env") or []
        if args is not None and (not isinstance(args, list) or not args or not all(isinstance(a, str) for a in args)):
            raise InvalidDiagnosis("InvalidSpec", f"{where} ({item['name']}): args is a list of strings: repro flags "
                                   "(e.g. [--lr, 1e-6]), or with a template, the first container's extra args")
        if not isinstance(env, list) or not all(isinstance(e, dict) and e.get("name") for e in env):
            raise InvalidDiagnosis("InvalidSpec", f"{where} ({item['name']}): env is a list of {{name, value}}")
        if args is None and not env:
            try:
                pick([item["name"]])
            except MoeProxyError as exc:
                raise InvalidDiagnosis("UnknownCandidate", str(exc).replace(
                    "--candidate NAME=--flag value", "{name, args: [--flag, value]}")) from None
        candidates.append(CandidateSpec(item["name"], tuple(args) if args is not None else None,
                                        tuple(dict(e) for e in env)))
    names = [c.name for c in candidates]
    if dupes := sorted({n for n in names if names.count(n) > 1} | ({BASELINE} & set(names))):
        raise InvalidDiagnosis("InvalidSpec", f"candidate name(s) {', '.join(map(repr, dupes))}: used twice "
                               "(or reserved)")
    fail_on = spec.get("failOn")
    if fail_on is not None:
        try:
            parse_fail_on(fail_on, "spec.failOn")
        except InvalidSpec as exc:
            raise InvalidDiagnosis("InvalidSpec", str(exc)) from None
    return DiagnosisSpec(proxy_model, tuple(candidates), fail_on, _positive(spec, "seeds", 2),
                         _positive(spec, "parallelism", 1), _positive(spec, "steps", None))
