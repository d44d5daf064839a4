"""A Diagnosis's spec, read into dataclasses. DiagnosisSpec (a candidate matrix) and BisectSpec
(spec.checkpoints: a bisection) declare every field of the CRD's spec once (crd_fields): the
schema of crds/diagnoses.moeproxy.io.yaml is generated from them, and parse_diagnosis and
parse_bisection read each field's type, default and range from them. The candidates' catalogue
names come from moe_proxy.investigate.catalogue, the failOn signatures from the detectors.

The schema rejects what a schema can; what it cannot (an unknown candidate, a name used twice,
a failOn the detector does not know) is checked here and InvalidDiagnosis says which field.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_proxy.errors import InvalidOptions, MoeProxyError
from moe_proxy.investigate.catalogue import CATALOGUE, pick
from moe_proxy.investigate.diagnose import BASELINE
from moe_proxy.options import from_crd, option

from .crd_fields import crd_field, object_schema, properties, without_empty
from .shared_fields import NAME, fail_on_schema, source_schema, template_schema
from .spec import InvalidSpec, parse_fail_on
from .watch_spec import WatchSpec


class InvalidDiagnosis(ValueError):
    """The Diagnosis's spec cannot run: `reason` for the Accepted condition, the message says why."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


# --- a bisection: spec.checkpoints ---------------------------------------------------------------

INLINE = ("source", "template", "pattern", "stepRegex")  # a CheckpointWatch's fields, written in the Diagnosis


@dataclass(frozen=True)
class BisectSpec:
    """spec.checkpoints: a CheckpointWatch's name, or a watch's own fields (source, template,
    pattern, stepRegex) inline; the range; the failure and the steps of each probe's run."""

    watch: str | None = option(None, "str", "a CheckpointWatch in this namespace", crd="watch", crd_schema=NAME)
    inline: dict | None = None  # INLINE as written: declared by WatchSpec, as a CheckpointWatch has them
    good: int | None = option(None, "int", "a step known clean: the search starts there (probed, to confirm)",
                              crd="good", minimum=0)
    bad: int | None = option(None, "int", "a step known to reproduce: the search ends there", crd="bad", minimum=0)
    fail_on: dict | None = None  # the spec's failOn (DiagnosisSpec's); None: the template's spec.reproduction.failOn
    steps: int | None = None  # the spec's steps (DiagnosisSpec's); None: the template's maxSteps
    candidates: tuple = ()  # the spec's candidates: tried on the first bad probe's ProxyModel (candidates_spec)
    parallelism: int = 1  # the spec's parallelism (DiagnosisSpec's): probes a round


def _inline_fields() -> dict[str, dict]:
    """INLINE's schema: WatchSpec's fields, said of a bisection's probes."""
    watch = properties(WatchSpec, only=INLINE, helps={
        "pattern": "checkpoint directories relative to source.uri, as a glob (as in moe-proxy checkpoints)",
        "stepRegex": "the step in a checkpoint's relative path (as in moe-proxy checkpoints)"})
    source = source_schema("s3://bucket/prefix of the training run", "Secret in this namespace with "
                           "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (read to list the prefix; the ProxyModels get it "
                           "by name)", endpoint="S3 endpoint URL (default the operator's, else AWS)")
    template = template_schema(None, "the probes' source is spec.checkpoints.source with each checkpoint's URI")
    return watch | {
        "source": {"type": "object", "description": "the run's prefix, as a CheckpointWatch's spec.source; each "
                   "probe's ProxyModel gets it with its checkpoint's URI"} | source,
        "template": {"type": "object", "description": "the probes' ProxyModels, less the source, as a "
                     "CheckpointWatch's spec.template; spec.reproduction gives each probe's run (its own "
                     "reproduction is turned off: the Diagnosis runs it)"} | template}


def _checkpoints_schema() -> dict:
    schema = object_schema(BisectSpec, rules=(
        ("has(self.watch) != has(self.source)", "a CheckpointWatch (watch) or a prefix (source with template), not both"),
        ("has(self.source) == has(self.template)", "a prefix (source) needs a ProxyModel template"),
        ("!has(self.good) || !has(self.bad) || self.good < self.bad", "good comes before bad")))
    own = schema["properties"]
    schema["properties"] = {"watch": own["watch"], **_inline_fields(), "good": own["good"], "bad": own["bad"]}
    return schema


# --- the spec -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CandidateSpec:
    """A candidate as spec.candidates gives it: a catalogue name, or the user's own flags/env."""

    name: str
    args: tuple[str, ...] | None = None  # None: the catalogue entry of that name
    env: tuple[dict, ...] = ()


CANDIDATES = {"type": "array", "minItems": 1, "maxItems": 32, "items": {
    "x-kubernetes-preserve-unknown-fields": True,
    "x-kubernetes-validations": [{"rule": "type(self) == string || (type(self) == map && 'name' in self)",
                                  "message": "a catalogue name, or an object with a name"}]}}


@dataclass(frozen=True)
class DiagnosisSpec:
    """A Diagnosis's spec: a candidate matrix (proxyModel with candidates) or a bisection (checkpoints)."""

    proxy_model: str | None = option(None, "str", "A ProxyModel in this namespace (with candidates). The diagnosis "
                                     "waits until its proxy is built and runs its reproduction (plan, runtime, RL "
                                     "settings) as the baseline.", crd="proxyModel", crd_schema=NAME)
    candidates: tuple[CandidateSpec, ...] = crd_field(
        "candidates", f"Candidate fixes: a name from moe-proxy's catalogue ({', '.join(CATALOGUE)}; "
        "docs/diagnosis.md), or your own {name, args: [repro flags], env: [container env]}; for a ProxyModel with "
        "spec.reproduction.template, {name, env, args} patches of its first container only. With spec.checkpoints: "
        "tried once the bisection found the first bad checkpoint, on that probe's ProxyModel (its proxy is not built "
        "again).", CANDIDATES, ())
    fail_on: dict | None = crd_field("failOn", "the failure to judge; default the ProxyModel's (or the template's) "
                                     "spec.reproduction.failOn", fail_on_schema(), None)
    seeds: int = option(2, "int", "seeds per variant, from the ProxyModel's reproduction seed on (a bisection runs "
                        "one per probe, on the template's seed)", crd="seeds", minimum=1, maximum=16)
    parallelism: int = option(1, "int", "how many runs (each a full reproduction workload) at once; a bisection "
                              "probes this many checkpoints a round (each a ProxyModel and its run), the range left "
                              "cut in parallelism + 1 parts", crd="parallelism", minimum=1, maximum=64)
    all_seeds: bool = option(False, "bool", "run every seed of every candidate (the full matrix). By default a "
                             "candidate that reproduced on one seed is reproduced whatever its other seeds do: its "
                             "pending runs are not started and its running ones deleted", crd="allSeeds")
    steps: int | None = option(None, "int", "RL steps per run; default the ProxyModel's (or the template's) "
                               "spec.reproduction.maxSteps", crd="steps", minimum=1)
    queue_name: str | None = option(None, "str", "Kueue LocalQueue of the runs' workloads (and a bisection's "
                                    "builds): label kueue.x-k8s.io/queue-name, created suspended for Kueue to admit; "
                                    "default the ProxyModel's (or the template's) spec.queueName", crd="queueName",
                                    crd_schema=NAME)
    checkpoints: BisectSpec | None = crd_field(
        "checkpoints", "A bisection (moe-proxy bisect): the earliest checkpoint of a training run whose proxy "
        "reproduces spec.failOn, in O(log n) probes, spec.parallelism of them a round (the range left cut in "
        "parallelism + 1 parts). Either `watch` (a CheckpointWatch in this namespace: its source, pattern, stepRegex and ProxyModel template) or `source` with `template` (and "
        "optionally pattern, stepRegex) written here. The complete checkpoints are listed once (as moe-proxy "
        "checkpoints lists them).", _checkpoints_schema(), None)


def read_spec(spec: dict, **parsed) -> DiagnosisSpec:
    """The spec's scalar fields (proxyModel, seeds, parallelism, steps) as DiagnosisSpec declares
    them, checked, defaults applied; `parsed`: its other fields, already checked."""
    try:
        return from_crd(DiagnosisSpec, without_empty(spec), "spec", **parsed)
    except InvalidOptions as exc:
        raise InvalidDiagnosis("InvalidSpec", str(exc)) from None


def _fail_on(spec: dict) -> dict | None:
    fail_on = spec.get("failOn")
    if fail_on is not None:
        try:
            parse_fail_on(fail_on, "spec.failOn")
        except InvalidSpec as exc:
            raise InvalidDiagnosis("InvalidSpec", str(exc)) from None
    return fail_on


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
    return read_spec(spec, candidates=tuple(candidates), fail_on=_fail_on(spec))


def parse_bisection(spec: dict) -> BisectSpec:
    """spec as the CRD has it, checked beyond the schema (InvalidDiagnosis says what is wrong)."""
    raw = spec.get("checkpoints")
    if spec.get("proxyModel"):
        raise InvalidDiagnosis("InvalidSpec", "spec.checkpoints asks for a bisection; spec.proxyModel asks for a "
                               "candidate matrix on a ProxyModel: give one or the other")
    candidates = parse_diagnosis(candidates_spec(spec, "probe")).candidates if spec.get("candidates") else ()
    usage = ("spec.checkpoints: {watch: a CheckpointWatch in this namespace} or {source: {uri: s3://run-prefix}, "
             "template: {spec: a ProxyModel spec without source}}")
    if not isinstance(raw, dict):
        raise InvalidDiagnosis("InvalidSpec", usage)
    watch = raw.get("watch")
    inline = {k: raw[k] for k in INLINE if raw.get(k) is not None}
    if watch is not None and (not isinstance(watch, str) or not watch or inline):
        raise InvalidDiagnosis("InvalidSpec", f"{usage}, not both")
    if watch is None and not (inline.get("source") and inline.get("template")):
        raise InvalidDiagnosis("InvalidSpec", usage)
    try:
        b = from_crd(BisectSpec, {k: raw.get(k) for k in ("good", "bad")}, "spec.checkpoints", watch=watch,
                     inline=inline or None)
    except InvalidOptions as exc:
        raise InvalidDiagnosis("InvalidSpec", str(exc)) from None
    if b.good is not None and b.bad is not None and b.good >= b.bad:
        raise InvalidDiagnosis("InvalidSpec", f"spec.checkpoints: good {b.good} must come before bad {b.bad}")
    fail_on = _fail_on(spec)
    scalars = read_spec({"steps": spec.get("steps"), "parallelism": spec.get("parallelism")})  # (seeds: the matrix's)
    return BisectSpec(watch, inline or None, b.good, b.bad, fail_on, scalars.steps, candidates, scalars.parallelism)


def candidates_spec(spec: dict, proxy_model: str) -> dict:
    """A bisection's candidates as a matrix Diagnosis's spec on `proxy_model` (the first bad
    probe's ProxyModel): its candidates, failOn, seeds, parallelism, allSeeds and steps."""
    return {"proxyModel": proxy_model, **{k: spec[k] for k in ("candidates", "failOn", "seeds", "parallelism",
                                                                "allSeeds", "steps") if spec.get(k) is not None}}
