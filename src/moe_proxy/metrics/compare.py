"""Compare training dynamics of runs (original vs proxies): align by step, then per metric
Pearson and Spearman correlation and normalised error against the first run, and the onset
step of each failure. Writes report.json, report.md and PNG plots.

normalised error = mean |b_t - a_t| / mean |a_t| over the aligned steps where both are finite
(a = the reference run). Correlations are left empty (null) when either curve is constant or
fewer than 3 steps align.

Shuffled-step control (`permutations` > 0): the run's median Pearson is computed again with
the run's steps put in random orders (seeded; one permutation for all metrics of a trial).
That keeps each curve's values and destroys the step-by-step relation, so it is what the same
numbers score by chance. Reported: the mean and 95th percentile over the permutations, and
p = share of permutations (the actual order counted in) scoring at least the actual median.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from moe_proxy.errors import MalformedMetrics
from moe_proxy.metrics.plots import plot_curves
from moe_proxy.metrics.detect import UNIFORM, FailureDetector
from moe_proxy.metrics.metrics_io import read_summary
from moe_proxy.metrics.readers import read_metrics

# The curves a person looks at first; also the ones the verdict is computed from.
KEY_METRICS = ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss", "critic/rewards/mean",
               "response_length/mean", "moe/router_entropy/mean", "moe/load_max_share", "numerics/max_activation")
# Not dynamics: settings echoed per step, and wall-clock timings (compared separately).
SKIP_PREFIXES = ("timing_s/", "perf/", "training/", "actor/lr", "actor/kl_coef")
TRACKS_PEARSON = 0.7  # verdict "tracks": median Pearson over the key metrics at least this
EVIDENCE_STEPS = 10  # fewer aligned steps than this: a correlation says little, the verdict says so
CONTROL_P = 0.05  # a shuffled-step control p above this does not support a "tracks"
# Quantities whose scale is set by the expert count (uniform routing gives each expert top_k / E
# of the tokens: 0.125 with 32 experts, 0.5 with 8): compared as multiples of the uniform share,
# from repro's `moe/load_uniform_share` in each row. `moe/load_max_excess` is scale-free already
# (0 for uniform routing, 1 for collapse, whatever the count) and is compared as written.
COUNT_DEPENDENT = ("moe/load_max_share", "moe/load_min_share")


@dataclass
class Run:
    name: str
    path: str
    rows: dict[int, dict[str, float]]
    onsets: dict[str, int]
    step_time: float | None


@dataclass
class MetricStats:
    steps: int
    pearson: float | None
    spearman: float | None
    normalised_error: float | None


@dataclass
class ShuffleControl:
    permutations: int
    mean: float | None  # mean median Pearson over the shuffled orders
    p95: float | None
    p_value: float | None  # (1 + #shuffled >= actual) / (1 + permutations)


@dataclass
class RunComparison:
    run: str
    median_pearson: float | None
    verdict: str
    onsets: dict[str, int]
    onset_shift: dict[str, int | None]  # signature -> this run's onset minus the reference's
    step_time_ratio: float | None
    metrics: dict[str, MetricStats] = field(default_factory=dict)
    shuffled: ShuffleControl | None = None


def normalised(rows: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
    """`rows` with the count-dependent metrics as multiples of the run's uniform share (rows
    without the uniform share are left as they are)."""
    out = {}
    for step, row in rows.items():
        uniform = row.get(UNIFORM)
        if _finite(uniform) and uniform > 0:
            row = {k: (v / uniform if k.startswith(COUNT_DEPENDENT) and _finite(v) else v) for k, v in row.items()}
        out[step] = row
    return out


def plot_notes() -> dict[str, str]:
    """Titles' notes for the curves compared normalised."""
    return {m: "x uniform share" for m in KEY_METRICS if m.startswith(COUNT_DEPENDENT)}


def load_run(path: str | Path, name: str | None = None) -> Run:
    """A run's metrics (count-dependent ones normalised to uniform routing) and failure onsets."""
    rows = normalised(read_metrics(path))
    summary = read_summary(path) if Path(path).is_dir() else None
    if summary and isinstance(summary.get("failures"), dict):
        onsets = {sig: int(v["step"]) for sig, v in summary["failures"].items()}
    else:  # a run recorded elsewhere: detect from its metrics with the same rules as repro
        detector = FailureDetector()
        for step, metrics in rows.items():
            detector.update(step, metrics)
        onsets = {sig: o.step for sig, o in detector.onsets.items()}
    times = [m["perf/time_per_step"] for m in rows.values() if _finite(m.get("perf/time_per_step"))]
    default = Path(path).parent.name if Path(path).is_file() else Path(path).name
    return Run(name or default or str(path), str(path), rows, onsets,
               statistics.median(times) if times else None)


def run_labels(paths: list[str | Path]) -> list[str]:
    """Distinct labels for runs: each one's shortest path suffix that ends no other run's path.
    A file stands for its directory (metrics.jsonl, trainer_state.json, an event file) unless
    another run's file shares it. Two TRL runs' `runs/<date>_<host>` directories, which share
    their name, read `orig/runs/<date>_<host>` and `proxy/runs/<date>_<host>`; the same path
    given twice is told apart by its position (`run #1`, `run #2`)."""
    where = [Path(os.path.abspath(p)) for p in paths]
    dirs = [w.parent if w.is_file() else w for w in where]
    parts = [(d if dirs.count(d) == 1 else w).parts for d, w in zip(dirs, where)]
    return [_shortest_suffix(mine, parts[:i] + parts[i + 1:]) or f"{Path(*mine[-1:]).as_posix()} #{i + 1}"
            for i, mine in enumerate(parts)]


def _shortest_suffix(mine: tuple[str, ...], others: list[tuple[str, ...]]) -> str | None:
    for k in range(1, len(mine) + 1):
        if all(other[-k:] != mine[-k:] for other in others):
            return Path(*mine[-k:]).as_posix()
    return None  # the same path as another run's


def metric_stats(a: dict[int, dict[str, float]], b: dict[int, dict[str, float]], metric: str) -> MetricStats:
    steps = [s for s in sorted(set(a) & set(b))
             if _finite(a[s].get(metric)) and _finite(b[s].get(metric))]
    x = np.array([a[s][metric] for s in steps])
    y = np.array([b[s][metric] for s in steps])
    spearman = error = None
    pearson = _pearson(x, y)
    if pearson is not None:
        spearman = _pearson(_ranks(x), _ranks(y))
    if len(steps) and np.abs(x).mean() > 0:
        error = float(np.abs(y - x).mean() / np.abs(x).mean())
    return MetricStats(len(steps), pearson, spearman, error)


def _pearson(x: np.ndarray, y: np.ndarray) -> float | None:
    if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return None
    return float(np.corrcoef(x, y)[0, 1])


def _ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n, tied values sharing their mean rank: Spearman's rho is Pearson's r of these."""
    order = np.argsort(x, kind="stable")
    first = np.r_[True, x[order][1:] != x[order][:-1]]  # where each run of equal values starts
    starts = np.flatnonzero(first)
    ends = np.r_[starts[1:], len(x)]
    ranks = np.empty(len(x))
    ranks[order] = ((starts + ends + 1) / 2)[np.cumsum(first) - 1]
    return ranks


def _median_key_pearson(ref: dict[int, dict[str, float]], rows: dict[int, dict[str, float]],
                        names: list[str]) -> float | None:
    values = []
    for m in KEY_METRICS:
        if m not in names:
            continue
        steps = [s for s in sorted(set(ref) & set(rows)) if _finite(ref[s].get(m)) and _finite(rows[s].get(m))]
        r = _pearson(np.array([ref[s][m] for s in steps]), np.array([rows[s][m] for s in steps]))
        if r is not None:
            values.append(r)
    return statistics.median(values) if values else None


def shuffle_control(ref: Run, run: Run, names: list[str], actual: float | None, permutations: int,
                    seed: int = 0) -> ShuffleControl:
    """The run's median key-metric Pearson with its steps in `permutations` random orders."""
    rng = np.random.default_rng(seed)
    steps = sorted(run.rows)
    scores = []
    for _ in range(permutations):
        order = rng.permutation(len(steps))
        shuffled = {steps[i]: run.rows[steps[j]] for i, j in enumerate(order)}
        score = _median_key_pearson(ref.rows, shuffled, names)
        if score is not None:
            scores.append(score)
    if not scores:
        return ShuffleControl(permutations, None, None, None)
    p = None if actual is None else (1 + sum(v >= actual for v in scores)) / (1 + len(scores))
    return ShuffleControl(permutations, float(np.mean(scores)), float(np.percentile(scores, 95)), p)


def compare_runs(runs: list[Run], metrics: list[str] | None = None, permutations: int = 0,
                 seed: int = 0) -> list[RunComparison]:
    """Each run against runs[0] (the reference; itself included, as a sanity row); with
    `permutations`, each also against its shuffled-step control (module doc)."""
    if len(runs) < 2:
        raise MalformedMetrics("compare needs at least two runs")
    ref = runs[0]
    recorded = [set().union(*r.rows.values()) for r in runs]
    for run, there in zip(runs, recorded):  # a metric asked for by name must be there to compare
        if missing := [m for m in metrics or () if m not in there]:
            shown = sorted(k for k in there if not k.startswith(SKIP_PREFIXES))
            raise MalformedMetrics(f"metric {', '.join(map(repr, missing))}: not in run {run.name} ({run.path}), "
                                   f"which records {', '.join(shown[:6])}{', ...' if len(shown) > 6 else ''}")
    names = metrics or sorted(k for k in set.intersection(*recorded) if not k.startswith(SKIP_PREFIXES))
    out = []
    for run in runs:
        per_metric = {m: metric_stats(ref.rows, run.rows, m) for m in names}
        key = [per_metric[m].pearson for m in KEY_METRICS if m in per_metric and per_metric[m].pearson is not None]
        median = statistics.median(key) if key else None
        shift = {sig: (run.onsets[sig] - ref.onsets[sig] if sig in run.onsets else None) for sig in ref.onsets}
        for sig in run.onsets.keys() - ref.onsets.keys():
            shift[sig] = None
        ratio = run.step_time / ref.step_time if run.step_time and ref.step_time else None
        control = shuffle_control(ref, run, names, median, permutations, seed) if permutations else None
        aligned = max((per_metric[m].steps for m in KEY_METRICS if m in per_metric), default=0)
        verdict = _verdict(median, ref.onsets, run.onsets, aligned, control, run is ref)
        out.append(RunComparison(run.name, median, verdict, run.onsets, shift, ratio, per_metric, control))
    return out


def _verdict(median: float | None, ref: dict[str, int], run: dict[str, int], aligned: int,
             control: ShuffleControl | None, itself: bool = False) -> str:
    missed = sorted(ref.keys() - run.keys())
    extra = sorted(run.keys() - ref.keys())
    notes = [f"misses {', '.join(missed)}"] if missed else []
    notes += [f"adds {', '.join(extra)}"] if extra else []
    if median is None:
        head = "no comparable curves"
    else:
        head = "tracks" if median >= TRACKS_PEARSON else "does not track"
        if aligned < EVIDENCE_STEPS and not itself:
            notes.insert(0, f"weak: {aligned} aligned steps, at least {EVIDENCE_STEPS} to judge")
        if head == "tracks" and control is not None and control.p_value is not None and control.p_value > CONTROL_P:
            notes.insert(0, f"not supported by the shuffled-step control: p {control.p_value:.3g} > {CONTROL_P:g}")
    return head + (f" ({'; '.join(notes)})" if notes else "")


def write_report(runs: list[Run], results: list[RunComparison], out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = {"reference": runs[0].name, "runs": [{"name": r.name, "path": r.path} for r in runs],
              "tracks_pearson": TRACKS_PEARSON, "comparisons": [_jsonable(asdict(c)) for c in results]}
    (out / "report.json").write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    plots = plot_curves(runs, [m for m in KEY_METRICS if all(_has(r, m) for r in runs)], out, notes=plot_notes())
    (out / "report.md").write_text(_markdown(runs, results, plots))
    return out


def _markdown(runs: list[Run], results: list[RunComparison], plots: list[Path]) -> str:
    ref = runs[0]
    lines = [f"# Training dynamics: {len(runs) - 1} run(s) against `{ref.name}`", "",
             f"Verdict: *tracks* when the median Pearson correlation of the key curves is at least "
             f"{TRACKS_PEARSON}, called weak on fewer than {EVIDENCE_STEPS} aligned steps, and unsupported when "
             f"the shuffled-step control's p is above {CONTROL_P:g}. Onset shift: the run's failure step minus the "
             f"reference's. Shuffled steps: the same statistic with the run's steps in random orders (chance level; "
             f"p = share scoring at least the actual). {', '.join(COUNT_DEPENDENT)} (and their per-layer values) "
             f"are compared as multiples of uniform routing's share (top_k / experts), which differs between a "
             f"proxy and its original.", "",
             "| run | verdict | median Pearson | shuffled steps: mean / p95 / p | failures (step) | onset shift | "
             "step time vs ref |",
             "|---|---|---|---|---|---|---|"]
    for c in results[1:]:
        failures = ", ".join(f"{k} ({v})" for k, v in sorted(c.onsets.items(), key=lambda i: i[1])) or "none"
        shift = ", ".join(f"{k} {'+' if v and v > 0 else ''}{v if v is not None else 'n/a'}"
                          for k, v in c.onset_shift.items()) or "-"
        control = (f"{_fmt(c.shuffled.mean)} / {_fmt(c.shuffled.p95)} / {_fmt(c.shuffled.p_value)}"
                   if c.shuffled else "-")
        lines.append(f"| {c.run} | {c.verdict} | {_fmt(c.median_pearson)} | {control} | {failures} | {shift} | "
                     f"{_fmt(c.step_time_ratio, 'x')} |")
    ref_failures = ", ".join(f"{k} ({v})" for k, v in ref.onsets.items()) or "none"
    lines += ["", f"Reference failures: {ref_failures}.", "", "## Key metrics", "",
              "| metric | " + " | ".join(f"{c.run}: Pearson / Spearman / norm. err" for c in results[1:]) + " |",
              "|---|" + "---|" * (len(results) - 1)]
    for m in KEY_METRICS:
        if all(m in c.metrics for c in results):
            cells = [f"{_fmt(s.pearson)} / {_fmt(s.spearman)} / {_fmt(s.normalised_error)}"
                     for s in (c.metrics[m] for c in results[1:])]
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines += ["", *[f"![{p.stem}]({p.name})" for p in plots], ""]
    return "\n".join(lines)


def _has(run: Run, metric: str) -> bool:
    return any(metric in m for m in run.rows.values())


def _fmt(value: float | None, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:.3f}{suffix}"


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _jsonable(value):
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value
