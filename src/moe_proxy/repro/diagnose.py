"""`moe-proxy diagnose`: which fix cures a reproduced failure. The failing run (the baseline:
`moe-proxy repro` with the user's flags) and each candidate (the baseline plus a candidate's
flags, `catalogue.py`) run on the same proxy, steps and seeds; each candidate gets a verdict.

Data flows one way: `plan_diagnosis` (check every variant's flags with repro's own parser,
before anything runs) -> `run_all` (each run is a `moe-proxy repro` process in
`DIR/runs/<variant>/seed-<s>/`, P at a time, a finished run with the same arguments reused) ->
`judge` (verdicts and costs, pure) -> `write_report` (report.json, report.md, matrix.png,
curves.png).

Verdicts, per candidate, over the seeds where the baseline reproduced:
- fixed: on every such seed the candidate ran all the steps without the failure;
- reproduced: the failure came back on some seed ("delayed" when later than the baseline's on
  every seed where both failed);
- inconclusive: the baseline reproduced on no seed, or a run stopped early for another reason
  (another failure, e.g. NaN while divergence was asked for);
- error: a run of the candidate failed to run (its message kept).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from moe_proxy.errors import BaselineFailed, MoeProxyError
from moe_proxy.repro.catalogue import Fix
from moe_proxy.repro.config import ReproConfig
from moe_proxy.repro.processes import parse_as, run_recorded
from moe_proxy.repro.verdict import COST_SERIES

log = logging.getLogger(__name__)

BASELINE = "baseline"
RUN_RECORD = "diagnose-run.json"  # a run's arguments and outcome: what a rerun reuses
VERDICTS = ("fixed", "reproduced", "inconclusive", "error")
COST_METRICS = {k: COST_SERIES[k] for k in ("reward", "loss")}
# repro's flags a diagnosis sets on each run itself, never the user's: where it writes, the
# failure asked for, the Job's log, the progress bar.
RUN_FLAGS = ("--out", "--fail-on", "--termination-log", "--no-progress")
# A candidate may not set these either: each run's seed and the ranks' wiring are the baseline's
# (with them a candidate is no longer the failing run plus one fix). The CLI and the operator
# refuse a candidate that gives one.
OWN_FLAGS = RUN_FLAGS + ("--seed", "--nnodes", "--node-rank", "--nproc-per-node", "--master-addr", "--master-port")


@dataclass(frozen=True)
class Variant:
    name: str
    flags: list[str]  # repro flags added to the baseline's
    what: str = ""
    changes: dict = field(default_factory=dict)  # ReproConfig fields that differ from the baseline's


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

    def run_dir(self, variant: str, seed: int) -> Path:
        return self.out / "runs" / variant / f"seed-{seed}"

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

    def as_json(self) -> dict:
        out = {"reproduced": self.reproduced, "signature": self.signature, "step": self.step,
               "steps_completed": self.steps}
        if self.others:
            out["also_seen"] = self.others
        if self.error:
            out["error"] = self.error
        return out


# --- plan: every variant's flags checked by repro's own parser ------------------------------


def repro_config(proxy: str, flags: list[str]) -> ReproConfig:
    """The settings `moe-proxy repro PROXY <flags>` would run with; bad flags raise MoeProxyError."""
    from moe_proxy.commands import repro as repro_command

    args = parse_as("repro", [proxy, "--out", os.devnull, *flags])
    try:
        return repro_command.config_from_args(args)
    except argparse.ArgumentTypeError as exc:
        raise MoeProxyError(str(exc)) from None


def plan_diagnosis(proxy: str, out: str | Path, fail_on: str, repro_flags: list[str], candidates: list[Fix],
                   seeds: int) -> Diagnosis:
    from moe_proxy.repro.detect import Signature
    from moe_proxy.repro.source import check_source

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
        baseline = repro_config(proxy, repro_flags)
    except MoeProxyError as exc:
        raise MoeProxyError(f"the baseline's repro options: {exc}") from None
    if "--device" in repro_flags[:-1]:  # this torch and machine have it (torch loads here, once)
        from moe_proxy.repro.device import pick_device

        pick_device(repro_flags[repro_flags.index("--device") + 1])
    variants = [Variant(BASELINE, [], "the failing run, as given")]
    base = _flat(baseline)
    for c in candidates:
        flags = c.changes(baseline)
        if own := [f for f in flags if f.split("=")[0] in OWN_FLAGS]:
            raise MoeProxyError(f"candidate {c.name!r}: {', '.join(own)}: diagnose's own (it sets each run's seed, "
                                "ranks, failure and directory): give the fix's flags only")
        try:
            config = repro_config(proxy, [*repro_flags, *flags])
        except MoeProxyError as exc:
            raise MoeProxyError(f"candidate {c.name!r} ({' '.join(flags)}): repro refuses it: {exc}") from None
        changes = {k: v for k, v in _flat(config).items() if base.get(k) != v}
        variants.append(Variant(c.name, flags, c.what, changes))
    first = baseline.seed
    return Diagnosis(proxy, Path(out), fail_on, list(repro_flags), list(range(first, first + seeds)), baseline,
                     variants)


def _flat(config: ReproConfig) -> dict:
    d = config.to_dict()
    faults = d.pop("faults")
    return d | {f"faults.{k}": v for k, v in faults.items()}


# --- run: one `moe-proxy repro` process per variant and seed -------------------------------


def run_all(d: Diagnosis, parallel: int = 1) -> dict[str, dict[int, SeedRun]]:
    """Every variant on every seed, `parallel` processes at a time (the baseline's first)."""
    jobs = [(v, s) for v in d.variants for s in d.seeds]
    results: dict[str, dict[int, SeedRun]] = {v.name: {} for v in d.variants}
    threads = max(1, (os.cpu_count() or 1) // parallel)
    log.info("diagnose: %d runs (%d variants x %d seeds), %d at a time, in %s", len(jobs), len(d.variants),
             len(d.seeds), parallel, d.out / "runs")
    with ThreadPoolExecutor(parallel, thread_name_prefix="diagnose") as pool:
        slots = iter(range(len(jobs)))
        futures = {pool.submit(_run, d, v, s, next(slots) % parallel, threads): (v, s) for v, s in jobs}
        for done, future in enumerate(as_completed(futures), 1):
            v, s = futures[future]
            outcome = results[v.name][s] = future.result()
            log.info("[%d/%d] %s seed %d: %s", done, len(jobs), v.name, s, _said(outcome, d.fail_on))
    return results


def _said(o: SeedRun, fail_on: str) -> str:
    if o.reproduced is None:
        return f"error: {o.error}"
    if o.reproduced:
        return f"{o.signature} at step {o.step}"
    return f"no {fail_on} in {o.steps} steps" + (f" ({o.stopped})" if o.stopped != "completed" else "")


def _run(d: Diagnosis, variant: Variant, seed: int, slot: int, threads: int) -> SeedRun:
    """One run, or the record of the same run done before (same arguments, it ran to its end)."""
    directory = d.run_dir(variant.name, seed)
    env = _device_env(d.repro_flags + variant.flags, slot)
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(threads)
    ran = run_recorded(d.argv(variant, seed), directory, RUN_RECORD, "repro.log", env, done="summary.json")
    return _outcome(directory, ran.returncode, ran.error, ran.wall_s)


def _device_env(flags: list[str], slot: int) -> dict[str, str]:
    """One device per concurrent run where the runs use devices (a single-rank run uses device 0)."""
    device = flags[flags.index("--device") + 1] if "--device" in flags[:-1] else ""
    if device.startswith("cuda"):
        return {"CUDA_VISIBLE_DEVICES": str(slot)}
    if device.startswith("npu"):
        return {"ASCEND_RT_VISIBLE_DEVICES": str(slot)}
    return {}


def _outcome(directory: Path, code: int, error: str | None, wall: float) -> SeedRun:
    summary_file = directory / "summary.json"
    if code != 0 or not summary_file.is_file():
        return SeedRun(None, error=error or f"exit code {code}, no summary.json", wall_s=wall)
    s = json.loads(summary_file.read_text())
    first = s.get("first_failure") or {}
    reproduced = bool(s.get("reproduced"))
    asked = first.get("signature") if reproduced else None
    others = {name: onset["step"] for name, onset in (s.get("failures") or {}).items() if name != asked}
    return SeedRun(reproduced, asked, first.get("step") if reproduced else None, int(s.get("steps_completed", 0)),
                   s.get("stopped", ""), others, wall_s=wall)


# --- judge: verdicts and what each fix costs (pure) -----------------------------------------


def verdict(baseline: dict[int, SeedRun], candidate: dict[int, SeedRun], steps: int) -> tuple[str, str]:
    """(verdict, note) of one candidate against the baseline, seed by seed (module doc)."""
    failed = {s: o.error for s, o in candidate.items() if o.reproduced is None}
    if failed:
        return "error", "; ".join(f"seed {s}: {e}" for s, e in sorted(failed.items()))
    judged = sorted(s for s, o in baseline.items() if o.reproduced)
    if not judged:
        return "inconclusive", "the baseline did not reproduce on any seed: nothing to cure"
    back = {s: o.step for s, o in candidate.items() if o.reproduced}
    if back:
        both = [s for s in back if s in judged]
        later = bool(both) and all(back[s] > baseline[s].step for s in both)
        return "reproduced", ("delayed: " if later else "") + ", ".join(f"seed {s} step {t}" for s, t in sorted(back.items()))
    short = {s: candidate[s] for s in judged if candidate[s].steps < steps}
    if short:
        return "inconclusive", "; ".join(
            f"seed {s} stopped at step {o.steps} ({', '.join(f'{n} at step {t}' for n, t in o.others.items()) or o.stopped})"
            for s, o in sorted(short.items()))
    return "fixed", f"ran all {steps} steps on seed{'s' * (len(judged) > 1)} {', '.join(map(str, judged))}"


def _rows(directory: Path) -> dict[int, dict[str, float]]:
    from moe_proxy.repro.metrics_io import read_metrics

    try:
        return read_metrics(directory / "metrics.jsonl")
    except (MoeProxyError, OSError):
        return {}


def cost(d: Diagnosis, name: str, horizon: int) -> dict:
    """Mean reward and loss over the steps before `horizon` (the baseline's first onset), and
    mean time per step, over the seeds."""
    return cost_of([_rows(d.run_dir(name, s)) for s in d.seeds], horizon)  # each metrics file read once


def cost_of(runs: list[dict[int, dict[str, float]]], horizon: int) -> dict:
    """`cost` from each seed's metrics rows (pure: the operator's Diagnosis gives the rows its
    runs' termination messages carry, verdict.series_rows)."""
    def mean_of(metric: str, before: int | None) -> float | None:
        values = [v for rows in runs for step, row in rows.items()
                  if (before is None or step < before) and isinstance(v := row.get(metric), (int, float))
                  and v == v]
        return statistics.fmean(values) if values else None

    out = {f"{k}_mean": mean_of(metric, horizon) for k, metric in COST_METRICS.items()}
    out["time_per_step_s"] = mean_of(COST_SERIES["time"], None)
    out["over_steps"] = horizon
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


def judge(d: Diagnosis, results: dict[str, dict[int, SeedRun]]) -> dict:
    """report.json's content."""
    base = results[BASELINE]
    onsets = [o.step for o in base.values() if o.reproduced]
    horizon = min(onsets) if onsets else d.baseline.steps
    base_cost = cost(d, BASELINE, horizon)
    report = {
        "proxy": d.proxy, "fail_on": d.fail_on, "steps": d.baseline.steps, "seeds": d.seeds,
        "baseline": {"settings": {"flags": d.repro_flags} | _flat(d.baseline),
                     "seeds": {str(s): o.as_json() for s, o in sorted(base.items())}, "cost": base_cost},
        "candidates": {},
    }
    for v in d.variants[1:]:
        mine = results[v.name]
        name, note = verdict(base, mine, d.baseline.steps)
        if not v.changes:  # e.g. grad-clip at repro's default of 1.0: the baseline again, under another name
            note = f"no change from the baseline's settings; {note}"
        c = against(cost(d, v.name, horizon), base_cost)
        report["candidates"][v.name] = {"changes": v.changes, "flags": v.flags, "what": v.what, "verdict": name,
                                        "note": note, "seeds": {str(s): o.as_json() for s, o in sorted(mine.items())},
                                        "cost": c}
    report["fixed_by"] = [n for n, c in report["candidates"].items() if c["verdict"] == "fixed"]
    return report


# --- report ---------------------------------------------------------------------------------


def write_report(d: Diagnosis, report: dict) -> list[Path]:
    from moe_proxy.repro.compare import KEY_METRICS, load_run, plot_notes
    from moe_proxy.repro.plots import plot_curves, plot_matrix

    d.out.mkdir(parents=True, exist_ok=True)
    (d.out / "report.json").write_text(json.dumps(report, indent=2, default=_jsonable) + "\n")
    rows = [(BASELINE, {int(s): _cell(o) for s, o in report["baseline"]["seeds"].items()}, "baseline")]
    rows += [(n, {int(s): _cell(o) for s, o in c["seeds"].items()}, c["verdict"])
             for n, c in report["candidates"].items()]
    files = [plot_matrix(rows, d.seeds, d.out / "matrix.png", f"{d.fail_on}: verdict per candidate and seed")]
    runs = []
    for v in d.variants:  # the first seed's curves of every variant that ran
        directory = d.run_dir(v.name, d.seeds[0])
        if (directory / "metrics.jsonl").is_file():
            runs.append(load_run(directory, v.name))
    metrics = [m for m in KEY_METRICS if any(m in row for r in runs for row in r.rows.values())]
    files += plot_curves(runs, metrics, d.out, "curves.png", notes=plot_notes()) if runs else []
    (d.out / "report.md").write_text(_markdown(report, [f.name for f in files]))
    return [d.out / "report.json", d.out / "report.md", *files]


def _cell(o: dict) -> tuple[str, str]:
    """(state, text) of one run in the matrix."""
    if o["reproduced"] is None:
        return "error", "error"
    if o["reproduced"]:
        return "failed", f"step {o['step']}"
    return "clean", f"clean {o['steps_completed']}"


def _fmt(x, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec)


def _markdown(report: dict, pictures: list[str]) -> str:
    seeds = report["seeds"]
    head = "| candidate | verdict | " + " | ".join(f"seed {s}" for s in seeds) + \
        " | reward (vs baseline) | loss (vs baseline) | time/step (x baseline) | changes |"
    lines = [f"# Diagnosis: {report['fail_on']} on {report['proxy']}", "",
             f"{report['steps']} steps per run; seeds {', '.join(map(str, seeds))}. Fixed by: "
             f"{', '.join(report['fixed_by']) or 'none'}. Costs are means over the steps before the baseline's first "
             f"onset (step {report['baseline']['cost']['over_steps']}).", "", head,
             "|" + "---|" * (len(seeds) + 6)]

    def seed_cells(runs: dict) -> list[str]:
        return [_cell(runs[str(s)])[1] if str(s) in runs else "-" for s in seeds]

    b = report["baseline"]
    lines.append(f"| baseline | {'reproduced' if any(o['reproduced'] for o in b['seeds'].values()) else 'not reproduced'}"
                 f" | {' | '.join(seed_cells(b['seeds']))} | {_fmt(b['cost']['reward_mean'])} | "
                 f"{_fmt(b['cost']['loss_mean'])} | {_fmt(b['cost']['time_per_step_s'])} s | {' '.join(b['settings']['flags'])} |")
    for name, c in report["candidates"].items():
        k = c["cost"]
        lines.append(f"| {name} | **{c['verdict']}** {c['note']} | {' | '.join(seed_cells(c['seeds']))} | "
                     f"{_fmt(k['reward_mean'])} ({_fmt(k['reward_vs_baseline'], '+.3g')}) | "
                     f"{_fmt(k['loss_mean'])} ({_fmt(k['loss_vs_baseline'], '+.3g')}) | "
                     f"{_fmt(k['time_vs_baseline'], '.2f')} | {' '.join(c['flags'])} |")
    lines += ["", *[f"![{p.removesuffix('.png')}]({p})" for p in pictures], ""]
    return "\n".join(lines)


def _jsonable(value):
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


def diagnose(proxy: str, out: str | Path, fail_on: str, repro_flags: list[str], candidates: list[Fix],
             seeds: int = 2, parallel: int = 1) -> dict:
    """Plan, run, judge and report; returns report.json's content."""
    d = plan_diagnosis(proxy, out, fail_on, repro_flags, candidates, seeds)
    results = run_all(d, max(1, parallel))
    if all(o.reproduced is None for o in results[BASELINE].values()):
        raise BaselineFailed(f"the baseline failed to run on every seed: {results[BASELINE][d.seeds[0]].error} "
                           f"(see {d.run_dir(BASELINE, d.seeds[0]) / 'repro.log'})")
    report = judge(d, results)
    write_report(d, report)
    return report

