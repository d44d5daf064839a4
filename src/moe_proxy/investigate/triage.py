"""`moe-proxy triage`: the closed loop on one machine, from a failing training run to an answer.

Top-down, one step feeding the next:
1. detect: the original run's own metrics (any format metrics/readers.py reads, finished or still
   growing: what is complete now), judged by the operator's watched-run rule itself
   (metrics.incident.RunWatcher: the detectors of repro and watch, metrics/detect.py): the failure
   is the earliest onset of the one asked for or of a NaN (a NaN is never a clean log; a NaN first
   is what the loop investigates, on `nan`, and the answer says the other was not seen before
   it). No failure: nothing is built, and the report says so.
2. bisect: the run's complete checkpoints up to the failing step (investigate/bisect.py's own
   bisect(), into DIR/bisect): the first checkpoint whose proxy reproduces the failure.
3. diagnose: on that probe's proxy (the bisection's own, never built again), the candidates the
   catalogue names for the signature (catalogue.suggested) or the ones given, into DIR/diagnose.
4. report: DIR/report.json and report.md (the answer first), the pictures (the original's
   metrics with the failing step marked, diagnose's matrix and curves) and what the loop cost:
   builds, probes, runs and device-hours by the one run-cost rule (sizing.run_device_hours, as
   bisect's report prices its probes) against one step of the original by the same model.

A rerun resumes: bisect and diagnose reuse their records in DIR/bisect and DIR/diagnose (a rerun
of the same command builds and runs nothing), and DIR holds one triage (processes.claim_out).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from moe_proxy.errors import MalformedMetrics, MoeProxyError, TooFewCheckpoints
from moe_proxy.investigate.bisect import ProbeSettings, bisect, sources
from moe_proxy.investigate.catalogue import Fix, pick, suggested
from moe_proxy.investigate.diagnose import OWN_FLAGS, changed_settings, diagnose, repro_config
from moe_proxy.investigate.processes import claim_out
from moe_proxy.metrics.detect import Signature
from moe_proxy.metrics.incident import RunWatcher
from moe_proxy.metrics.readers import ReadOptions

log = logging.getLogger(__name__)

# What a triage writes in its --out (claim_out; --replace deletes these).
TRIAGE_OUTPUTS = ("bisect", "diagnose", "report.json", "report.md", "original.png", "matrix.png", "curves.png")
# report.json's `state`: how far the loop got.
(STATE_NO_FAILURE, STATE_BEFORE_CHECKPOINTS, STATE_NOT_REPRODUCED, STATE_NOT_CURED, STATE_DIAGNOSED) = (
    "no-failure", "before-first-checkpoint", "not-reproduced", "baseline-not-reproduced", "diagnosed")
ORIGINAL_PLOT_METRICS = 6  # panels in original.png


@dataclass(frozen=True)
class TriageSettings:
    """What a triage is asked: the original run's metrics and checkpoints, the failure, how each
    probe is made (bisect's ProbeSettings: build, calibration and repro flags, seeds, --fail-on),
    the candidates (None: the catalogue's for the signature) and how the metrics are read."""

    metrics: str
    prefix: str
    probe: ProbeSettings
    candidates: list[Fix] | None = None
    pattern: str | None = None
    step_regex: str | None = None
    read: ReadOptions = field(default_factory=ReadOptions)
    parallel: int = 1  # bisect's probes a round, diagnose's runs at a time
    all_seeds: bool = False  # diagnose: every seed of a candidate that reproduced on one

    def recorded(self) -> dict:
        """What makes a triage (claim_out): another one into the same --out is refused."""
        return {"METRICS": self.metrics, "CHECKPOINTS": self.prefix, "--pattern": self.pattern,
                "--step-regex": self.step_regex, "read": asdict(self.read), **asdict(self.probe)}


@dataclass
class Detection:
    """What the original's metrics say: the failure the loop investigates (`signature`: the one
    asked for, or `nan` when a NaN came before any of it: metrics.incident's rule, a NaN is never
    a clean log), its onset (failing_step None: no failure in the log), the detector's line, the
    steps read and the failures seen besides, up to the failure's detection."""

    asked: str  # --fail-on, as Signature.parse names it
    signature: str
    failing_step: int | None
    detail: str
    steps_read: int
    last_step: int | None
    also_seen: dict[str, int] = field(default_factory=dict)
    unjudged: str | None = None  # why the log cannot show the failure asked for (its metrics lack it), or None
    rows: dict[int, dict[str, float]] = field(default_factory=dict, repr=False)

    @property
    def instead(self) -> bool:
        """A NaN came first: the loop investigates it, not the failure asked for."""
        return self.signature != self.asked

    def what(self) -> str:
        """The failure in words: "overflow", or "nan (no overflow before it)"."""
        return f"{self.signature} (no {self.asked} before it)" if self.instead else self.signature

    def as_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "rows"}


# --- 1. detect ---------------------------------------------------------------------------------


def detect(metrics: str, fail_on: str, read: ReadOptions | None = None, store_options: dict | None = None) -> Detection:
    """The original's complete steps (as watch reads them: a JSON line still being written waits
    for a later call; a TensorBoard log's newest step is taken) judged by the operator's
    watched-run rule, metrics.incident.RunWatcher: the earliest onset of `fail_on` or of a NaN.
    `metrics`: a local path or an s3:// location (`store_options`: storage.open_store's keyword
    arguments)."""
    asked = Signature.parse(fail_on)
    watcher = RunWatcher(metrics, [fail_on], read, store_options, keep_rows=True)
    failure = watcher.poll(newest=True)
    rows = watcher.rows
    if not rows:
        raise MalformedMetrics(f"{metrics}: no steps logged (or no such file or directory)")
    # the failures seen besides, up to the failure's detection (after a NaN, steps mean nothing)
    upto = max(rows) if failure is None else _seen(failure)
    others = {name: o.step for name, o in watcher.detector.onsets.items()
              if (failure is None or name != failure.signature) and _seen(o) <= upto}
    return Detection(asked.name, failure.signature if failure else asked.name, failure.step if failure else None,
                     failure.reason if failure else "", len(rows), max(rows), others, unjudged(asked, rows),
                     dict(sorted(rows.items())))


def _seen(onset) -> int:
    """The step a detection completed at (an Onset's or a RunFailure's `seen`; None: its onset)."""
    return onset.step if onset.seen is None else onset.seen


def unjudged(signature: Signature, rows: dict[int, dict[str, float]]) -> str | None:
    """Why these metrics cannot show the failure asked for (profiles.coverage: none of the roles
    it is judged by is logged; a threshold's metric is not logged), or None."""
    from moe_proxy.metrics.profiles import coverage

    names = set().union(*rows.values())
    if signature.metric:
        return None if signature.metric in names else f"{signature.metric} is not in the log"
    return coverage(names)[1].get(signature.name)


# --- 2. bisect ---------------------------------------------------------------------------------


def before_failure(s: TriageSettings, failing_step: int, store_options: dict | None = None) -> list:
    """The run's complete checkpoints at or before the failing step ([] when there is none)."""
    try:
        listed = sources(s.prefix, s.pattern, s.step_regex, None, None, store_options)
    except TooFewCheckpoints:  # 0 or 1 in the whole run: list them without bisect's minimum
        from moe_proxy.checkpoint.listing import list_checkpoints

        listed = [c for c in list_checkpoints(s.prefix, s.pattern, s.step_regex, **(store_options or {}))
                  if c.source and c.complete and c.step is not None]
    return [c for c in listed if c.step <= failing_step]


def probe_proxy(bisect_out: Path, step: int) -> Path:
    """The proxy the bisection built for its probe of `step` (probes/step-<N>/proxy), checked
    complete: the diagnosis runs on it, never on a proxy built again."""
    from moe_proxy.checkpoint.reader import MANIFEST

    proxy = bisect_out / "probes" / f"step-{step}" / "proxy"
    if not (proxy / MANIFEST).is_file():
        raise MoeProxyError(f"{proxy}: the bisection's proxy of step {step} is not there (no {MANIFEST})")
    return proxy


# --- 3. diagnose -------------------------------------------------------------------------------


def candidates_for(signature: str, given: list[Fix] | None, repro_flags: list[str] | None = None
                   ) -> tuple[list[Fix], dict[str, str]]:
    """The candidates and why each: those given, else the catalogue's for the signature
    (catalogue.suggested, most likely cure first) but those that change none of the baseline's
    settings (fp16's dynamic loss scaling against repro's fp16 default, grad-clip at repro's 1.0):
    diagnose would run them as `no-change`, a check of the method the loop need not pay for;
    their `why` says they were left out."""
    if given:
        return list(given), {c.name: "given" for c in given}
    baseline = repro_config(repro_flags or [])
    chosen, why = [], {}
    for entry, fix in zip(suggested(signature), pick([c.name for c in suggested(signature)])):
        if changed_settings(baseline, repro_config([*(repro_flags or []), *fix.changes(baseline)])):
            chosen.append(fix)
            why[fix.name] = entry.why
        else:
            why[fix.name] = f"left out: {' '.join(fix.changes(baseline))} changes none of the baseline's settings"
    return chosen, why


def suggestion_table() -> str:
    """The catalogue's table for the loop (FOR_SIGNATURE, then FOR_THRESHOLD) in markdown, as
    docs/triage.md shows it (a test keeps the two the same)."""
    from moe_proxy.investigate.catalogue import FOR_SIGNATURE, FOR_THRESHOLD

    lines = ["| failure | candidate, most likely cure first | why |", "|---|---|---|"]
    for signature, chosen in [*((f"`{k}`", v) for k, v in FOR_SIGNATURE.items()), ("`METRIC>X[:K]`", FOR_THRESHOLD)]:
        lines += [f"| {signature if i == 0 else ''} | `{c.name}` | {c.why} |" for i, c in enumerate(chosen)]
    return "\n".join(lines)


def check_candidates(repro_flags: list[str], candidates: list[Fix]) -> None:
    """Each candidate's flags as diagnose will check them, before anything is built."""
    baseline = repro_config(repro_flags)
    for c in candidates:
        flags = c.changes(baseline)
        if own := [f for f in flags if f.split("=")[0] in OWN_FLAGS]:
            raise MoeProxyError(f"candidate {c.name!r}: {', '.join(own)}: set on each run by the loop itself")
        try:
            repro_config([*repro_flags, *flags])
        except MoeProxyError as exc:
            raise MoeProxyError(f"candidate {c.name!r} ({' '.join(flags)}): repro refuses it: {exc}") from None


# --- the loop ----------------------------------------------------------------------------------


def triage(s: TriageSettings, out: str | Path, replace: bool = False, store_options: dict | None = None) -> dict:
    """Detect, bisect, diagnose, report: returns report.json's content (its `state` says how far
    the loop got). Bad input raises before anything is built; bisect's and diagnose's own stops
    (BisectStopped, BaselineFailed, processes.Interrupted) pass through, their partial reports
    written in DIR/bisect or DIR/diagnose."""
    out, started = Path(out), time.monotonic()
    if s.candidates:  # those given are checked before the log is read
        check_candidates(s.probe.repro_flags, s.candidates)
    found = detect(s.metrics, s.probe.fail_on, s.read, store_options)
    candidates, why = candidates_for(found.signature, s.candidates, s.probe.repro_flags)
    if not candidates:
        raise MoeProxyError(f"every candidate the catalogue names for {found.signature} changes none of the "
                            "baseline's settings: give --candidates or --candidate")
    check_candidates(s.probe.repro_flags, candidates)
    claim_out(out, "triage", s.recorded(), TRIAGE_OUTPUTS, replace)
    if found.instead:  # a NaN came first: the probes and the diagnosis judge on it (repro --fail-on nan)
        s = dataclasses.replace(s, probe=dataclasses.replace(s.probe, fail_on=found.signature))
    report = {"metrics": s.metrics, "checkpoints": s.prefix, "asked": found.asked, "signature": found.signature,
              "failing_step": found.failing_step, "detection": found.as_json(), "first_bad": None, "fixed_by": [],
              "candidates": why, "bisect_report": None, "diagnose_report": None}
    log.info("triage: %s: %s", s.metrics, _detected(found))
    if found.failing_step is None:
        return finish(out, found, {**report, "state": STATE_NO_FAILURE, "answer": _no_failure(found)}, started)
    listed = before_failure(s, found.failing_step, store_options)
    if not listed:
        return finish(out, found, {**report, **_none_before(s.prefix, found)}, started)
    log.info("triage: bisecting %d checkpoint(s), steps %d..%d, up to the failing step %d", len(listed),
             listed[0].step, listed[-1].step, found.failing_step)
    bisection = (bisect(s.prefix, out / "bisect", s.probe, pattern=s.pattern, step_regex=s.step_regex,
                        bad=listed[-1].step, store_options=store_options, parallel=s.parallel)
                 if len(listed) > 1 else probe_only(s, out / "bisect", listed[0], store_options))
    report |= {"bisect_report": str(out / "bisect" / "report.json"), "first_bad": _first_bad(bisection),
               "boundary": bisection["boundary"]}
    if bisection["first_bad"] is None:
        return finish(out, found, {**report, "state": STATE_NOT_REPRODUCED, "answer": _not_reproduced(found, bisection),
                                   "cost": loop_cost(s, out, bisection, None, store_options)}, started)
    proxy, diagnosis = diagnose_first_bad(s, out, bisection["first_bad"]["step"], candidates)
    report |= {"proxy": str(proxy), "diagnose_report": str(out / "diagnose" / "report.json"),
               "fixed_by": diagnosis["fixed_by"], "fixed_with_other_failures": diagnosis["fixed_with_other_failures"],
               "verdicts": {n: {"verdict": c["verdict"], "note": c["note"]}
                            for n, c in diagnosis["candidates"].items()},
               "cost": loop_cost(s, out, bisection, diagnosis, store_options)}
    state = STATE_NOT_CURED if diagnosis.get("stopped") else STATE_DIAGNOSED
    return finish(out, found, {**report, "state": state, "answer": answer(report, diagnosis)}, started)


def diagnose_first_bad(s: TriageSettings, out: Path, step: int, candidates: list[Fix]) -> tuple[Path, dict]:
    """diagnose() on the proxy the bisection built for its probe of `step`, into DIR/diagnose."""
    proxy = probe_proxy(out / "bisect", step)
    log.info("triage: diagnosing on the proxy of step %d (%s): %s", step, proxy, ", ".join(c.name for c in candidates))
    return proxy, diagnose(str(proxy), out / "diagnose", s.probe.fail_on, s.probe.repro_flags, candidates,
                           seeds=s.probe.seeds, parallel=s.parallel, all_seeds=s.all_seeds)


def _detected(found: Detection) -> str:
    if found.failing_step is not None:
        return f"{found.what()} from step {found.failing_step} ({found.detail}; {found.steps_read} steps read)"
    return _no_failure(found)


def _no_failure(found: Detection) -> str:
    seen = "; ".join(f"{n} at step {t}" for n, t in sorted(found.also_seen.items(), key=lambda i: i[1]))
    return (f"no {found.signature} in the {found.steps_read} steps logged (to step {found.last_step})"
            + (f" (it cannot be judged from this log: {found.unjudged})" if found.unjudged else "")
            + (f"; seen: {seen}" if seen else "") + ": nothing to bisect, nothing was built")


def probe_only(s: TriageSettings, out: Path, checkpoint, store_options: dict | None = None) -> dict:
    """One checkpoint before the failure: nothing to search, its probe alone (bisect's probe, in
    the bisection's --out as bisect would make it, so a rerun reuses it); the bisection's findings."""
    from moe_proxy.investigate.bisect import BISECTION_FILES, findings, probe, probes_cost, said

    claim_out(out, "bisect", {"prefix": s.prefix, **asdict(s.probe)}, BISECTION_FILES)
    log.info("triage: one checkpoint before the failure (step %d): its probe alone", checkpoint.step)
    p = probe(checkpoint, out, s.probe)
    log.info("probe 1: step %d: %s%s", p.step, said(p), " (reused)" if p.reused else "")
    found = findings(0 if p.reproduced else None, [(0, p)], [checkpoint])
    report = {"prefix": s.prefix, "fail_on": s.probe.fail_on, "checkpoints": [checkpoint.step], "status": "complete",
              **found, "cost": probes_cost(found, out, s.probe, store_options), "settings": asdict(s.probe)}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _none_before(prefix: str, found: Detection) -> dict:
    return {"state": STATE_BEFORE_CHECKPOINTS, "answer": f"the failure, {found.what()}, began at step "
            f"{found.failing_step}, before any complete checkpoint under {prefix}: no checkpoint can carry it; "
            "nothing was built"}


def _first_bad(bisection: dict) -> dict | None:
    first = bisection["first_bad"]
    if first is None:
        return None
    return {"step": first["step"], "uri": first["checkpoint"],
            "index": bisection["checkpoints"].index(first["step"]) + 1, "of": len(bisection["checkpoints"])}


def _not_reproduced(found: Detection, bisection: dict) -> str:
    return (f"{_onset(found.signature, found.asked, found.failing_step)}, but no checkpoint's proxy reproduces it "
            f"({bisection['boundary']}): nothing to diagnose")


def _onset(signature: str, asked: str, step: int) -> str:
    """The failure at the head of an answer: "overflow at step 25 of the original", or, a NaN
    first, "failed on nan at step 12 of the original (no overflow before it)"."""
    if signature == asked:
        return f"{signature} at step {step} of the original"
    return f"failed on {signature} at step {step} of the original (no {asked} before it)"


def answer(report: dict, diagnosis: dict) -> str:
    """The answer in one paragraph: where the failure began, what cures it, what does not."""
    first, signature, asked = report["first_bad"], report["signature"], report["asked"]
    head = (f"{_onset(signature, asked, report['failing_step'])}; fails from checkpoint {first['index']} of "
            f"{first['of']} (step {first['step']})")
    if diagnosis.get("stopped"):
        return f"{head}; but the diagnosis's baseline did not reproduce it ({diagnosis['stopped']})"
    verdicts = {n: c["verdict"] for n, c in diagnosis["candidates"].items()}
    fixed = ", ".join(report["fixed_by"]) or "none of the candidates"
    parts = [f"{head}; fixed by {fixed}"]
    if report["fixed_with_other_failures"]:
        parts.append(f"fixed with other failures by {', '.join(report['fixed_with_other_failures'])}")
    if rest := [f"{n} ({v})" if v != "reproduced" else n for n, v in verdicts.items()
                if v not in ("fixed", "fixed-but")]:
        parts.append(f"not by {', '.join(rest)}")
    return "; ".join(parts)


# --- what the loop cost ------------------------------------------------------------------------


def loop_cost(s: TriageSettings, out: Path, bisection: dict, diagnosis: dict | None,
              store_options: dict | None = None) -> dict:
    """What the loop spent: proxy builds, probes, runs and RL steps (reused ones counted, and
    said), and device-hours by sizing's RUN_COST_RULE, the rule bisect's report prices its probes
    by: each run's completed steps x the proxy's device-hours per step at the precision it ran at
    (a candidate that changes the precision is priced at its own), against one step of the
    original."""
    probes = bisection["probes"]
    base = repro_config(s.probe.repro_flags).precision
    probe_runs = [(base, o) for p in probes for o in p["seeds"].values()]
    candidates = list(diagnosis["candidates"].values()) if diagnosis else []
    variants = ([(base, diagnosis["baseline"])] if diagnosis else []) + [
        ((c.get("changes") or {}).get("precision", base), c) for c in candidates]  # a candidate's own precision
    runs = [(precision, o) for precision, v in variants for o in v["seeds"].values()]
    steps = sum(o.get("steps_completed", 0) for _, o in probe_runs + runs)
    cost = {"builds": bisection["builds"], "calibrations": bisection["builds"] if s.probe.calibrate_flags else 0,
            "probes": len(probes), "probe_runs": len(probe_runs), "candidate_runs": len(runs), "rl_steps": steps,
            "reused": {"probes": sum(bool(p["reused"]) for p in probes),
                       "runs": sum(bool(o.get("reused")) for _, o in probe_runs + runs)}}
    return cost | device_hours(s, out, bisection, probe_runs, runs, store_options)


def device_hours(s: TriageSettings, out: Path, bisection: dict, probe_runs: list[tuple[str, dict]],
                 runs: list[tuple[str, dict]], store_options: dict | None) -> dict:
    """The runs ((precision, outcome) each) in device-hours by sizing.run_device_hours, priced by
    the plan bisect prices its probes by (bisect.pricing_plan), against one step of the original
    at the baseline's precision. `probe_device_hours`, the probes' part, is bisect's report's own
    `cost.device_hours`."""
    from moe_proxy.investigate.bisect import pricing_plan
    from moe_proxy.sizing import RUN_COST_RULE, run_device_hours

    if not bisection["probes"]:
        return {"device_hours": None, "device_hours_note": "no probe ran"}
    base = repro_config(s.probe.repro_flags).precision
    plans = {p: pricing_plan(bisection, out / "bisect", s.probe, store_options, p)
             for p in {base, *(p for p, _ in runs)}}
    if plans[base] is None:
        return {"device_hours": None, "device_hours_note": f"{' '.join(s.probe.build_flags)}: no fixed expert count "
                                                           "to plan"}

    def hours(priced_runs: list[tuple[str, dict]]) -> float:
        return sum(run_device_hours(plans[p].proxy.device_hours_per_step, o.get("steps_completed", 0))
                   for p, o in priced_runs)

    plan = plans[base]
    total, original = hours(probe_runs + runs), plan.original.device_hours_per_step
    return {"device_hours": total, "probe_device_hours": hours(probe_runs),
            "proxy_device_hours_per_step": plan.proxy.device_hours_per_step,
            "original_device_hours_per_step": original, "original_steps": total / original,
            "device_hours_model": f"{RUN_COST_RULE}; {plan.accelerator}, the default RL step shape, the baseline "
                                  f"{base}; proxy {plan.proxy.devices} devices, original {plan.original.devices}"}


# --- 4. report ---------------------------------------------------------------------------------


def finish(out: Path, found: Detection, report: dict, started: float) -> dict:
    """Write report.json, report.md and the pictures; returns the report."""
    report["wall_s"] = round(time.monotonic() - started, 1)
    pictures = [p.name for p in [plot_original(out, found), *copy_pictures(out, report)] if p]
    report["pictures"] = pictures
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(markdown(report))
    return report


def plot_original(out: Path, found: Detection) -> Path | None:
    """original.png: the original's key metrics, the failing step marked."""
    from moe_proxy.metrics.compare import KEY_METRICS
    from moe_proxy.metrics.plots import plot_curves

    if not found.rows:
        return None
    names = set().union(*found.rows.values())
    first = (found.signature, "numerics/nonfinite_activations", "numerics/max_activation", "actor/grad_norm")
    wanted = [m for m in (*first, *KEY_METRICS) if m in names]
    metrics = list(dict.fromkeys(wanted))[:ORIGINAL_PLOT_METRICS]
    onsets = {found.signature: found.failing_step} if found.failing_step is not None else {}
    original = _Curves("original", found.rows, onsets)
    return next(iter(plot_curves([original], metrics, out, "original.png")), None)


@dataclass
class _Curves:
    name: str
    rows: dict[int, dict[str, float]]
    onsets: dict[str, int]


def copy_pictures(out: Path, report: dict) -> list[Path]:
    """diagnose's matrix.png and curves.png beside the report (copied: the report's folder reads alone)."""
    if not report.get("diagnose_report"):
        return []
    copied = []
    for name in ("matrix.png", "curves.png"):
        if (out / "diagnose" / name).is_file():
            shutil.copyfile(out / "diagnose" / name, out / name)
            copied.append(out / name)
    return copied


def markdown(r: dict) -> str:
    lines = [f"# Triage: {r['signature']} in {r['metrics']}", "", f"**{r['answer']}.**", ""]
    if r["state"] == STATE_DIAGNOSED:
        lines += [f"Verdicts on the proxy of the first bad checkpoint ({r['first_bad']['uri']}):", ""]
        lines += [f"- `{n}`: {v['verdict']} ({v['note']}); why tried: {r['candidates'].get(n, 'given')}"
                  for n, v in r["verdicts"].items()]
        lines += [f"- `{n}`: {why}" for n, why in r["candidates"].items() if why.startswith("left out")]
        lines.append("")
    if b := r.get("boundary"):
        lines += [f"Bisection: {b}.", ""]
    if c := r.get("cost"):
        lines += [cost_line(c), ""]
    seen = r["detection"]
    lines += [f"Detected in the original's metrics ({seen['steps_read']} steps read, to step {seen['last_step']}): "
              f"{seen['detail'] or 'nothing'}.", ""]
    reports = [f"[{what}]({_readable(Path(r[key]))})" for what, key in (("bisection", "bisect_report"),
                                                                           ("diagnosis", "diagnose_report")) if r[key]]
    lines += [f"Reports: {', '.join(reports)}.", ""] if reports else []
    lines += [*[f"![{p.removesuffix('.png')}]({p})" for p in r["pictures"]], ""]
    return "\n".join(lines)


def _readable(report_json: Path) -> str:
    """A sub-report as report.md links it: its report.md where there is one (a probe alone has none)."""
    md = report_json.with_suffix(".md")
    return f"{report_json.parent.name}/{md.name if md.is_file() else report_json.name}"


def cost_line(c: dict) -> str:
    said = (f"Cost: {c['builds']} proxy builds ({c['calibrations']} calibrations), {c['probes']} probes "
            f"({c['probe_runs']} runs), {c['candidate_runs']} diagnosis runs, {c['rl_steps']} RL steps on proxies")
    reused = c["reused"]
    if reused["probes"] or reused["runs"]:
        said += f" ({reused['probes']} probes and {reused['runs']} runs reused from an earlier call)"
    if c.get("device_hours") is not None:
        said += (f"; {c['device_hours']:.4g} device-hours ({c['probe_device_hours']:.4g} of them the probes'), "
                 f"{c['original_steps']:.3g} steps of the original "
                 f"({c['original_device_hours_per_step']:.4g} device-hours each) by {c['device_hours_model']}")
    return said + "."
