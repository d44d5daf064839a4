"""Follow a training framework's metrics file as it grows and decide, as `repro` does, whether
the failure came back: the same detector (detect.py), the same verdict (verdict.py), written
to the same termination message. Torch-free: it runs as a sidecar beside the framework.

Lines are verl's FileLogger format (`{"step": N, "elapsed_seconds": s, "data": {...}}`, the
file $VERL_FILE_LOGGER_PATH names) or flat (`{"step": N, "metric": value}`); or a TensorBoard
log directory / event file, or an HF Trainer trainer_state.json (readers.py: the format is
detected, the names renamed by the framework's profile, profiles.py). Each step is fed to the
detector as it is complete; a step logged twice is merged, not counted twice.

The watch ends:
- when the asked-for failure (`fail_on`) is seen, or NaN (later steps mean nothing): the verdict
  is written at once, and `stop_file`, if given, is created so the run can be ended;
- when the run ends: `until_file` appears (a done marker the framework or its wrapper writes),
  or the process is told to stop (SIGTERM: Kubernetes ends a native sidecar so once the main
  container has exited); the rest of the file is read first;
- when the log itself shows that its writer is done (readers.RunFollower.finished: TRL's
  `train_runtime`, a trainer_state.json at max_steps, or `last_step` logged, verl's
  trainer.total_training_steps): the rest is read and the verdict given at once, so a finished
  log is judged without a done marker (it used to wait for one forever, or to the timeout);
- after `timeout_s` without either: an error, no verdict (the run did not finish).

The verdict also gives the last step logged and the failures seen besides its own: when the
framework has crashed, the operator adds the crash to it (its exit code and reason, the end of
its log, from the pod's status) and a NaN seen before the crash comes first.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from moe_proxy.errors import MalformedMetrics, WatchTimeout
from moe_proxy.metrics.detect import FailureDetector, Signature, Thresholds
from moe_proxy.metrics.profiles import Profile
from moe_proxy.metrics.readers import ReadOptions, RunFollower
from moe_proxy.metrics.verdict import stop_reason, verdict_report

log = logging.getLogger(__name__)


@dataclass
class WatchResult:
    report: dict  # reports.repro_report
    steps: int
    stopped: str  # why the watch ended
    failures: dict = field(default_factory=dict)
    run_ended: bool = False  # the run ended (done marker or SIGTERM), not only the watch
    profile: Profile | None = None  # how the run's names were read (None: no step seen)
    names: set = field(default_factory=set)  # the detectors' names the run logged


@contextmanager
def sigterm_ends() -> Iterator[threading.Event]:
    """An event SIGTERM sets, for the duration (main thread only; elsewhere it is never set and
    the done marker and timeout still end the watch). A sidecar enters it first thing: a SIGTERM
    that came before would kill the watch without a verdict."""
    ended = threading.Event()
    try:
        previous = signal.signal(signal.SIGTERM, lambda *_: ended.set())
    except ValueError:
        previous = None
    try:
        yield ended
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def watch(metrics_file: str | Path, *, fail_on: Signature | None = None, thresholds: Thresholds | None = None,
          until_file: str | Path | None = None, stop_file: str | Path | None = None,
          timeout_s: float | None = None, poll_s: float = 1.0,
          ended: threading.Event | None = None, options: ReadOptions | None = None,
          last_step: int | None = None, store_options: dict | None = None) -> WatchResult:
    """Follow `metrics_file` (a path, or an s3:// location polled every `poll_s`: sources.py)
    until the verdict is in (see the module docstring). `ended` is the run's end as SIGTERM
    reports it (`sigterm_ends`); without it none is listened for. `options`: the format, name
    profile and added names (readers.ReadOptions; default: detected). `last_step`: the run's
    last step; once it is logged the run is judged. `store_options`: storage.open_store's
    keyword arguments for an s3:// location."""
    path = metrics_file
    detector = FailureDetector(thresholds or Thresholds(), extra=[fail_on] if fail_on and fail_on.metric else [])
    follower = RunFollower(path, options, last_step, store_options)
    rows: dict[int, dict[str, float]] = {}
    started = time.monotonic()
    ended = ended or threading.Event()

    def feed(final: bool = False) -> str | None:
        for step, values in follower.rows(final):
            if step in rows:  # the same step again: keep the values, do not count it twice
                rows[step].update(values)
                continue
            rows[step] = values
            for name in detector.update(step, values):
                log.info("%s", detector.onsets[name].line(name))
            reason = stop_reason(detector, fail_on)
            if reason:
                return reason
        return None

    stopped, run_ended = None, False
    while stopped is None:
        stopped = feed()
        if stopped:
            break
        if follower.finished:  # the log says so; the container may still be saving: --hold still holds
            stopped = feed(final=True) or f"the run's log is finished ({follower.finished})"
            break
        if until_file and Path(until_file).exists():
            stopped, run_ended = feed(final=True) or "the run ended (done marker)", True
            break
        if ended.is_set():
            stopped, run_ended = feed(final=True) or "the run ended (SIGTERM)", True
            break
        if timeout_s is not None and time.monotonic() - started > timeout_s:
            raise WatchTimeout(f"{path}: no end of the run within {timeout_s:g}s ({len(rows)} steps seen"
                               f"{'' if follower.source.kind else ', and the file never appeared'}); no verdict")
        ended.wait(poll_s)
    if not rows and not follower.source.kind:
        raise MalformedMetrics(f"{path}: the run ended and the metrics file never appeared; no verdict")
    by_detector = stopped.startswith(("reproduced", "loss or weights"))  # stop_reason's: the failure, or a NaN
    if stop_file and by_detector:
        Path(stop_file).parent.mkdir(parents=True, exist_ok=True)
        Path(stop_file).write_text(stopped + "\n")
    # the verdict says why the detector stopped, as repro's does: a run cut short by a NaN is never
    # read as one that ran clean to its end (a Diagnosis judges its runs from this message)
    verdict = verdict_report(detector, fail_on, rows, stopped if by_detector else None)
    return WatchResult(ending(verdict, rows), len(rows), stopped,
                       detector.to_dict(), run_ended, follower.profile, set().union(*rows.values()) if rows else set())


def ending(report: dict, rows: dict) -> dict:
    """The verdict with what the operator needs should the framework crash after it: the last
    step logged (the failures seen besides the verdict's own are the verdict's `also_seen`, each
    at its onset: a NaN before a crash is the finding, outcome.with_crash)."""
    return {**report, "last_step": max(rows) if rows else None}
