"""The runs of a Diagnosis: the baseline its ProxyModel gives (`baseline_of`), the variants run
against it (the baseline, then each candidate), and each run's name, args and manifest. Pure
functions; diagnosis_matrix decides when a run starts.

Every run is one reproduction workload of the planned size (`reproduction.reproduction_workload`,
the builder the ProxyModel's own reproduction uses): the baseline's container arguments plus the
variant's repro flags, on one seed.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace

from moe_proxy.errors import MoeProxyError
from moe_proxy.investigate.catalogue import CATALOGUE
from moe_proxy.investigate.diagnose import BASELINE, OWN_FLAGS, changed_settings, repro_config

from .children import MAX_NAME
from .diagnosis_baseline import pin
from .diagnosis_rows import plan_price
from .diagnosis_spec import DiagnosisSpec, InvalidDiagnosis
from .reproduction import (ArgsIgnored, Naming, appended, first_container, headless_service, name_reserve,
                           repro_flags, reproduction_workload)
from .resources import GROUP, LABEL_CHILD, LABEL_ROLE, Resource
from .runtimes import RUNTIMES
from .settings import Settings
from .spec import InvalidSpec, parse, parse_fail_on
from .spec_types import ProxyModelSpec
from .status import NOT_REPRODUCED, PROXY_READY, PROXY_READY_CONDITION, REPRODUCED, REPRODUCING

LABEL_DIAGNOSIS = f"{GROUP}/diagnosis"  # the Diagnosis a run belongs to (on the workload and its pods)
LABEL_VARIANT = f"{GROUP}/variant"  # baseline or the candidate's name
LABEL_SEED = f"{GROUP}/seed"
DIAGNOSIS_ROLE = "diagnosis"  # the runs' moeproxy.io/role
SEED_ENV = "MOEPROXY_SEED"  # every run's seed, in its first container's env
# A ProxyModel whose proxy is built.
PROXY_BUILT_PHASES = (PROXY_READY, REPRODUCING, REPRODUCED, NOT_REPRODUCED)


# --- the baseline: what the ProxyModel says ---------------------------------------------------------


@dataclass(frozen=True)
class RunVariant:
    """A row of the matrix: the baseline or a candidate, with what its runs add to the baseline's."""

    name: str
    args: tuple[str, ...]  # repro flags after the baseline's
    env: tuple[dict, ...] = ()
    what: str = ""


@dataclass(frozen=True)
class Baseline:
    """The ProxyModel's reproduction as the Diagnosis runs it (its steps and failOn in place)."""

    spec: ProxyModelSpec
    proxy_uri: str
    manifest_sha256: str
    devices: int
    experts_per_layer: int | None
    top_k: int | None
    pinned: dict = field(default_factory=dict)  # what status.proxyModel records of it (diagnosis_baseline.pin)
    price: dict = field(default_factory=dict)  # what its runs are priced by (diagnosis_rows.plan_price)

    @property
    def steps(self) -> int:
        return self.spec.reproduction.max_steps

    @property
    def seeds_from(self) -> int:
        return self.spec.reproduction.config.seed


class NotYet(Exception):
    """The ProxyModel cannot give a baseline yet (missing, or its proxy is not built): `reason`."""

    def __init__(self, reason: str, message: str, failed: bool = False):
        super().__init__(message)
        self.reason, self.failed = reason, failed


def proxy_built(proxymodel: dict) -> bool:
    """Its proxy is built for its current spec: status.proxy, and the ProxyReady condition True
    (also when its own reproduction failed afterwards) or a phase after the build."""
    status = proxymodel.get("status") or {}
    if not (status.get("proxy") or {}).get("uri"):
        return False
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == PROXY_READY_CONDITION), {})
    return ready.get("status") == "True" or status.get("phase") in PROXY_BUILT_PHASES


def baseline_of(d: DiagnosisSpec, proxymodel: dict | None, namespace: str, settings: Settings) -> Baseline:
    """The baseline from the ProxyModel; NotYet while it cannot be (failed=True: it never will be,
    for this spec), InvalidDiagnosis when the pair cannot run."""
    if proxymodel is None:
        raise NotYet("ProxyModelNotFound", f"ProxyModel {d.proxy_model} does not exist in {namespace}")
    status = proxymodel.get("status") or {}
    try:
        spec = parse(dict(proxymodel.get("spec") or {}), namespace, d.proxy_model, settings)
    except InvalidSpec as exc:
        raise NotYet("ProxyModelRefused", f"ProxyModel {d.proxy_model} is refused: {exc}", failed=True) from None
    r = spec.reproduction
    if r.template is not None and (catalogue := [c.name for c in d.candidates if c.args is None and not c.env]):
        knobs = "; ".join(f"{n}: {CATALOGUE[n].knobs}" for n in catalogue)
        raise InvalidDiagnosis("TemplateNeedsPatches", f"ProxyModel {d.proxy_model} runs its own framework "
                               f"(spec.reproduction.template): the catalogue's {', '.join(catalogue)} are moe-proxy "
                               "repro flags; give {name, env, args} patches of its first container instead "
                               f"(where frameworks set them: {knobs})")
    for v in (RunVariant(BASELINE, ()), *(RunVariant(c.name, c.args) for c in d.candidates if c.args)):
        args_reach(spec, v)  # a catalogue entry's flags go where the baseline's --seed goes
    if not proxy_built(proxymodel):
        if status.get("phase") == "Failed" and not status.get("proxy"):
            raise NotYet("ProxyModelFailed", f"ProxyModel {d.proxy_model} failed before its proxy was built: "
                         f"{status.get('message') or 'see its conditions'}", failed=True)
        raise NotYet("WaitingForProxy", f"ProxyModel {d.proxy_model} is {status.get('phase') or 'Pending'}: "
                     "waiting for its proxy to be built")
    fail_on = parse_fail_on(d.fail_on, "spec.failOn") if d.fail_on is not None else r.fail_on
    if fail_on is None:
        raise InvalidDiagnosis("InvalidSpec", f"no failure to judge: ProxyModel {d.proxy_model} has no "
                               "spec.reproduction.failOn, and spec.failOn is not set")
    config = replace(r.config, steps=d.steps) if d.steps else r.config
    spec = replace(spec, reproduction=replace(r, config=config, fail_on=fail_on),
                   queue_name=d.queue_name or spec.queue_name)
    devices = r.accelerator.devices or ((status.get("plan") or {}).get("proxy") or {}).get("devices")
    if not devices:
        raise NotYet("ProxyModelRefused", f"ProxyModel {d.proxy_model} has no planned device count", failed=True)
    proxy = status["proxy"]
    experts = proxy.get("expertsPerLayer") or {}
    return Baseline(spec, proxy["uri"], proxy.get("manifestSha256") or "", int(devices), experts.get("after"),
                    experts.get("topK"), pin(proxymodel), plan_price(proxymodel))


def variants(d: DiagnosisSpec, baseline: Baseline) -> list[RunVariant]:
    """The baseline first, then each candidate with its repro flags (a catalogue entry's may
    depend on the baseline's settings: lr / 10, a quarter of the steps)."""
    out = [RunVariant(BASELINE, (), (), "the failing run, as the ProxyModel's reproduction")]
    for c in d.candidates:
        if c.args is None and c.name in CATALOGUE and not c.env:
            fix = CATALOGUE[c.name]
            out.append(RunVariant(c.name, tuple(fix.changes(baseline.spec.reproduction.config)), (), fix.what))
        else:
            out.append(RunVariant(c.name, tuple(c.args or ()), c.env, "custom: " + " ".join(c.args or ())))
    return out


def changes(baseline: Baseline, v: RunVariant) -> dict:
    """The repro settings a variant changes from the baseline's, as `moe-proxy repro`'s own parser
    reads the runs' flags (as `moe-proxy diagnose` checks them, before anything runs). Flags repro
    refuses raise InvalidDiagnosis naming the candidate. A ProxyModel with a template (its own
    framework) or its own container args (spec.reproduction.workload.args) is not checked:
    {"unchecked": true}."""
    spec = baseline.spec
    if spec.reproduction.template is not None or spec.reproduction.workload.args:
        return {"unchecked": True}
    if v.args and not v.args[0].startswith("--"):
        raise InvalidDiagnosis("CandidateRefused", f"candidate {v.name!r}: args are repro flags, e.g. [--lr, 1e-6]")
    if own := [a for a in v.args if a.split("=")[0] in OWN_FLAGS]:
        raise InvalidDiagnosis("CandidateRefused", f"candidate {v.name!r}: {', '.join(own)} are the diagnosis's own "
                               "(it sets the seed, the failure and where runs write)")
    flags = repro_flags(spec)
    try:
        base = repro_config(flags)
        mine = repro_config([*flags, *v.args])
    except MoeProxyError as exc:
        raise InvalidDiagnosis("CandidateRefused", f"candidate {v.name!r} ({' '.join(v.args)}): repro refuses it: "
                               f"{exc}") from None
    return changed_settings(base, mine)  # as the CLI: a change that changes nothing in the run is none


# --- names, args and manifests ------------------------------------------------------------------------


def run_name(diagnosis: str, variant: str, seed: int, reserve: int = 0) -> str:
    """`<diagnosis>-<variant>-s<seed>`, DNS-safe, cut to 63 characters (less `reserve`, for the
    pods' host names) with a hash of the whole to keep it unique."""
    base = "".join(ch if ch.isalnum() else "-" for ch in f"{diagnosis}-{variant}".lower()).strip("-")
    suffix, limit = f"-s{seed}", MAX_NAME - reserve
    if len(base) + len(suffix) <= limit and base == f"{diagnosis}-{variant}":
        return base + suffix
    digest = hashlib.sha256(f"{diagnosis}/{variant}".encode()).hexdigest()[:6]
    return f"{base[: limit - len(suffix) - 7].rstrip('-')}-{digest}{suffix}"


def run_args(spec: ProxyModelSpec, variant: RunVariant, seed: int) -> tuple[str, ...]:
    """What a run adds to its first container's args: the variant's, then `--seed S`. A user's
    framework gets the seed as MOEPROXY_SEED only (its command may pass $(MOEPROXY_SEED) on)."""
    return (*variant.args, *(("--seed", str(seed)) if spec.reproduction.template is None else ()))


def args_reach(spec: ProxyModelSpec, v: RunVariant) -> None:
    """Admission (before the proxy is built): what the variant's runs add to the first container's
    args reaches the command it runs (reproduction.appended); else InvalidDiagnosis,
    CandidateArgsIgnored, with the reason."""
    args = run_args(spec, v, spec.reproduction.config.seed)
    try:
        appended(first_container(spec), args)
    except ArgsIgnored as exc:
        who = f"candidate {v.name!r}" if v.name != BASELINE else "every run"
        raise InvalidDiagnosis("CandidateArgsIgnored", f"{who} adds {' '.join(args)} to the args of the first "
                               f"container of the ProxyModel's reproduction, but {exc}") from None


def run_manifest(diagnosis: str, namespace: str, generation: int, baseline: Baseline, variant: RunVariant,
                 seed: int, proxymodel: str) -> tuple[Resource, dict, dict | None]:
    """(resource, workload, headless Service or None) of one run: the ProxyModel's reproduction
    with the variant's flags and `--seed` after its own arguments (a template's first container:
    the variant's args after its own, its env over the operator's, MOEPROXY_SEED)."""
    spec = baseline.spec
    name = run_name(diagnosis, variant.name, seed, name_reserve(spec, baseline.devices))
    labels = {LABEL_DIAGNOSIS: diagnosis, LABEL_ROLE: DIAGNOSIS_ROLE, LABEL_CHILD: name,
              LABEL_VARIANT: variant.name[:63], LABEL_SEED: str(seed)}
    env = ({"name": SEED_ENV, "value": str(seed)}, *variant.env)
    naming = Naming(name, labels, run_args(spec, variant, seed), env)
    manifest = reproduction_workload(proxymodel, namespace, generation, spec, baseline.proxy_uri,
                                     baseline.manifest_sha256, baseline.devices, baseline.experts_per_layer,
                                     baseline.top_k, naming=naming)
    runtime = RUNTIMES[spec.reproduction.runtime]
    return runtime.resource, manifest, headless_service(runtime, manifest)
