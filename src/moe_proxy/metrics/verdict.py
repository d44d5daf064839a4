"""A reproduction's verdict from the failure detector, the same for `repro` and `watch`:
which failure (the one asked for, or else the first of any kind), at which step, and the
headline metrics for the operator's termination message. Torch-free."""

from __future__ import annotations

import json

from moe_proxy.reports import repro_report
from moe_proxy.metrics.detect import FailureDetector, Signature
from moe_proxy.metrics.metrics_io import finite_or_none

# Metrics copied into the operator's termination log (it must stay under 4 KB).
HEADLINE = ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss", "critic/rewards/mean",
            "moe/load_max_share", "moe/load_max_excess", "numerics/max_activation", "numerics/loss_scale")
# What a fix costs (`moe-proxy diagnose`'s cost columns), step by step in the termination message:
# the operator's Diagnosis judges its runs from their pods' messages alone.
COST_SERIES = {"reward": "critic/rewards/mean", "loss": "actor/pg_loss", "time": "perf/time_per_step"}
SERIES_BYTES = 2048  # of the message's 4096: the headline metrics and the verdict keep the rest


def first_failure(detector: FailureDetector, fail_on: Signature | None) -> tuple[str | None, int | None]:
    """(signature, step): the asked-for failure if it happened, else (no target) the first one."""
    if fail_on:
        onset = detector.onsets.get(fail_on.name)
        return (fail_on.name, onset.step) if onset else (None, None)
    first = detector.first()
    return (first[0], first[1].step) if first else (None, None)


def stop_reason(detector: FailureDetector, fail_on: Signature | None) -> str | None:
    """Why a run (or a watch) ends now, or None to go on."""
    if fail_on and fail_on.name in detector.onsets:
        return f"reproduced {fail_on.name}"
    if "nan" in detector.onsets:
        return "loss or weights are NaN; later steps would be meaningless"
    return None


def verdict_report(detector: FailureDetector, fail_on: Signature | None, rows: dict[int, dict[str, float]],
                   stopped: str | None = None) -> dict:
    """The termination message of a finished run (reports.repro_report): the verdict's step with
    that step's headline metrics (the last step's when nothing was found), and every other
    failure seen at its onset (a Diagnosis never reads a run that collapsed as clean), and the
    failures these metrics cannot show (`cannot_show`: a run that could not collapse is no cure)."""
    signature, step = first_failure(detector, fail_on)
    shown = rows.get(step) if step is not None else None
    if shown is None:
        shown = rows[max(rows)] if rows else {}
    headline = {k: finite_or_none(shown.get(k)) for k in HEADLINE if k in shown}
    others = {name: onset.step for name, onset in detector.onsets.items() if name != signature}
    report = repro_report(signature is not None, signature, step, headline, len(rows), stopped, others)
    if detector.cannot_show:
        report["cannot_show"] = dict(detector.cannot_show)
    return {**report, "series": cost_series(rows)} if rows else report


def cost_series(rows: dict[int, dict[str, float]], budget: int = SERIES_BYTES) -> dict:
    """COST_SERIES's metrics per step, 4 significant digits (null: absent or not finite; a metric
    the run does not log is left out), every `stride`-th step from step `first` (`steps` lists
    them where they are not evenly spaced): stride 1 unless that does not fit in `budget` bytes
    of JSON (a long run: every 2nd, 4th... step, an estimate of the means then)."""
    steps = sorted(rows)
    stride = 1
    while True:
        kept = steps[::stride]
        values = {key: [float(f"{v:.4g}") if (v := finite_or_none(rows[s].get(metric))) is not None else None
                        for s in kept] for key, metric in COST_SERIES.items()}
        series = {"first": kept[0], "stride": stride,
                  **({} if kept == list(range(kept[0], kept[0] + stride * len(kept), stride)) else {"steps": kept}),
                  **{key: v for key, v in values.items() if any(x is not None for x in v)}}
        if len(json.dumps(series, separators=(",", ":"))) <= budget or len(kept) == 1:
            return series
        stride *= 2


def series_rows(series: dict | None) -> dict[int, dict[str, float]]:
    """A termination message's `series` back as metrics rows by step (what metrics.jsonl holds,
    for COST_SERIES's metrics only)."""
    if not isinstance(series, dict) or not isinstance(series.get("first"), int):
        return {}
    first, stride = series["first"], int(series.get("stride") or 1)
    rows: dict[int, dict[str, float]] = {}
    for key, metric in COST_SERIES.items():
        values = series.get(key) or []
        steps = series.get("steps") or [first + i * stride for i in range(len(values))]
        for step, v in zip(steps, values):
            if isinstance(v, (int, float)):
                rows.setdefault(int(step), {})[metric] = float(v)
    return rows


def verdict_lines(fail_on: Signature | None, signature: str | None, step: int | None, steps: int,
                  failures: dict[str, dict], cannot_show: dict[str, str] | None = None) -> list[str]:
    """What `repro` and `watch` print: the verdict, and any failure seen that was not the one
    asked for, each with its own step (never a failure asked for reported as absent while
    another one is shown as detected, without saying which is which). A NaN before the failure
    asked for ended the run: it is the failure, never a clean run (metrics.incident's rule), and
    the line says the one asked for was not seen before it. Then each failure the run's metrics
    cannot show (FailureDetector.cannot_show), the one asked for first."""
    nan_first = fail_on is not None and signature is None and "nan" in failures
    others = [f"  {name} seen at step {onset['step']} (not the failure asked for)"
              for name, onset in failures.items() if name != signature and not (nan_first and name == "nan")
              ] if fail_on else []
    asked = fail_on.name if fail_on else None
    notes = [f"  {name} cannot show in this run: {why}"
             for name, why in sorted((cannot_show or {}).items(), key=lambda item: item[0] != asked)]
    if signature:
        return [f"{signature} at step {step}" + (" (reproduced)" if fail_on else "")] + others + notes
    if nan_first:
        return [f"failed on nan at step {failures['nan']['step']} (no {fail_on.name} before it)"] + others + notes
    if others:
        return [f"{fail_on.name} not reproduced in {steps} steps"] + others + notes
    return [f"no failure in {steps} steps" + (f" ({fail_on.name} not reproduced)" if fail_on else "")] + notes
