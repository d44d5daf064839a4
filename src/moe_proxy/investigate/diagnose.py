"""`moe-proxy diagnose`: which fix cures a reproduced failure. The failing run (the baseline:
`moe-proxy repro` with the user's flags) and each candidate (the baseline plus a candidate's
flags, `catalogue.py`) run on the same proxy, steps and seeds; each candidate gets a verdict.

Data flows one way: `plan_diagnosis` (check every variant's flags with repro's own parser,
before anything runs) -> `run_all` (each run is a `moe-proxy repro` process in
`DIR/runs/<variant>/seed-<s>/`, P at a time, a finished run with the same arguments reused) ->
`judge` (verdicts and costs, pure) -> `write_report` (report.json, report.md, matrix.png,
curves.png).

The baseline runs first: when it reproduces on no seed there is nothing to cure, and no
candidate runs (report.json's `stopped` says so; the CLI exits 3).

Verdicts, per candidate (`verdict`): the failure asked for is judged on the seeds where the
baseline reproduced; every other finding (another failure, a run stopped early) on any seed:
- fixed: on every such seed the candidate ran past the baseline's onset without the failure,
  and no seed shows another failure or stopped early;
- fixed-but: as fixed, but some seed shows another failure or stopped early (the note says
  which, e.g. "collapse at step 3 on seeds 0, 1"): a trade, not a clean cure;
- reproduced: the failure came back on some seed ("delayed" when later than the baseline's on
  every seed where both failed);
- no-change: the candidate's settings are the baseline's (its runs are a check of the method);
- inconclusive: the baseline reproduced on no seed, or a candidate's run stopped before the
  baseline's onset on a seed where the baseline failed (the note says what stopped it);
- error: a run of the candidate failed to run (its message kept);
- not-run: the baseline reproduced on no seed, so the candidate was not run.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import statistics
import threading
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

from moe_proxy.errors import BaselineFailed, MoeProxyError
from moe_proxy.investigate.catalogue import Fix
from moe_proxy.options import flag, option
from moe_proxy.rl.config import ReproConfig
from moe_proxy.rl.run_options import repro_settings
from moe_proxy.investigate.processes import (Cancelled, Interrupted, Recipe, RunsInterrupted, cancel, claim_out,
                                             content_key, reusable, run_each, run_recorded)
from moe_proxy.metrics.verdict import COST_SERIES

log = logging.getLogger(__name__)

BASELINE = "baseline"
RUN_RECORD = "diagnose-run.json"  # a run's arguments and outcome: what a rerun reuses
OUTPUTS = ("runs", "report.json", "report.md", "matrix.png", "curves.png")  # what a diagnosis writes in --out
FIXED, FIXED_BUT, REPRODUCED_AGAIN, NO_CHANGE, INCONCLUSIVE, ERROR, NOT_RUN = (
    "fixed", "fixed-but", "reproduced", "no-change", "inconclusive", "error", "not-run")
VERDICTS = (FIXED, FIXED_BUT, REPRODUCED_AGAIN, NO_CHANGE, INCONCLUSIVE, ERROR, NOT_RUN)
COST_METRICS = {k: COST_SERIES[k] for k in ("reward", "loss")}
# repro's options a diagnosis sets on each run itself, never the user's (by name): the failure
# asked for, the Job's log, the progress bar; with repro's --out, where it writes.
RUN_OPTIONS = ("fail_on", "termination_log", "no_progress")
RUN_FLAGS = ("--out", *map(flag, RUN_OPTIONS))
# A candidate may not set these either: each run's seed and the ranks' wiring are the baseline's
# (with them a candidate is no longer the failing run plus one fix). The CLI and the operator
# refuse a candidate that gives one.
OWN_FLAGS = RUN_FLAGS + tuple(map(flag, ("seed", "nnodes", "node_rank", "nproc_per_node", "master_addr",
                                         "master_port")))


@dataclass
class Seeds:
    """--seeds: runs per variant (diagnose) or per probe (bisect), on repro's --seed, --seed+1, ..."""

    seeds: int = option(2, "int", "sampling seeds per variant, from repro's --seed on", metavar="N",
                        cli_only="a Diagnosis's spec.seeds")


@dataclass
class AtOnce:
    """How a diagnosis (or a bisection) spends its runs: how many at once, and whether a
    candidate's every seed runs after one reproduced."""

    parallel: int = option(1, "int", "runs at a time (local processes; with --device cuda/npu each gets devices of "
                           "its own, as many as it has ranks)", metavar="P", minimum=1,
                           cli_only="a Diagnosis's spec.parallelism")
    all_seeds: bool = option(False, "bool", "run every seed of every candidate (the full matrix): by default a "
                             "candidate that reproduced on one seed is `reproduced` whatever its other seeds do, "
                             "so they are not started (those running are stopped)", cli_only="a Diagnosis's "
                             "spec.allSeeds")


@dataclass(frozen=True)
class Variant:
    name: str
    flags: list[str]  # repro flags added to the baseline's
    what: str = ""
    changes: dict = field(default_factory=dict)  # ReproConfig fields that differ from the baseline's
    steps: int = 0  # its own --steps (a candidate may change them): judged on those


@dataclass
class Diagnosis:
    """What a diagnosis runs: the proxy, the baseline's repro flags, the variants and seeds."""

    proxy: str
    out: Path
    fail_on: str
    repro_flags: list[str]
    seeds: list[int]
    baseline: ReproConfig
    variants: list[Variant]  # the baseline first
    inputs: dict[str, str] = field(default_factory=dict)  # what the runs read (proxy, --prompts) -> content key
    # variant -> seed -> why it did not run to its end: "not run: reproduced on seed N" (never
    # started) or "stopped: reproduced on seed N" (stopped while running); run_all fills it
    skipped: dict[str, dict[int, str]] = field(default_factory=dict)

    def run_dir(self, variant: str, seed: int) -> Path:
        return self.out / "runs" / variant / f"seed-{seed}"

    def recipe(self, variant: Variant, seed: int) -> Recipe:
        """What makes one run: its record is reused only when all of it is the same."""
        return Recipe(self.argv(variant, seed), self.inputs)

    def settings(self) -> dict:
        """What makes a diagnosis (its baseline and seeds): another one into the same --out is
        refused (claim_out). Other candidates extend the same one: the report covers those asked
        for, the others' runs stay (a record names its flags: one of them is reused only as it was)."""
        return {"PROXY": self.proxy, "--fail-on": self.fail_on, "repro options": self.repro_flags, "seeds": self.seeds}

    def argv(self, variant: Variant, seed: int) -> list[str]:
        """The `moe-proxy repro` arguments of one run (the seed and the failure asked for last)."""
        return ["repro", self.proxy, "--out", str(self.run_dir(variant.name, seed)), *self.repro_flags,
                *variant.flags, "--seed", str(seed), "--fail-on", self.fail_on, "--no-progress"]


@dataclass
class SeedRun:
    """One run, as its summary.json says (reproduced None: it failed to run)."""

    reproduced: bool | None
    signature: str | None = None
    step: int | None = None
    steps: int = 0  # steps completed
    stopped: str = ""
    others: dict[str, int] = field(default_factory=dict)  # failures seen that were not asked for
    error: str | None = None
    wall_s: float = 0.0
    reused: bool = False  # the record of the same run made before (processes.Recipe), not run again

    def as_json(self) -> dict:
        out = {"reproduced": self.reproduced, "signature": self.signature, "step": self.step,
               "steps_completed": self.steps}
        if self.reused:
            out["reused"] = True
        if self.stopped and self.stopped != "completed":
            out["stopped"] = self.stopped
        if self.others:
            out["also_seen"] = self.others
        if self.error:
            out["error"] = self.error
        return out


# --- plan: every variant's flags checked by repro's own parser ------------------------------


def repro_config(flags: list[str]) -> ReproConfig:
    """The RL settings `moe-proxy repro PROXY <flags>` would run with; bad flags raise MoeProxyError."""
    return repro_settings(flags).config


def plan_diagnosis(proxy: str, out: str | Path, fail_on: str, repro_flags: list[str], candidates: list[Fix],
                   seeds: int) -> Diagnosis:
    from moe_proxy.metrics.detect import Signature
    from moe_proxy.rl.source import check_source

    if seeds < 1:
        raise MoeProxyError(f"--seeds {seeds}: at least 1")
    if not candidates:
        raise MoeProxyError("no candidates: give --candidates NAME,... (see --list) or --candidate NAME=--flag value")
    names = [c.name for c in candidates]
    if dupes := {n for n in names if names.count(n) > 1} | ({BASELINE} & set(names)):
        raise MoeProxyError(f"candidate name(s) {', '.join(map(repr, sorted(dupes)))}: used twice (or reserved)")
    Signature.parse(fail_on)
    if own := [f for f in repro_flags if f.split("=")[0] in RUN_FLAGS]:
        raise MoeProxyError(f"{', '.join(own)}: diagnose's own, set on each run: give the repro options only")
    check_source(proxy)
    try:
        given = repro_settings(repro_flags)
    except MoeProxyError as exc:
        raise MoeProxyError(f"the baseline's repro options: {exc}") from None
    baseline = given.config
    if given.run.device:  # this torch and machine have it (torch loads here, once)
        from moe_proxy.rl.device import pick_device

        pick_device(given.run.device)
    variants = [Variant(BASELINE, [], "the failing run, as given", steps=baseline.steps)]
    for c in candidates:
        flags = c.changes(baseline)
        if own := [f for f in flags if f.split("=")[0] in OWN_FLAGS]:
            raise MoeProxyError(f"candidate {c.name!r}: {', '.join(own)}: diagnose's own (it sets each run's seed, "
                                "ranks, failure and directory): give the fix's flags only")
        try:
            config = repro_config([*repro_flags, *flags])
        except MoeProxyError as exc:
            raise MoeProxyError(f"candidate {c.name!r} ({' '.join(flags)}): repro refuses it: {exc}") from None
        variants.append(Variant(c.name, flags, c.what, changed_settings(baseline, config), config.steps))
    first = baseline.seed
    return Diagnosis(proxy, Path(out), fail_on, list(repro_flags), list(range(first, first + seeds)), baseline,
                     variants, _inputs(proxy, [[*repro_flags, *v.flags] for v in variants]))


def _inputs(proxy: str, runs_flags: list[list[str]]) -> dict[str, str]:
    """What the runs read, each with its content key: the proxy and any --prompts file."""
    prompts = {repro_settings(flags).run.prompts for flags in runs_flags}
    return {where: content_key(where) for where in [proxy, *sorted(p for p in prompts if p)]}


def _flat(config: ReproConfig) -> dict:
    d = config.to_dict()
    faults = d.pop("faults")
    return d | {f"faults.{k}": v for k, v in faults.items()}


# What sets the learning rate of each step (ReproConfig.lr_at): a change to these that leaves
# every step's rate as it was (e.g. --warmup-steps 1: step 0 at the full rate) changes nothing.
LR_FIELDS = ("lr", "warmup_steps", "lr_schedule", "faults.lr_spike_step", "faults.lr_spike_factor")


def changed_settings(baseline: ReproConfig, config: ReproConfig) -> dict:
    """The settings `config` changes from the baseline's (flat: faults.NAME), without those that
    change nothing in the run ({}: the baseline again under another name)."""
    base = _flat(baseline)
    out = {k: v for k, v in _flat(config).items() if base.get(k) != v}
    steps = range(max(baseline.steps, config.steps))
    if all(baseline.lr_at(s) == config.lr_at(s) for s in steps):
        out = {k: v for k, v in out.items() if k not in LR_FIELDS}
    return out


# --- run: one `moe-proxy repro` process per variant and seed -------------------------------


def run_all(d: Diagnosis, parallel: int = 1, variants: list[Variant] | None = None,
            all_seeds: bool = True) -> dict[str, dict[int, SeedRun]]:
    """Every variant (or those given) on every seed, `parallel` processes at a time, each on
    devices no other running run holds (run_slots). Unless `all_seeds`, a candidate that changes
    something and reproduced on one seed stops there (early_stop): its queued seeds are not
    started, its running ones stopped, each named in `d.skipped`. Interrupted (SIGINT, or SIGTERM
    within processes.signals_interrupt): no queued run starts, the running ones are stopped, a
    partial report is written, and Interrupted says what was stopped."""
    variants = d.variants if variants is None else variants
    jobs = [(v, s) for v in variants for s in d.seeds]
    results: dict[str, dict[int, SeedRun | None]] = {v.name: {} for v in variants}
    slots = run_slots(d, parallel)
    threads = max(1, (os.cpu_count() or 1) // parallel)
    stop = None if all_seeds else _EarlyStop(d)
    log.info("diagnose: %d runs (%d variants x %d seeds), %d at a time, in %s", len(jobs), len(variants),
             len(d.seeds), parallel, d.out / "runs")

    def finished(job: tuple[Variant, int], outcome: SeedRun | None) -> None:
        v, s = job
        results[v.name][s] = outcome
        said = d.skipped[v.name][s] if outcome is None else \
            ("reused: " if outcome.reused else "") + _said(outcome, d.fail_on)
        log.info("[%d/%d] %s seed %d: %s", sum(map(len, results.values())), len(jobs), v.name, s, said)

    try:
        run_each(jobs, slots, lambda job, env: _run(d, *job, env, threads, stop), finished)
    except RunsInterrupted as interrupt:
        raise _interrupted(d, interrupt) from None
    return {name: {s: o for s, o in runs.items() if o is not None} for name, runs in results.items()}


class _EarlyStop:
    """A candidate's first reproducing seed decides its verdict (`reproduced`): its other seeds
    cannot change it, so none of them starts after it and those running are stopped
    (processes.cancel). Not the baseline's (its every seed decides the onsets and which seeds
    judge the candidates) nor a no-change candidate's (its runs are the method's own check)."""

    def __init__(self, d: Diagnosis):
        self.d, self.reproduced_on, self.lock = d, {}, threading.Lock()
        self.tags = {v.name: f"diagnose {uuid.uuid4().hex} {v.name}" for v in d.variants}

    def applies(self, v: Variant) -> bool:
        return v.name != BASELINE and bool(v.changes)

    def skip(self, v: Variant, seed: int, started: bool) -> None:
        with self.lock:
            self.d.skipped.setdefault(v.name, {})[seed] = \
                f"{'stopped' if started else 'not run'}: reproduced on seed {self.reproduced_on[v.name]}"

    def before(self, v: Variant) -> bool:
        """Whether the run may start (False: its candidate reproduced already)."""
        return not self.applies(v) or v.name not in self.reproduced_on

    def after(self, v: Variant, seed: int, outcome: SeedRun) -> None:
        if self.applies(v) and outcome.reproduced:
            with self.lock:
                first = v.name not in self.reproduced_on
                self.reproduced_on.setdefault(v.name, seed)
            if first and (running := cancel(self.tags[v.name])):
                log.info("%s reproduced on seed %d: %d running seed(s) of it stopped", v.name, seed, running)


def run_slots(d: Diagnosis, parallel: int) -> list[dict[str, str]]:
    """The device environment of each of `parallel` concurrent runs: as many devices as a run has
    ranks (--nproc-per-node), none shared (device.slot_envs); nothing set when one run has the
    machine. Bad input (too few devices) raises before anything runs."""
    if parallel == 1:
        return [{}]
    from moe_proxy.rl.device import device_slots

    settings = repro_settings(d.repro_flags)
    return device_slots(settings.run.device, settings.placement.nproc_per_node or 1, parallel)


def _said(o: SeedRun, fail_on: str) -> str:
    if o.reproduced is None:
        return f"error: {o.error}"
    others = "".join(f"; {name} at step {step}" for name, step in o.others.items())  # never a run read as clean
    if o.reproduced:
        return f"{o.signature} at step {o.step}{others}"
    return f"no {fail_on} in {o.steps} steps" + (f" ({o.stopped})" if o.stopped != "completed" else "") + others


def _run(d: Diagnosis, variant: Variant, seed: int, env: dict[str, str], threads: int,
         stop: _EarlyStop | None = None) -> SeedRun | None:
    """One run, or the record of the same run made before (processes.Recipe), with `env`'s devices;
    None when `stop` says its candidate reproduced already (not started, or stopped: d.skipped)."""
    if stop is not None and not stop.before(variant):
        stop.skip(variant, seed, started=False)
        return None
    directory = d.run_dir(variant.name, seed)
    env = dict(env)
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(threads)
    r = d.recipe(variant, seed)
    try:
        ran = run_recorded(r.argv, directory, RUN_RECORD, "repro.log", env, done="summary.json", inputs=r.inputs,
                           tag=stop.tags[variant.name] if stop is not None else None)
    except Cancelled:
        stop.skip(variant, seed, started=True)
        return None
    outcome = seed_outcome(directory, ran.returncode, ran.error, ran.wall_s, ran.reused)
    if stop is not None:
        stop.after(variant, seed, outcome)
    return outcome


def _interrupted(d: Diagnosis, stop: RunsInterrupted) -> Interrupted:
    """Write the partial report (the runs that finished, in this call or before) and say what was
    interrupted."""
    finished = {v.name: {s: seed_outcome(d.run_dir(v.name, s), 0, None, rec.get("wall_s", 0.0)) for s in d.seeds
                         if (rec := reusable(d.run_dir(v.name, s), RUN_RECORD, d.recipe(v, s), "summary.json"))}
                for v in d.variants}
    stopped = [f"{v.name} seed {s}" for v, s in stop.stopped]
    done = {v.name: {*finished[v.name], *d.skipped.get(v.name, {})} for v in d.variants}  # left out: early stop
    not_started = [f"{v.name} seed {s}" for v in d.variants for s in d.seeds  # queued, or never queued
                   if s not in done[v.name] and f"{v.name} seed {s}" not in stopped]
    interrupted = {"signal": signal.Signals(stop.signum).name, "stopped": stopped, "not_started": not_started,
                   "finished_runs": sum(map(len, finished.values()))}
    complete = [v for v in d.variants if len(done[v.name]) == len(d.seeds)]
    if complete and complete[0].name == BASELINE:
        partial = replace(d, variants=complete)
        report = judge(partial, {v.name: finished[v.name] for v in complete}) | {"interrupted": interrupted}
        write_report(partial, report)
    else:  # no baseline to judge against: the runs that finished, as they are
        d.out.mkdir(parents=True, exist_ok=True)
        report = {"proxy": d.proxy, "fail_on": d.fail_on, "interrupted": interrupted,
                  "runs": {n: {str(s): o.as_json() for s, o in runs.items()} for n, runs in finished.items() if runs}}
        (d.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        (d.out / "report.md").write_text(f"# Diagnosis interrupted: {d.fail_on} on {d.proxy}\n\n"
                                         f"{_interrupted_line(interrupted)}\n")
    return Interrupted(stop.signum, f"interrupted by {interrupted['signal']}: {_interrupted_line(interrupted)}; "
                                    f"partial report: {d.out / 'report.md'}; the same command resumes")


def _interrupted_line(i: dict) -> str:
    return (f"stopped {', '.join(i['stopped']) or 'no running run'}; {len(i['not_started'])} run(s) not started; "
            f"{i['finished_runs']} finished run(s) kept")


def seed_outcome(directory: Path, code: int, error: str | None, wall: float, reused: bool = False) -> SeedRun:
    """One repro run's outcome from its exit code and summary.json (diagnose's runs, bisect's probes)."""
    summary_file = directory / "summary.json"
    if code != 0 or not summary_file.is_file():
        return SeedRun(None, error=error or f"exit code {code}, no summary.json", wall_s=wall)
    s = json.loads(summary_file.read_text())
    if why := (s.get("cannot_show") or {}).get(s.get("fail_on")):
        # e.g. collapse on a proxy keeping <= top-k experts: neither its clean run nor a threshold on
        # a load share that every token saturates says anything; the run cannot judge, as if it failed
        return SeedRun(None, error=f"{s['fail_on']} cannot show in this run: {why}", wall_s=wall, reused=reused)
    first = s.get("first_failure") or {}
    reproduced = bool(s.get("reproduced"))
    asked = first.get("signature") if reproduced else None
    others = {name: onset["step"] for name, onset in (s.get("failures") or {}).items() if name != asked}
    return SeedRun(reproduced, asked, first.get("step") if reproduced else None, int(s.get("steps_completed", 0)),
                   s.get("stopped", ""), others, wall_s=wall, reused=reused)


# --- judge: verdicts and what each fix costs (pure) -----------------------------------------


def verdict(baseline: dict[int, SeedRun], candidate: dict[int, SeedRun], steps: int,
            changed: bool = True) -> tuple[str, str]:
    """(verdict, note) of one candidate against the baseline, seed by seed (module doc); `steps`:
    the candidate's own, `changed`: whether its settings differ from the baseline's."""
    failed = {s: o.error for s, o in candidate.items() if o.reproduced is None}
    if failed:
        return ERROR, "; ".join(f"seed {s}: {e}" for s, e in sorted(failed.items()))
    if not changed:
        return NO_CHANGE, _as_baseline(baseline, candidate)
    judged = sorted(s for s, o in baseline.items() if o.reproduced)
    if not judged:
        return INCONCLUSIVE, "the baseline did not reproduce on any seed: nothing to cure"
    others = "; ".join(findings(candidate, steps))
    back = {s: o.step for s, o in candidate.items() if o.reproduced}
    if back:
        both = [s for s in back if s in judged]
        later = bool(both) and all(back[s] > baseline[s].step for s in both)
        said = ("delayed: " if later else "") + ", ".join(f"seed {s} step {t}" for s, t in sorted(back.items()))
        return REPRODUCED_AGAIN, said + (f"; also {others}" if others else "")
    short = [s for s in judged if candidate[s].steps <= baseline[s].step]  # stopped before the onset: no cure seen
    if short:
        return INCONCLUSIVE, "; ".join([*(f"seed {s} did not get past the baseline's onset at step {baseline[s].step}"
                                          + (f" in its {steps} steps" if candidate[s].steps == steps else "")
                                          for s in short), *([others] if others else [])])
    if others:
        return FIXED_BUT, f"{others} (no {_asked(baseline)} on {_seeds(judged)})"
    return FIXED, f"ran all {steps} steps on {_seeds(judged)}"


def findings(runs: dict[int, SeedRun], steps: int) -> list[str]:
    """What a variant's runs show besides the failure asked for, on any seed: each other failure
    at its onset, with the seeds that show it, and each run that stopped before its `steps`."""
    seen: dict[tuple[int, str], list[int]] = {}
    for s, o in sorted(runs.items()):
        for name, step in o.others.items():
            seen.setdefault((step, name), []).append(s)
    out = [f"{name} at step {step} on {_seeds(seeds)}" for (step, name), seeds in sorted(seen.items())]
    return out + [f"{_seeds([s])} stopped after {o.steps} of {steps} steps" + ("" if o.others else f" ({o.stopped})")
                  for s, o in sorted(runs.items()) if o.reproduced is False and o.steps < steps]


def _seeds(seeds: list[int]) -> str:
    return f"seed{'s' * (len(seeds) > 1)} {', '.join(map(str, seeds))}"


def _asked(baseline: dict[int, SeedRun]) -> str:
    return next(o.signature for o in baseline.values() if o.reproduced)


def _as_baseline(baseline: dict[int, SeedRun], candidate: dict[int, SeedRun]) -> str:
    """A no-change candidate's note: its runs should be the baseline's (the method's own check)."""
    def outcome(o: SeedRun | None) -> tuple:
        return (None,) if o is None else (o.reproduced, o.step, o.steps)

    differ = [s for s in sorted(candidate) if outcome(candidate[s]) != outcome(baseline.get(s))]
    ends = ", ".join(f"seed {s} {f'step {o.step}' if o.reproduced else 'clean'}" for s, o in sorted(candidate.items()))
    if not differ:
        return f"changes none of the baseline's settings; its runs end as the baseline's ({ends})"
    return (f"changes none of the baseline's settings, yet its runs ({ends}) differ from the baseline's on "
            f"{_seeds(differ)}: the runs are not deterministic here, so no verdict can be trusted")


def _rows(directory: Path) -> dict[int, dict[str, float]]:
    from moe_proxy.metrics.readers import read_metrics

    try:
        return read_metrics(directory / "metrics.jsonl")
    except (MoeProxyError, OSError):
        return {}


def cost_window(baseline: dict[int, SeedRun], steps: int) -> tuple[int, int]:
    """The steps over which reward and loss are compared (first, last, both included): up to and
    including the baseline's first onset (never empty), or the whole run when it did not fail."""
    onsets = [o.step for o in baseline.values() if o.reproduced]
    return 0, min(onsets) if onsets else steps - 1


def cost(d: Diagnosis, name: str, window: tuple[int, int], timed: bool) -> dict:
    """`cost_of` over the variant's seeds (each metrics file read once)."""
    return cost_of([_rows(d.run_dir(name, s)) for s in d.seeds], window, timed)


def cost_of(runs: list[dict[int, dict[str, float]]], window: tuple[int, int], timed: bool = True) -> dict:
    """Mean reward and loss over the steps of `window` and time per step (mean and standard
    deviation over every step; None when not `timed`: runs that shared the machine), over the
    seeds' metrics rows (pure: the operator's Diagnosis gives the rows its runs' termination
    messages carry, verdict.series_rows)."""
    def values(metric: str, within: tuple[int, int] | None) -> list[float]:
        return [v for rows in runs for step, row in rows.items()
                if (within is None or within[0] <= step <= within[1])
                and isinstance(v := row.get(metric), (int, float)) and v == v]

    out: dict = {f"{k}_mean": statistics.fmean(v) if (v := values(metric, window)) else None
                 for k, metric in COST_METRICS.items()}
    times = values(COST_SERIES["time"], None) if timed else []
    out["time_per_step_s"] = statistics.fmean(times) if times else None
    out["time_per_step_sd"] = statistics.stdev(times) if len(times) > 1 else None
    out["window_first"], out["window_last"] = window  # steps, both included
    return out


def against(c: dict, base: dict) -> dict:
    """A candidate's cost with its differences from the baseline's: reward and loss minus the
    baseline's, time per step as a ratio."""
    out = dict(c)
    for k in COST_METRICS:  # .get: a figure stored as null may come back absent (a JSON merge patch drops it)
        a, b = c.get(f"{k}_mean"), base.get(f"{k}_mean")
        out[f"{k}_vs_baseline"] = a - b if a is not None and b is not None else None
    t, tb = c.get("time_per_step_s"), base.get("time_per_step_s")
    out["time_vs_baseline"] = t / tb if t and tb else None
    return out


def judge(d: Diagnosis, results: dict[str, dict[int, SeedRun]], parallel: int = 1) -> dict:
    """report.json's content; a candidate without results was not run (the baseline first)."""
    base = results[BASELINE]
    window = cost_window(base, d.baseline.steps)
    timed = parallel == 1  # runs that shared the machine time each other, not the fix
    base_cost = cost(d, BASELINE, window, timed)
    report = {
        "proxy": d.proxy, "fail_on": d.fail_on, "steps": d.baseline.steps, "seeds": d.seeds,
        "cost_window": f"steps {window[0]}-{window[1]}" + (" (up to the baseline's first onset)"
                                                            if window[1] < d.baseline.steps - 1 else ""),
        "time_left_out": None if timed else f"{parallel} runs at a time shared the machine",
        "baseline": {"settings": {"flags": d.repro_flags} | _flat(d.baseline),
                     "seeds": {str(s): o.as_json() for s, o in sorted(base.items())}, "cost": base_cost,
                     "findings": findings(base, d.baseline.steps)},
        "candidates": {},
    }
    if not any(o.reproduced for o in base.values()) and len(results) < len(d.variants):  # the candidates not run
        report["stopped"] = (f"the baseline did not reproduce {d.fail_on} on any seed "
                             f"({', '.join(map(str, d.seeds))}) in {d.baseline.steps} steps: nothing to cure")
    for v in d.variants[1:]:
        entry = {"changes": v.changes, "flags": v.flags, "what": v.what, "steps": v.steps}
        if v.name not in results:
            report["candidates"][v.name] = entry | {"verdict": NOT_RUN, "note": "the baseline did not reproduce",
                                                    "seeds": {}, "cost": None}
            continue
        mine = results[v.name]
        name, note = verdict(base, mine, v.steps, changed=bool(v.changes))
        note += left_out_note(d.skipped.get(v.name) or {})
        report["candidates"][v.name] = entry | {
            "verdict": name, "note": note, "seeds": {str(s): o.as_json() for s, o in sorted(mine.items())},
            "cost": against(cost(d, v.name, window, timed), base_cost)} | _not_run(d, v.name)
    report["not_run"] = sum(len(c.get("not_run", {})) for c in report["candidates"].values())
    report["fixed_by"] = [n for n, c in report["candidates"].items() if c["verdict"] == FIXED]
    report["fixed_with_other_failures"] = [n for n, c in report["candidates"].items() if c["verdict"] == FIXED_BUT]
    return report


def left_out_note(skipped: dict[int, str]) -> str:
    """What a verdict's note adds for the seeds left out (its verdict, and a `delayed`, are then
    the seeds' that ran): '; seed 1 not run: reproduced on seed 0'."""
    return "".join(f"; seed {s} {why}" for s, why in sorted(skipped.items()))


def _not_run(d: Diagnosis, name: str) -> dict:
    """A candidate's seeds that did not run to their end because another of its seeds reproduced
    (run_all's early stop): {"not_run": {seed: "not run: reproduced on seed N" or "stopped: ..."}}."""
    skipped = d.skipped.get(name) or {}
    return {"not_run": {str(s): why for s, why in sorted(skipped.items())}} if skipped else {}


# --- report ---------------------------------------------------------------------------------


def write_report(d: Diagnosis, report: dict) -> list[Path]:
    from moe_proxy.metrics.compare import KEY_METRICS, load_run, plot_notes
    from moe_proxy.metrics.plots import plot_curves, plot_matrix

    d.out.mkdir(parents=True, exist_ok=True)
    (d.out / "report.json").write_text(json.dumps(report, indent=2, default=_jsonable) + "\n")
    variants = [(BASELINE, report["baseline"] | {"steps": report["steps"], "verdict": "baseline"}),
                *report["candidates"].items()]
    rows = [(n, {**{int(s): ("none", why.replace(": ", ":\n").replace(" on ", "\non ")) for s, why in
                    v.get("not_run", {}).items()}, **{int(s): _cell(o, v["steps"]) for s, o in v["seeds"].items()}},
             v["verdict"]) for n, v in variants]
    files = [plot_matrix(rows, d.seeds, d.out / "matrix.png", f"{d.fail_on}: verdict per candidate and seed")]
    runs = []
    for name, v in variants:  # the first seed's curves of every variant that ran
        directory = d.run_dir(name, d.seeds[0])
        if v["seeds"] and (directory / "metrics.jsonl").is_file():
            runs.append(load_run(directory, name))
    metrics = [m for m in KEY_METRICS if any(m in row for r in runs for row in r.rows.values())]
    files += plot_curves(runs, metrics, d.out, "curves.png", notes=plot_notes()) if runs else []
    (d.out / "report.md").write_text(_markdown(report, [f.name for f in files]))
    return [d.out / "report.json", d.out / "report.md", *files]


def _cell(o: dict, steps: int) -> tuple[str, str]:
    """(state, text) of one run in the matrix: the failure asked for, else another one (or an
    early stop), else clean."""
    if o["reproduced"] is None:
        return "error", "error"
    if o["reproduced"]:
        return "failed", f"step {o['step']}"
    if seen := o.get("also_seen"):
        name, step = min(seen.items(), key=lambda item: item[1])
        return "other", f"{name} step {step}"
    if o["steps_completed"] < steps:
        return "other", f"stopped {o['steps_completed']}"
    return "clean", f"clean {o['steps_completed']}"


def _fmt(x, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec)


def _time(c: dict, against: bool = False) -> str:
    """Time per step: mean ± standard deviation (`against`: after the ratio to the baseline's)."""
    if c.get("time_per_step_s") is None:
        return "-"
    said = f"{_fmt(c['time_per_step_s'])} ± {_fmt(c.get('time_per_step_sd'), '.2g')} s"
    return f"{_fmt(c.get('time_vs_baseline'), '.2f')} ({said})" if against else said


def _markdown(report: dict, pictures: list[str]) -> str:
    seeds = report["seeds"]
    head = "| candidate | verdict | " + " | ".join(f"seed {s}" for s in seeds) + \
        " | reward (vs baseline) | loss (vs baseline) | time/step (x baseline) | changes |"
    left_out = report.get("time_left_out")
    lines = [f"# Diagnosis: {report['fail_on']} on {report['proxy']}", "",
             *([f"**Stopped: {report['stopped']}.** No candidate was run.", ""] if report.get("stopped") else []),
             *([f"**Interrupted ({i['signal']})**: {_interrupted_line(i)}; the same command resumes.", ""]
               if (i := report.get("interrupted")) else []),
             *([f"Reused (the same proxy content, moe-proxy version and flags): {', '.join(r)}.", ""]
               if (r := reused_runs(report)) else []),
             *([f"Not run: {report['not_run']} run(s) of candidates that had reproduced on another seed (a candidate "
                "that reproduced on one seed is reproduced whatever its other seeds do; --all-seeds runs them all).",
                ""] if report.get("not_run") else []),
             f"{report['steps']} steps per run; seeds {', '.join(map(str, seeds))}. Fixed by: "
             f"{', '.join(report['fixed_by']) or 'none'}. Fixed, but with another failure or an early stop: "
             f"{', '.join(report['fixed_with_other_failures']) or 'none'}.", "",
             f"Reward and loss are means over {report['cost_window']}, every seed. Time per step: "
             + (f"left out ({left_out})." if left_out else "mean ± standard deviation over every step of every seed."),
             "", head, "|" + "---|" * (len(seeds) + 6)]

    def seed_cells(runs: dict, steps: int, not_run: dict | None = None) -> list[str]:
        return [_cell(runs[str(s)], steps)[1] if str(s) in runs else (not_run or {}).get(str(s), "-") for s in seeds]

    b = report["baseline"]
    said = "reproduced" if any(o["reproduced"] for o in b["seeds"].values()) else "not reproduced"
    lines.append(f"| baseline | {said}{'; ' + '; '.join(b['findings']) if b.get('findings') else ''}"
                 f" | {' | '.join(seed_cells(b['seeds'], report['steps']))} | {_fmt(b['cost']['reward_mean'])} | "
                 f"{_fmt(b['cost']['loss_mean'])} | {_time(b['cost'])} | {' '.join(b['settings']['flags'])} |")
    for name, c in report["candidates"].items():
        k = c["cost"] or {}
        lines.append(f"| {name} | **{c['verdict']}** {c['note']} | "
                     f"{' | '.join(seed_cells(c['seeds'], c['steps'], c.get('not_run')))} | "
                     f"{_fmt(k.get('reward_mean'))} ({_fmt(k.get('reward_vs_baseline'), '+.3g')}) | "
                     f"{_fmt(k.get('loss_mean'))} ({_fmt(k.get('loss_vs_baseline'), '+.3g')}) | "
                     f"{_time(k, against=True)} | {' '.join(c['flags'])} |")
    lines += ["", *[f"![{p.removesuffix('.png')}]({p})" for p in pictures], ""]
    return "\n".join(lines)


def reused_runs(report: dict) -> list[str]:
    """'VARIANT seed S' of every run taken from its record instead of run again."""
    variants = {BASELINE: report["baseline"], **report["candidates"]}
    return [f"{name} seed {s}" for name, v in variants.items() for s, o in v["seeds"].items() if o.get("reused")]


def _jsonable(value):
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


def diagnose(proxy: str, out: str | Path, fail_on: str, repro_flags: list[str], candidates: list[Fix],
             seeds: int = 2, parallel: int = 1, baseline_first: bool = True, replace: bool = False,
             all_seeds: bool = False) -> dict:
    """Plan, run, judge and report; returns report.json's content. The baseline runs first: when
    it reproduces on no seed, no candidate runs (`stopped` in the report) unless not
    `baseline_first` (the fidelity lab compares every cell). A candidate that reproduced on one
    seed runs no more of its seeds unless `all_seeds` (run_all; report.json's `not_run`). An
    --out holding another diagnosis is refused unless `replace` (processes.claim_out)."""
    d = plan_diagnosis(proxy, out, fail_on, repro_flags, candidates, seeds)
    parallel = max(1, parallel)
    run_slots(d, parallel)  # too few devices: refused before --out is touched
    claim_out(d.out, "diagnose", d.settings(), OUTPUTS, replace)
    results = run_all(d, parallel, d.variants[:1])
    base = results[BASELINE]
    if all(o.reproduced is None for o in base.values()):
        raise BaselineFailed(f"the baseline failed to run on every seed: {base[d.seeds[0]].error} "
                             f"(see {d.run_dir(BASELINE, d.seeds[0]) / 'repro.log'})")
    if any(o.reproduced for o in base.values()) or not baseline_first:
        results |= run_all(d, parallel, d.variants[1:], all_seeds=all_seeds)
    else:
        log.info("diagnose: the baseline did not reproduce %s on any seed: no candidate runs", fail_on)
    report = judge(d, results, parallel)
    write_report(d, report)
    return report
