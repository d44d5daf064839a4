"""`moe-proxy bisect`: the earliest checkpoint of a training run whose proxy reproduces a failure.

The run's complete checkpoints (the `checkpoints` listing) are probed by binary search: a probe
builds the checkpoint's proxy (with `--dataset`, calibrated on that checkpoint first, as the
default calibrated build does; else the data-free build) and runs the reproduction from it. The
last checkpoint (or `--bad`) is probed first: if it does not reproduce there is nothing to find.
The boundary is confirmed: the checkpoint just before the first bad one was probed clean (it
is the search's last clean probe), unless the first checkpoint already reproduces. O(log n)
builds; every probe is kept in `DIR/probes/step-<N>/` (stats, proxy, run) and reused by a rerun
with the same settings.

Monotone: a failure that a checkpoint carries, every later one carries too. A clean probe
after a reproducing one says it is not (the verdict is then one probe's word: say so).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from moe_proxy.checkpoint.reader import MANIFEST
from moe_proxy.errors import BaselineFailed, InvalidRange, TooFewCheckpoints
from moe_proxy.repro.processes import run_recorded

log = logging.getLogger(__name__)

PROBE_RECORD = "bisect-run.json"


@dataclass
class Probe:
    checkpoint: str
    step: int
    reproduced: bool
    signature: str | None
    onset: int | None


@dataclass(frozen=True)
class ProbeSettings:
    """How each probe is made: build flags, calibration flags (empty: a data-free build) and
    the reproduction's flags, as written."""

    fail_on: str
    build_flags: list[str]
    calibrate_flags: list[str]
    repro_flags: list[str]


def sources(prefix: str, pattern: str | None, step_regex: str | None, good: int | None, bad: int | None,
            store_options: dict | None = None) -> list:
    """The run's complete source checkpoints with a step, in step order, within [good, bad]."""
    from moe_proxy.checkpoint.listing import list_checkpoints

    found = [c for c in list_checkpoints(prefix, pattern, step_regex, **(store_options or {}))
             if c.source and c.complete and c.step is not None]
    if good is not None:
        found = [c for c in found if c.step >= good]
    if bad is not None:
        found = [c for c in found if c.step <= bad]
    for flag, step in (("--good", good), ("--bad", bad)):
        if step is not None and not any(c.step == step for c in found):
            raise InvalidRange(f"{flag} {step}: no complete checkpoint at that step under {prefix}")
    if len(found) < 2:
        raise TooFewCheckpoints(f"{prefix}: {len(found)} complete checkpoint(s) with a step"
                            f"{' in the range given' if good is not None or bad is not None else ''}; "
                            "bisect needs at least 2 (see moe-proxy checkpoints)")
    return found


def probe(checkpoint, out: Path, s: ProbeSettings) -> Probe:
    """Build `checkpoint`'s proxy (calibrated first with calibrate flags) and reproduce from it."""
    home = out / "probes" / f"step-{checkpoint.step}"
    proxy, stats, run = home / "proxy", home / "stats", home / "run"
    build = ["build", checkpoint.uri, str(proxy), *s.build_flags, "--no-progress"]
    if s.calibrate_flags:
        ran = run_recorded(["calibrate", checkpoint.uri, "--out", str(stats), *s.calibrate_flags, "--no-progress"],
                           home, f"calibrate.{PROBE_RECORD}", "calibrate.log", done="stats/calibration.json")
        _ok(ran, "calibrate", checkpoint)
        build += ["--calibration", str(stats)]
    _ok(run_recorded(build, home, f"build.{PROBE_RECORD}", "build.log", done=f"proxy/{MANIFEST}"), "build", checkpoint)
    repro = ["repro", str(proxy), "--out", str(run), *s.repro_flags, "--fail-on", s.fail_on, "--no-progress"]
    _ok(run_recorded(repro, home, f"repro.{PROBE_RECORD}", "repro.log", done="run/summary.json"), "repro", checkpoint)
    summary = json.loads((run / "summary.json").read_text())
    first = summary.get("first_failure") or {}
    reproduced = bool(summary.get("reproduced"))
    return Probe(checkpoint.uri, checkpoint.step, reproduced, first.get("signature") if reproduced else None,
                 first.get("step") if reproduced else None)


def _ok(ran, what: str, checkpoint) -> None:
    if ran.returncode != 0:
        raise BaselineFailed(f"step {checkpoint.step} ({checkpoint.uri}): {what} failed: {ran.error}")


@dataclass(frozen=True)
class Next:
    """What the search does next: probe index `probe`, or (probe None) it is over and `first_bad`
    is the answer (None: the last checkpoint is clean, nothing to find)."""

    probe: int | None
    first_bad: int | None = None


def next_probe(n: int, results: dict[int, bool], good_given: bool) -> Next:
    """The binary search as a pure function of what the probes said so far (`results`: index ->
    reproduced), so a caller that probes one at a time across restarts (the operator's Diagnosis)
    and `search` follow the same rule. The last is probed first (nothing to find if it is clean);
    with `good_given`, the first too (it must be clean); then the one after the first bad,
    unless probed already."""
    hi = n - 1
    if hi not in results:
        return Next(hi)
    if not results[hi]:
        return Next(None, None)
    lo = -1  # the last index known clean (-1: before the first)
    if good_given:
        if 0 not in results:
            return Next(0)
        if results[0]:
            return Next(None, 0)
        lo = 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if mid not in results:
            return Next(mid)
        hi, lo = (mid, lo) if results[mid] else (hi, mid)
    # The search only ever goes left of a failure: one probe after it checks that the failure,
    # once there, stays (a clean one there says the probes are not monotone).
    if hi + 1 < n and hi + 1 not in results:
        return Next(hi + 1)
    return Next(None, hi)


def search(checkpoints: list, test, good_given: bool) -> tuple[int | None, list[tuple[int, Probe]]]:
    """Binary search for the first index whose probe reproduces, `test(i) -> Probe`, by
    `next_probe`. Returns (first bad index or None, the probes as (index, probe) in probe order)."""
    probes: list[tuple[int, Probe]] = []
    while (step := next_probe(len(checkpoints), {i: p.reproduced for i, p in probes}, good_given)).probe is not None:
        probes.append((step.probe, test(step.probe)))
    return step.first_bad, probes


def findings(first: int | None, probes: list[tuple[int, Probe]], checkpoints: list) -> dict:
    """What a finished search says (report.json's first_bad, boundary, probes, builds, monotone
    and, when not, not_monotone), pure: the CLI's report and the operator's status both hold it.
    `checkpoints` are in step order, each with `uri` and `step`."""
    ordered = sorted((p for _, p in probes), key=lambda p: p.step)
    bad_steps = [p.step for p in ordered if p.reproduced]
    contradicting = [p for p in ordered if not p.reproduced and bad_steps and p.step > min(bad_steps)]
    out = {
        "first_bad": ({"checkpoint": checkpoints[first].uri, "step": checkpoints[first].step}
                      if first is not None else None),
        "boundary": _boundary(first, checkpoints, probes),
        "probes": [asdict(p) for _, p in probes], "builds": len(probes), "monotone": not contradicting,
    }
    if contradicting:
        out["not_monotone"] = [f"step {p.step} clean after step {min(bad_steps)} reproduced" for p in contradicting]
    return out


def bisect(prefix: str, out: str | Path, settings: ProbeSettings, pattern: str | None = None,
           step_regex: str | None = None, good: int | None = None, bad: int | None = None,
           store_options: dict | None = None) -> dict:
    """List, search, report: returns report.json's content."""
    checkpoints = sources(prefix, pattern, step_regex, good, bad, store_options)
    out = Path(out)
    log.info("bisect: %d checkpoints, steps %d..%d; a probe builds a proxy and reproduces from it",
             len(checkpoints), checkpoints[0].step, checkpoints[-1].step)

    def test(i: int) -> Probe:
        p = probe(checkpoints[i], out, settings)
        log.info("probe step %d: %s", p.step, f"{p.signature} at step {p.onset}" if p.reproduced else "clean")
        return p

    found = findings(*search(checkpoints, test, good is not None), checkpoints)
    report = {"prefix": prefix, "fail_on": settings.fail_on, "checkpoints": [c.step for c in checkpoints],
              **found, "settings": asdict(settings)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(_markdown(report))
    return report


def _boundary(first: int | None, checkpoints: list, probes: list[tuple[int, Probe]]) -> str:
    if first is None:
        return "the last checkpoint does not reproduce: no checkpoint carries the failure"
    if first == 0:
        return "the first checkpoint listed already reproduces: the failure began at or before it"
    before = next(p for i, p in probes if i == first - 1)
    return f"confirmed: step {before.step}, the checkpoint before, ran clean"


def where(first_bad: dict | None) -> str:
    return f"step {first_bad['step']} ({first_bad['checkpoint']})" if first_bad else "none"


def _markdown(r: dict) -> str:
    fb = r["first_bad"]
    lines = [f"# Bisection: {r['fail_on']} over {r['prefix']}", "",
             f"First bad checkpoint: {where(fb)}; "
             f"{r['boundary']}. {r['builds']} probe builds over {len(r['checkpoints'])} checkpoints.", ""]
    if not r["monotone"]:
        lines += ["**Not monotone**: " + "; ".join(r["not_monotone"]) + ". One probe per checkpoint decides "
                  "nothing then: rerun with more steps or another seed.", ""]
    lines += ["| probe | step | verdict | onset |", "|---|---|---|---|"]
    lines += [f"| {n} | {p['step']} | {'reproduced' if p['reproduced'] else 'clean'} | "
              f"{p['onset'] if p['onset'] is not None else '-'} |" for n, p in enumerate(r["probes"], 1)]
    return "\n".join(lines) + "\n"
