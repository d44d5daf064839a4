"""A watched training run's first failure, one timer tick at a time (the operator's watched run).

    w = RunWatcher(uri, fail_on=["nan", "divergence"], options=ReadOptions(), store_options={...})
    failure = w.poll()        # each tick: RunFailure(step, signature, reason, seen) or None
    w.last_step, w.finished   # the newest step read; why the log shows its writer is done (or None)
    w.still_failing_after(failure)  # each step logged after its detection: does its test still hold?

`moe-proxy triage` reads a log once through the same watcher (keep_rows=True, poll(newest=True)):
one path, one rule for the operator and the CLI loop.

The watcher holds a readers.RunFollower (what was read: offsets, partial records) and a
detect.FailureDetector (the same detectors as `repro` and `watch`, fed each step once, a
step logged again is not fed twice), and the rows logged after the failure's detection; nothing
else is kept between calls, and nothing here blocks or sleeps: each poll reads what is new (on S3:
one listing and ranged reads of the new bytes, sources.py) and returns at once. Torch-free.

Which failures count: the signatures in `fail_on` (detect.SIGNATURES names, or METRIC>VALUE[:STEPS]
thresholds); every built-in signature when `fail_on` is empty; and a NaN always, as `repro` and
`watch` stop at it (the steps after it mean nothing): a NaN before any failure asked for is the
failure (its signature `nan`), never a clean log. The failure returned is the earliest onset
among those found at the first poll that finds any, and it stays the answer: later polls return
the same RunFailure (one incident per run). `after_step`: the steps up to it are read (last_step)
but not fed to the detectors: a resumed run's next failure, past an incident already handled.

A metrics file that got shorter (a run restarted over it) raises errors.MetricsShrank: this
watcher cannot go on; a caller that expects restarts builds a fresh one, which reads from the start.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moe_proxy.metrics.detect import SIGNATURES, FailureDetector, Signature, Thresholds
from moe_proxy.metrics.readers import ReadOptions, RunFollower


@dataclass(frozen=True)
class RunFailure:
    step: int  # the failure's onset (the first step of its streak)
    signature: str  # a detect.SIGNATURES name, or the METRIC>VALUE[:STEPS] text as given
    reason: str  # the detector's line: "step 4: divergence detected (...)"
    seen: int | None = None  # the step the detection completed at (its patience's last); None: = step


class RunWatcher:
    """The first failure of a growing run at a local path or an s3:// location (module doc).
    `last_step_said`: where last_step came from, as `finished` says it."""

    def __init__(self, uri: str | Path, fail_on: list[str] | tuple[str, ...] = (), options: ReadOptions | None = None,
                 store_options: dict | None = None, thresholds: Thresholds | None = None,
                 last_step: int | None = None, after_step: int | None = None, last_step_said: str = "--last-step",
                 keep_rows: bool = False):
        signatures = [Signature.parse(text) for text in fail_on]
        self.wanted = {s.name for s in signatures} or set(SIGNATURES)
        self.wanted.add("nan")
        self.detector = FailureDetector(thresholds or Thresholds(), extra=[s for s in signatures if s.metric])
        self.follower = RunFollower(uri, options, last_step, store_options, last_step_said)
        self.after_step = after_step
        self.seen: set[int] = set()
        self.last_step: int | None = None
        self.failure: RunFailure | None = None
        self.later: dict[int, dict[str, float]] = {}  # the rows logged after the failure's detection
        # keep_rows: every row read, a step logged twice merged (triage plots them; a watched run's
        # operator does not keep a long run's rows)
        self.rows: dict[int, dict[str, float]] | None = {} if keep_rows else None

    @property
    def finished(self) -> str | None:
        """Why the log shows that its writer is done (readers.RunFollower.finished), or None."""
        return self.follower.finished

    def poll(self, newest: bool = False) -> RunFailure | None:
        """Read what is new, feed it to the detectors; the first failure seen so far, or None.
        `newest`: the newest step is taken without waiting for a later one (a log read once, as
        triage reads it: what is complete now), but a JSON line without its newline, which may
        still be being written. Storage and format errors (errors.StorageError,
        errors.MalformedMetrics, its MetricsShrank) are raised."""
        rows = self.follower.rows()
        if self.follower.finished or (newest and self.follower.format != "jsonl"):
            rows += self.follower.rows(final=True)  # the writer is done: the newest step need not wait
        fed = []
        for step, values in rows:
            if self.rows is not None:
                self.rows.setdefault(step, {}).update(values)
            if step in self.seen:
                continue
            self.seen.add(step)
            self.last_step = step if self.last_step is None else max(self.last_step, step)
            if self.after_step is None or step > self.after_step:
                self.detector.update(step, values)
                fed.append((step, values))
        if self.failure is None:
            # at one step, the order of SIGNATURES: an fp16 overflow that turns into NaN is the overflow
            rank = {name: i for i, name in enumerate(SIGNATURES)}
            found = [(onset.step, rank.get(name, len(rank)), name) for name, onset in self.detector.onsets.items()
                     if name in self.wanted]
            if found:
                step, _, name = min(found)
                onset = self.detector.onsets[name]
                self.failure = RunFailure(step, name, onset.line(name), onset.seen)
        if self.failure is not None:
            detected = _detected(self.failure)
            self.later.update((step, values) for step, values in fed if step > detected)
        return self.failure

    def still_failing_after(self, failure: RunFailure) -> list[bool]:
        """For each step logged after this watcher's failure was detected (its `seen`), in step
        order: whether the detector's per-step test for its signature still holds there
        (FailureDetector.holds: without the patience, the run's own baseline). A run whose first
        steps after a detection are all clean recovered by itself (the operator's recovery rule)."""
        detected = _detected(failure)
        return [self.detector.holds(failure.signature, self.later[step]) for step in sorted(self.later)
                if step > detected]


def _detected(failure: RunFailure) -> int:
    return failure.step if failure.seen is None else failure.seen
