"""`moe-proxy bisect`: the earliest checkpoint of a training run whose proxy reproduces a failure.

The run's complete checkpoints (the `checkpoints` listing) are probed by binary search: a probe
builds the checkpoint's proxy (with `--dataset`, calibrated on that checkpoint first, as the
default calibrated build does; else the data-free build; always with --fill-dead, so that a
collapsed checkpoint, whose layers route to fewer experts than the count, builds) and runs the
reproduction from it on `seeds` seeds. The last checkpoint (or `--bad`) is probed first: if it
does not reproduce there is nothing to find. O(log n) builds; every probe is kept in
`DIR/probes/step-<N>/` (stats, proxy, runs/seed-<s>/). A rerun resumes: each step of a probe is reused only when what made it
is the same (its arguments, the moe-proxy version, the content it read: processes.Recipe), and
`DIR` holds one bisection (another one's settings are refused, processes.claim_out).

A probe says one of three things: reproduced (on any seed, as diagnose judges a baseline),
clean (every seed ran all its steps without the failure), or inconclusive (a seed's run was
stopped by another failure, NaN say, before the asked-for one could come, or failed to run):
the search steps around an inconclusive checkpoint, and the result names it. A probe whose
build fails, or whose every run fails, stops the bisection with a partial report; so does an
interrupt (SIGINT, or SIGTERM within processes.signals_interrupt), which stops the probe's child.

Monotone: a failure that a checkpoint carries, every later one carries too. The search checks
it around the boundary it found: the checkpoint after the first bad one must reproduce, the one
before the last clean one must not. A clean probe after a reproducing one says the run is not
monotone (the verdict is then one probe's word: the report says so).
"""

from __future__ import annotations

import json
import logging
import os
import signal
from dataclasses import asdict, dataclass, field
from pathlib import Path

from moe_proxy.checkpoint.reader import MANIFEST
from moe_proxy.errors import BisectStopped, InvalidRange, MoeProxyError, ProbeFailed, TooFewCheckpoints
from moe_proxy.options import (PruningOptions, TokenOptions, add_arguments, add_size_arguments, from_args, options_of,
                               parse_flags, statistics_flags)
from moe_proxy.investigate.diagnose import SeedRun, repro_config, seed_outcome
from moe_proxy.metrics.detect import Signature
from moe_proxy.investigate.processes import (Interrupted, RunsInterrupted, Stopped, claim_out, content_key, run_each,
                                             run_recorded, stop_children)

log = logging.getLogger(__name__)

# The build options a probe's build takes (the selection seed and the calibration are bisect's:
# --seed is repro's here, and each probe is calibrated on its own checkpoint).
PROBE_BUILD = tuple(name for name, _, _ in options_of(PruningOptions) if name not in ("seed", "calibration", "max_kl"))
PROBE_CALIBRATION = ("dataset", "samples", "seq_len")  # calibrate's token options a probe uses
PROBE_RECORD = "bisect-run.json"
BISECTION_FILES = ("probes", "report.json", "report.md")  # what a bisection writes in its --out (claim_out)
FAILED_LOG_LINES = 30  # the end of a failed probe's log, kept in the partial report
PROBE_STATES = {True: "reproduced", False: "clean", None: "inconclusive"}  # by Probe.reproduced


@dataclass
class Probe:
    checkpoint: str
    step: int
    reproduced: bool | None  # None: inconclusive, `note` says why
    signature: str | None
    onset: int | None
    note: str = ""
    seeds: dict[str, dict] = field(default_factory=dict)  # seed -> its run's outcome
    reused: bool = False  # every step of it was the record of the same made before (processes.Recipe)

    @property
    def state(self) -> str:
        return PROBE_STATES[self.reproduced]


@dataclass(frozen=True)
class ProbeSettings:
    """How each probe is made: build flags, calibration flags (empty: a data-free build) and
    the reproduction's flags, as written; its runs use seeds first_seed .. first_seed + seeds - 1."""

    fail_on: str
    build_flags: list[str]
    calibrate_flags: list[str]
    repro_flags: list[str]
    seeds: int = 1
    first_seed: int = 0


def sources(prefix: str, pattern: str | None, step_regex: str | None, good: int | None, bad: int | None,
            store_options: dict | None = None) -> list:
    """The run's complete source checkpoints with a step, in step order, within [good, bad]."""
    from moe_proxy.checkpoint.listing import list_checkpoints

    if good is not None and bad is not None and good >= bad:
        raise InvalidRange(f"--good {good} is not before --bad {bad}: the known-clean step must come first")
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


def build_options(build_flags: list[str]) -> PruningOptions:
    """The probes' PruningOptions, as `moe-proxy build SRC DST <build_flags>` reads them (checked)."""
    args = parse_flags(build_flags, _probe_build_arguments)
    options = from_args(PruningOptions, args).resolved()
    options.validate()
    return options


def _probe_build_arguments(parser) -> None:
    add_size_arguments(parser)
    add_arguments(parser, PruningOptions, only=PROBE_BUILD, skip=("experts", "keep_ratio"))


def probe_settings(fail_on: str, build_flags: list[str], calibrate_flags: list[str], repro_flags: list[str],
                   seeds: int) -> ProbeSettings:
    """The probes' settings from the flags bisect passes on, each checked as its command checks
    it, before anything runs; with calibration flags, the statistics a calibrated build of the
    probes' options needs (options.statistics_flags)."""
    Signature.parse(fail_on)
    if seeds < 1:
        raise MoeProxyError(f"--seeds {seeds}: at least 1")
    # A probe of a collapsed checkpoint must still build: a layer with fewer alive experts than the
    # count keeps its most-routed dead ones (the manifest says so) instead of stopping the search.
    build_flags = [*build_flags, *(["--fill-dead"] if "--fill-dead" not in build_flags else [])]
    try:
        options = build_options(build_flags)
    except MoeProxyError as exc:
        raise MoeProxyError(f"the build options: {exc}") from None
    calibrate = []
    if calibrate_flags:
        if "--dataset" not in calibrate_flags:
            raise MoeProxyError("--samples / --seq-len calibrate each probe: they need --dataset")
        parse_flags(calibrate_flags, lambda p: add_arguments(p, TokenOptions, only=PROBE_CALIBRATION))
        calibrate = [*calibrate_flags, *statistics_flags(options)]
    try:
        first_seed = repro_config(repro_flags).seed
    except MoeProxyError as exc:
        raise MoeProxyError(f"the repro options: {exc}") from None
    return ProbeSettings(fail_on, list(build_flags), calibrate, list(repro_flags), seeds, first_seed)


def probe_plan(uri: str, s: ProbeSettings, store_options: dict | None = None, proxy: Path | None = None,
               precision: str | None = None):
    """plan's estimate (sizing.Sizing: the proxy's devices and device-hours per RL step) for a
    probe's proxy of the checkpoint at `uri`, from its config alone, at the precision its runs
    ran at (`precision`, default the repro flags'): the expert count and top-k of the built
    proxy (`proxy`'s manifest) when given, else the build options' by the rule plan and build use
    (a count the model cannot take is refused: bisect checks it before any probe). None when
    the build options give no count (--experts auto) and no proxy is given."""
    from moe_proxy.checkpoint.reader import open_checkpoint
    from moe_proxy.sizing import SizingOptions, estimate

    options = build_options(s.build_flags)
    experts, keep, top_k = options.experts, options.keep_ratio, options.top_k
    if proxy is not None and (proxy / MANIFEST).is_file():
        manifest = json.loads((proxy / MANIFEST).read_text())
        experts, keep, top_k = manifest["experts"]["after"], None, manifest["experts"]["top_k_after"]
    if not isinstance(experts, int) and keep is None:
        return None
    config = open_checkpoint(uri, **(store_options or {})).config
    return estimate(config, SizingOptions(experts=experts, keep_ratio=keep, top_k=top_k,
                                          precision=precision or repro_config(s.repro_flags).precision))


def probe_slots(s: ProbeSettings, parallel: int) -> list[dict[str, str]]:
    """The environment of each of `parallel` probes side by side, as diagnose's run_slots gives
    its runs: devices of its own (as many as a run has ranks) and, unless set, its share of the
    CPU threads. Too few devices raise before anything runs; one probe at a time sets nothing."""
    if parallel == 1:
        return [{}]
    from moe_proxy.rl.device import device_slots
    from moe_proxy.rl.run_options import repro_settings

    given = repro_settings(s.repro_flags)
    slots = device_slots(given.run.device, given.placement.nproc_per_node or 1, parallel)
    threads = {} if "OMP_NUM_THREADS" in os.environ else {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1)
                                                                                     // parallel))}
    return [{**slot, **threads} for slot in slots]


# --- a probe: build the checkpoint's proxy, run it on every seed ---------------------------


def probe(checkpoint, out: Path, s: ProbeSettings, env: dict[str, str] | None = None) -> Probe:
    """Build `checkpoint`'s proxy (calibrated first with calibrate flags), reproduce from it on
    each seed, and judge the seeds together (judge_probe); `env`: its children's environment
    added (probe_slots)."""
    home = out / "probes" / f"step-{checkpoint.step}"
    proxy, built_before = _build(checkpoint, home, s, env)
    made = {str(proxy): content_key(str(proxy))}  # its runs' record: this proxy's manifest sha256
    runs = {seed: _run(checkpoint, proxy, made, home, s, seed, env)
            for seed in range(s.first_seed, s.first_seed + s.seeds)}
    if all(o.reproduced is None for o in runs.values()):  # nothing ran: the probe failed, not the checkpoint
        seed = min(runs)
        raise _probe_failed(checkpoint, f"repro (seed {seed})", runs[seed].error,
                           home / "runs" / f"seed-{seed}" / "repro.log")
    reproduced, note = judge_probe(runs)
    onsets = {o.step: o.signature for o in runs.values() if o.reproduced}
    onset = min(onsets) if onsets else None
    return Probe(checkpoint.uri, checkpoint.step, reproduced, onsets.get(onset), onset, note,
                 {str(seed): o.as_json() for seed, o in runs.items()},
                 reused=built_before and all(o.reused for o in runs.values()))


def _build(checkpoint, home: Path, s: ProbeSettings, env: dict[str, str] | None = None) -> tuple[Path, bool]:
    """The probe's proxy (and whether its build was reused): each step's record is keyed by the
    content it read (the checkpoint's, the dataset's, the statistics'), so a checkpoint or dataset
    rewritten in place, or statistics made with other --samples, build again."""
    proxy, stats = home / "proxy", home / "stats"
    source = {checkpoint.uri: _checkpoint_key(checkpoint.uri)}
    # --overwrite: a proxy there that its record does not vouch for is stale (the probe's own directory)
    build = ["build", checkpoint.uri, str(proxy), *s.build_flags, "--overwrite", "--no-progress"]
    inputs = dict(source)
    if s.calibrate_flags:
        dataset = s.calibrate_flags[s.calibrate_flags.index("--dataset") + 1]
        ran = run_recorded(["calibrate", checkpoint.uri, "--out", str(stats), *s.calibrate_flags, "--no-progress"],
                           home, f"calibrate.{PROBE_RECORD}", "calibrate.log", env, done="stats/calibration.json",
                           inputs={**source, dataset: content_key(dataset)})
        _ok(ran, "calibrate", checkpoint, home / "calibrate.log")
        build += ["--calibration", str(stats)]
        inputs[str(stats)] = content_key(str(stats))  # its files' sha256
    ran = run_recorded(build, home, f"build.{PROBE_RECORD}", "build.log", env, done=f"proxy/{MANIFEST}",
                       inputs=inputs)
    _ok(ran, "build", checkpoint, home / "build.log")
    return proxy, ran.reused


def _checkpoint_key(uri: str) -> str:
    """The checkpoint's content key; one that cannot be read has none (its build fails, and says why)."""
    try:
        return content_key(uri)
    except MoeProxyError as exc:
        return f"unreadable: {exc}"


def _run(checkpoint, proxy: Path, made: dict[str, str], home: Path, s: ProbeSettings, seed: int,
         env: dict[str, str] | None = None) -> SeedRun:
    run = home / "runs" / f"seed-{seed}"
    argv = ["repro", str(proxy), "--out", str(run), *s.repro_flags, "--seed", str(seed), "--fail-on", s.fail_on,
            "--no-progress"]
    ran = run_recorded(argv, run, PROBE_RECORD, "repro.log", env, done="summary.json", inputs=made)
    outcome = seed_outcome(run, ran.returncode, ran.error, ran.wall_s, ran.reused)
    said_seed = f"{outcome.signature} at step {outcome.step}" if outcome.reproduced else _seed_said(outcome) or "clean"
    log.info("  step %d seed %d: %s", checkpoint.step, seed, said_seed)
    return outcome


def _ok(ran, what: str, checkpoint, log_file: Path) -> None:
    if ran.returncode != 0:
        raise _probe_failed(checkpoint, what, ran.error, log_file)


def _probe_failed(checkpoint, what: str, error: str | None, log_file: Path) -> ProbeFailed:
    """The failure of a probe's `what`, with the end of its log (for the partial report)."""
    lines = log_file.read_text(errors="replace").splitlines() if log_file.is_file() else []
    return ProbeFailed(f"step {checkpoint.step} ({checkpoint.uri}): {what} failed: {error}",
                       {"step": checkpoint.step, "checkpoint": checkpoint.uri, "what": what, "error": error,
                        "log": str(log_file), "log_tail": lines[-FAILED_LOG_LINES:]})


def judge_probe(runs: dict[int, SeedRun]) -> tuple[bool | None, str]:
    """(reproduced, note) of one checkpoint from its seeds' runs: reproduced when any seed
    reproduced; clean when every seed ran all its steps without it; else None, inconclusive (a
    seed stopped early by another failure, or its run failed: that seed cannot say clean)."""
    bad = sorted(s for s, o in runs.items() if o.reproduced)
    unjudged = {s: why for s, o in sorted(runs.items()) if not o.reproduced and (why := _seed_said(o))}
    others = "; ".join(f"seed {s}: {why}" for s, why in unjudged.items())
    if bad:
        if len(bad) == len(runs):
            return True, ""
        return True, f"on seed{'s' * (len(bad) > 1)} {', '.join(map(str, bad))} of {len(runs)}" + \
            (f"; {others}" if others else "; the others ran clean")
    if unjudged:
        return None, others
    seen = [f"seed {s}: also {', '.join(f'{n} at step {t}' for n, t in o.others.items())}"
            for s, o in sorted(runs.items()) if o.others]
    return False, "; ".join(seen)


def _seed_said(o: SeedRun) -> str:
    """Why a seed's run cannot say clean ('' when it can, or when it reproduced)."""
    if o.reproduced is None:
        return f"error: {o.error}"
    if o.reproduced or o.stopped in ("", "completed"):
        return ""
    why = ", ".join(f"{name} at step {step}" for name, step in o.others.items()) or o.stopped
    return f"stopped after {o.steps} step{'s' * (o.steps != 1)} by {why}"


# --- the search (pure) ----------------------------------------------------------------------


@dataclass(frozen=True)
class Next:
    """What the search does next: probe index `probe`, or (probe None) it is over and `first_bad`
    is the answer (None: the last checkpoint is clean or could not be judged, nothing to find)."""

    probe: int | None
    first_bad: int | None = None


def next_probe(n: int, results: dict[int, bool | None], good_given: bool) -> Next:
    """The binary search as a pure function of what the probes said so far (`results`: index ->
    reproduced, None for inconclusive), so a caller that probes one at a time across restarts
    (the operator's Diagnosis) and `search` follow the same rule. The last is probed first
    (nothing to find unless it reproduces); with `good_given`, the first too (it must be clean).
    Then halves between the last clean checkpoint before the earliest bad one and that bad one,
    stepping around inconclusive ones; at the end, the boundary's neighbours (after it, before
    it) are probed, unless probed already: they show a run that is not monotone."""
    last = n - 1
    if last not in results:
        return Next(last)
    bad = [i for i, r in results.items() if r]
    if not bad:
        return Next(None, None)
    if good_given and 0 not in results:
        return Next(0)
    hi = min(bad)
    lo = max((i for i, r in results.items() if r is False and i < hi), default=-1)
    untried = [i for i in range(lo + 1, hi) if i not in results]  # the others between are inconclusive
    if untried:
        mid = (lo + hi) // 2
        return Next(min(untried, key=lambda i: (abs(i - mid), i)))
    for neighbour in (hi + 1, lo - 1):
        if 0 <= neighbour < n and neighbour not in results:
            return Next(neighbour)
    return Next(None, hi)


@dataclass(frozen=True)
class Round:
    """The probes of one round (`probes`, run side by side), or (none) the search is over and
    `first_bad` is the answer. `kind`: "last" (the last checkpoint), "search" (cuts of the range
    left, with --good the first checkpoint until probed; the boundary's after-neighbour may fill a
    slot left over), "boundary" (the boundary's neighbours)."""

    probes: tuple[int, ...]
    first_bad: int | None = None
    kind: str = ""


def next_round(n: int, results: dict[int, bool | None], good_given: bool, parallel: int = 1) -> Round:
    """The next round of at most `parallel` probes, a pure function of `results` as next_probe is.
    parallel 1 is next_probe itself, one probe a round (today's order). Above 1: the last first
    (alone: a clean last ends the search), then the untried checkpoints between the last clean one
    and the earliest bad one are split into parallel + 1 parts (with --good, the first fills a
    slot while unprobed), so n checkpoints take about log_{P+1}(n) search rounds instead of
    log2(n); inconclusive ones are stepped around (never picked again); then the boundary's
    neighbours together. The same answer as one at a time, on a monotone run."""
    if parallel <= 1:
        step = next_probe(n, results, good_given)
        if step.probe is None:
            return Round((), step.first_bad)
        return Round((step.probe,), kind=_kind(n, results, step.probe))
    last = n - 1
    if last not in results:
        return Round((last,), kind="last")
    bad = [i for i, r in results.items() if r]
    if not bad:
        return Round((), None)
    hi = min(bad)
    lo = max((i for i, r in results.items() if r is False and i < hi), default=-1)
    picks = [0] if good_given and 0 not in results else []  # (then nothing below the earliest bad was probed)
    base = 0 if picks else lo  # the first counts as clean for the cuts: --good says so
    picks += spread([i for i in range(base + 1, hi) if i not in results], parallel - len(picks), base, hi)
    after = [hi + 1] if hi + 1 < n and hi + 1 not in results else []
    if picks:  # a slot left over: the checkpoint after the earliest bad one, which the end probes anyway
        return Round(tuple(picks + after[:parallel - len(picks)]), kind="search")
    neighbours = after + ([lo - 1] if lo - 1 >= 0 and lo - 1 not in results else [])
    return Round(tuple(neighbours[:parallel]), kind="boundary") if neighbours else Round((), hi)


def _kind(n: int, results: dict, probe: int) -> str:
    """What a one-at-a-time probe is for, as next_round names its rounds."""
    if probe == n - 1:
        return "last"
    hi = min(i for i, r in results.items() if r)
    lo = max((i for i, r in results.items() if r is False and i < hi), default=-1)
    return "search" if lo < probe < hi else "boundary"


def spread(untried: list[int], k: int, lo: int, hi: int) -> list[int]:
    """k of `untried` (indices between lo and hi, both excluded) that cut (lo, hi) into k + 1
    near-equal parts: each ideal cut's nearest untried index not picked yet (ties: the lower);
    all of them when k or more."""
    if len(untried) <= k:
        return list(untried)
    picks: list[int] = []
    for j in range(1, k + 1):
        ideal = lo + (hi - lo) * j / (k + 1)
        picks.append(min((i for i in untried if i not in picks), key=lambda i: (abs(i - ideal), i)))
    return sorted(picks)


def search(checkpoints: list, test, good_given: bool, parallel: int = 1, run_round=None,
           rounds: list | None = None) -> tuple[int | None, list[tuple[int, Probe]]]:
    """Search for the first index whose probe reproduces, `test(i) -> Probe`, by `next_round`,
    `parallel` probes a round (`run_round(indices, test) -> [Probe]` runs a round's probes side by
    side; by default one after another). Returns (first bad index or None, the probes as (index,
    probe) in probe order); `rounds`, when given, gets each round as (kind, indices)."""
    probes: list[tuple[int, Probe]] = []
    run_round = run_round or (lambda indices, test: [test(i) for i in indices])
    while (r := next_round(len(checkpoints), {i: p.reproduced for i, p in probes}, good_given, parallel)).probes:
        if rounds is not None:
            rounds.append((r.kind, list(r.probes)))
        probes += zip(r.probes, run_round(list(r.probes), test))
    return r.first_bad, probes


# --- what the probes say (pure) ---------------------------------------------------------------


def findings(first: int | None, probes: list[tuple[int, Probe]], checkpoints: list) -> dict:
    """What a finished search says (report.json's first_bad, boundary, probes, builds, monotone
    and, when not, not_monotone; inconclusive: the checkpoints it could not judge), pure: the
    CLI's report and the operator's status both hold it. `checkpoints` are in step order, each
    with `uri` and `step`."""
    ordered = sorted((p for _, p in probes), key=lambda p: p.step)
    bad_steps = [p.step for p in ordered if p.reproduced]
    contradicting = [p for p in ordered if p.reproduced is False and bad_steps and p.step > min(bad_steps)]
    out = {
        "first_bad": ({"checkpoint": checkpoints[first].uri, "step": checkpoints[first].step}
                      if first is not None else None),
        "boundary": _boundary(first, checkpoints, probes),
        "probes": [{**asdict(p), "state": p.state} for _, p in probes], "builds": len(probes),
        "monotone": not contradicting,
        "inconclusive": [{"step": p.step, "checkpoint": p.checkpoint, "why": p.note}
                         for p in ordered if p.reproduced is None],
    }
    if contradicting:
        out["not_monotone"] = [f"step {p.step} clean after step {min(bad_steps)} reproduced" for p in contradicting]
    return out


def _boundary(first: int | None, checkpoints: list, probes: list[tuple[int, Probe]]) -> str:
    said = {i: p for i, p in probes}
    if first is None:
        last = said.get(len(checkpoints) - 1)
        if last is not None and last.reproduced is None:
            return f"the last checkpoint (step {last.step}) could not be judged ({last.note}): nothing found"
        return "the last checkpoint does not reproduce: no checkpoint carries the failure"
    if first == 0:
        return "the first checkpoint listed already reproduces: the failure began at or before it"
    before = said.get(first - 1)
    if before is not None and before.reproduced is False:
        return f"confirmed: step {before.step}, the checkpoint before, ran clean"
    clean = max((i for i, p in said.items() if p.reproduced is False and i < first), default=None)
    unjudged = [said[i].step for i in range(first - 1, -1 if clean is None else clean, -1) if i in said]
    since = f"after step {checkpoints[clean].step}, " if clean is not None else ""
    return (f"not confirmed: step{'s' * (len(unjudged) > 1)} {', '.join(map(str, sorted(unjudged)))} before it "
            f"could not be judged; the failure began {since}at or before step {checkpoints[first].step}")


# --- the bisection and its report --------------------------------------------------------------


def bisect(prefix: str, out: str | Path, settings: ProbeSettings, pattern: str | None = None,
           step_regex: str | None = None, good: int | None = None, bad: int | None = None,
           store_options: dict | None = None, replace: bool = False, parallel: int = 1) -> dict:
    """List, search, report: returns report.json's content. `out` holds one bisection: another
    one's (other prefix or probe settings) is refused unless `replace` (processes.claim_out).
    `parallel` probes a round side by side (next_round; 1: one at a time, today's order). A
    bisection that ends before an answer writes a partial report, and raises BisectStopped (a
    probe failed) or processes.Interrupted (SIGINT, or SIGTERM within signals_interrupt)."""
    if parallel < 1:
        raise MoeProxyError(f"--parallel {parallel}: at least 1")
    checkpoints = sources(prefix, pattern, step_regex, good, bad, store_options)
    probe_plan(checkpoints[-1].uri, settings, store_options)  # a count the model cannot take: refused now
    slots = probe_slots(settings, parallel)  # too few devices: refused before --out is touched
    out = Path(out)
    claim_out(out, "bisect", {"prefix": prefix, **asdict(settings)}, BISECTION_FILES, replace)
    log.info("bisect: %d checkpoints, steps %d..%d; a probe builds a proxy and reproduces from it on %d seed(s), "
             "%d probe(s) at a time", len(checkpoints), checkpoints[0].step, checkpoints[-1].step, settings.seeds,
             parallel)
    run = _Probing(checkpoints, out, settings, slots)
    head = {"prefix": prefix, "fail_on": settings.fail_on, "checkpoints": [c.step for c in checkpoints],
            "parallel": parallel}
    try:
        first, probes = search(checkpoints, run.test, good is not None, parallel,
                               run.side_by_side if parallel > 1 else None, run.rounds)
        found = findings(first, probes, checkpoints)
        report = {**head, "status": "complete", **found, **rounds_of(run.rounds, checkpoints),
                  "cost": probes_cost(found, out, settings, store_options)}
    except ProbeFailed as exc:
        report = _stopped(head, run.done, checkpoints, "failed", f"probe step {exc.failure['step']}: {exc}")
        report["failed_probe"] = exc.failure
        _write(out, {**report, "settings": asdict(settings)})
        raise BisectStopped(str(exc), report) from None
    except (KeyboardInterrupt, Stopped, RunsInterrupted):
        signum = stop_children()  # the probes' children are stopped already; none starts after this
        what = (f"probe {len(run.done) + 1} (step {run.current[0].step})" if len(run.current) == 1 else
                f"probes of steps {', '.join(str(c.step) for c in run.current)}" if run.current else "the bisection")
        why = f"interrupted by {signal.Signals(signum).name} during {what}"
        _write(out, {**_stopped(head, run.done, checkpoints, "interrupted", why), "settings": asdict(settings)})
        raise Interrupted(signum, f"{why}; {len(run.done)} finished probe(s) kept; partial report: "
                                  f"{out / 'report.md'}; the same command resumes") from None
    report["settings"] = asdict(settings)
    _write(out, report)
    return report


class _Probing:
    """bisect's probes as the search asks for them: one at a time (`test`), or a round side by
    side (`side_by_side`, each probe with a slot of its own); what finished (`done`), what is in
    flight (`current`) and the rounds (kind, indices) so far."""

    def __init__(self, checkpoints: list, out: Path, settings: ProbeSettings, slots: list[dict[str, str]]):
        self.checkpoints, self.out, self.settings, self.slots = checkpoints, out, settings, slots
        self.done: list[tuple[int, Probe]] = []
        self.current: list = []
        self.rounds: list[tuple[str, list[int]]] = []

    def test(self, i: int, env: dict[str, str] | None = None) -> Probe:
        c = self.checkpoints[i]
        self.current.append(c)
        log.info("probe %d: step %d (%s)", len(self.done) + len(self.current), c.step, c.uri)
        p = probe(c, self.out, self.settings, env) if env else probe(c, self.out, self.settings)
        self.current.remove(c)
        self.done.append((i, p))
        log.info("probe %d: step %d: %s%s", len(self.done), p.step, said(p), " (reused)" if p.reused else "")
        return p

    def side_by_side(self, indices: list[int], test) -> list[Probe]:
        """A round's probes at once, each in a thread with its own slot (processes.run_each: an
        interrupt stops them all and starts none after)."""
        got: dict[int, Probe] = {}
        log.info("round %d (%s): step(s) %s%s", len(self.rounds), self.rounds[-1][0] if self.rounds else "",
                 ", ".join(str(self.checkpoints[i].step) for i in indices), " side by side" * (len(indices) > 1))
        run_each(indices, self.slots[:len(indices)], lambda i, env: test(i, env), got.__setitem__)
        return [got[i] for i in indices]


def probes_cost(found: dict, out: Path, s: ProbeSettings, store_options: dict | None = None) -> dict | None:
    """report.json's `cost`: the probes' runs by sizing's RUN_COST_RULE (each run's completed
    steps x the proxy's device-hours per step at the runs' precision), priced by the plan of the
    first bad probe's proxy (else the last probed: every probe's proxy has the same counts);
    reused probes are counted. None when nothing can be priced (no probe, no fixed count)."""
    from moe_proxy.sizing import RUN_COST_RULE, run_device_hours

    plan = pricing_plan(found, out, s, store_options)
    if plan is None:
        return None
    per_step = plan.proxy.device_hours_per_step
    steps = [o.get("steps_completed", 0) for p in found["probes"] for o in p["seeds"].values()]
    return {"devices": plan.proxy.devices, "accelerator": plan.accelerator, "precision": plan.precision,
            "device_hours_per_step": per_step, "original_device_hours_per_step": plan.original.device_hours_per_step,
            "original_devices": plan.original.devices, "probes": len(found["probes"]), "runs": len(steps),
            "steps": sum(steps), "device_hours": sum(run_device_hours(per_step, n) for n in steps),
            "model": RUN_COST_RULE}


def pricing_plan(found: dict, out: Path, s: ProbeSettings, store_options: dict | None = None,
                 precision: str | None = None):
    """The plan a bisection's runs are priced by (probe_plan): that of its first bad probe's
    proxy, else its last probed (`found`: findings, or a report holding them; `out`: its --out),
    at `precision` (default the probes' runs'). None: no probe, or no fixed expert count."""
    if not found["probes"]:
        return None
    priced = found["first_bad"] or found["probes"][-1]
    return probe_plan(priced["checkpoint"], s, store_options, out / "probes" / f"step-{priced['step']}" / "proxy",
                      precision)


def rounds_of(rounds: list[tuple[str, list[int]]], checkpoints: list) -> dict:
    """report.json's rounds (each: its kind and steps), their count and the search rounds among
    them: the probes of a round run side by side, so the wall time goes by rounds, the
    device-hours (`cost`) by the probes' runs."""
    return {"rounds": len(rounds), "search_rounds": sum(kind == "search" for kind, _ in rounds),
            "round_list": [{"round": n, "kind": kind, "steps": [checkpoints[i].step for i in r]}
                           for n, (kind, r) in enumerate(rounds, 1)]}


def _stopped(head: dict, done: list[tuple[int, Probe]], checkpoints: list, status: str, why: str) -> dict:
    """The partial report of a bisection that stopped: the probes so far, no answer."""
    found = findings(None, done, checkpoints)
    return {**head, "status": status, "stopped": why, **found, "first_bad": None,
            "boundary": f"not found: the bisection stopped ({why}) after {len(done)} probe(s)"}


def _write(out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(_markdown(report))


def said(p: Probe) -> str:
    """A probe's verdict in a few words."""
    head = f"{p.signature} at step {p.onset}" if p.reproduced else p.state
    return f"{head} ({p.note})" if p.note else head


def where(first_bad: dict | None) -> str:
    return f"step {first_bad['step']} ({first_bad['checkpoint']})" if first_bad else "none"


def rounds_line(r: dict) -> str:
    """The rounds and their cost in one line (stdout and report.md)."""
    probes = sum(len(x["steps"]) for x in r.get("round_list", []))
    line = (f"{r['rounds']} round(s) of probes ({r['search_rounds']} search round(s)), {probes} probe(s), "
            f"at most {r.get('parallel', 1)} at a time")
    if c := r.get("cost"):
        line += f"; {cost_said(c)}"
    return line


def cost_said(c: dict) -> str:
    """A `cost` (probes_cost) in words."""
    return (f"{c['device_hours']:.4g} device-hours: {c['runs']} run(s), {c['steps']} step(s) completed x "
            f"{c['device_hours_per_step']:.4g} ({c['devices']} device(s), {c['accelerator']}, {c['precision']}) "
            f"by {c['model']}")


def _markdown(r: dict) -> str:
    lines = [f"# Bisection: {r['fail_on']} over {r['prefix']}", ""]
    if r["status"] != "complete":
        lines += [f"**Stopped before an answer** ({r['status']}): {r['stopped']}. The probes so far are below; "
                  "rerun the same command to resume (finished probes are reused).", ""]
    lines += [f"First bad checkpoint: {where(r['first_bad'])}; "
              f"{r['boundary']}. {r['builds']} probe builds over {len(r['checkpoints'])} checkpoints.", "",
              *([rounds_line(r) + ": " + "; ".join(f"{x['kind']} {', '.join(map(str, x['steps']))}"
                                                   for x in r["round_list"]) + ".", ""] if "rounds" in r else [])]
    if r["inconclusive"]:
        lines += ["**Could not judge**: " + "; ".join(f"step {c['step']} ({c['why']})" for c in r["inconclusive"])
                  + ". Rerun with more steps or other seeds to judge them.", ""]
    if not r["monotone"]:
        lines += ["**Not monotone**: " + "; ".join(r["not_monotone"]) + ". One probe per checkpoint decides "
                  "nothing then: rerun with more steps or more seeds (--seeds).", ""]
    if reused := [str(p["step"]) for p in r["probes"] if p["reused"]]:
        lines += [f"Reused (same checkpoint content, moe-proxy version and flags): the probes of step(s) "
                  f"{', '.join(reused)}.", ""]
    lines += ["| probe | step | verdict | onset | note |", "|---|---|---|---|---|"]
    lines += [f"| {n} | {p['step']} | {p['state']} | {p['onset'] if p['onset'] is not None else '-'} | "
              f"{p['note'] or ''} |" for n, p in enumerate(r["probes"], 1)]
    if failed := r.get("failed_probe"):
        lines += ["", f"## The probe that failed: step {failed['step']}, {failed['what']}", "",
                  f"{failed['error']}", "", f"Its log, `{failed['log']}`, ends:", "", "```",
                  *failed["log_tail"], "```"]
    return "\n".join(lines) + "\n"
