"""A watched training run's first failure, one timer tick at a time (the operator's watched run).

    w = RunWatcher(uri, fail_on=["nan", "divergence"], options=ReadOptions(), store_options={...})
    failure = w.poll()        # each tick: RunFailure(step, signature, reason) or None
    w.last_step, w.finished   # the newest step read; why the log shows its writer is done (or None)

The watcher holds a readers.RunFollower (what was read: offsets, partial records) and a
detect.FailureDetector (the same detectors as `repro` and `watch`, fed each step once, a
step logged again is not fed twice); nothing else is kept between calls, and nothing here
blocks or sleeps: each poll reads what is new (on S3: one listing and ranged reads of the new
bytes, sources.py) and returns at once. Torch-free.

Which failures count: the signatures in `fail_on` (detect.SIGNATURES names, or METRIC>VALUE[:STEPS]
thresholds); every built-in signature when `fail_on` is empty; and a NaN always, as `repro` and
`watch` stop at it (the steps after it mean nothing). The failure returned is the earliest onset
among those found at the first poll that finds any, and it stays the answer: later polls return
the same RunFailure (one incident per run).
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


class RunWatcher:
    """The first failure of a growing run at a local path or an s3:// location (module doc)."""

    def __init__(self, uri: str | Path, fail_on: list[str] | tuple[str, ...] = (), options: ReadOptions | None = None,
                 store_options: dict | None = None, thresholds: Thresholds | None = None,
                 last_step: int | None = None):
        signatures = [Signature.parse(text) for text in fail_on]
        self.wanted = {s.name for s in signatures} or set(SIGNATURES)
        self.wanted.add("nan")
        self.detector = FailureDetector(thresholds or Thresholds(), extra=[s for s in signatures if s.metric])
        self.follower = RunFollower(uri, options, last_step, store_options)
        self.seen: set[int] = set()
        self.last_step: int | None = None
        self.failure: RunFailure | None = None

    @property
    def finished(self) -> str | None:
        """Why the log shows that its writer is done (readers.RunFollower.finished), or None."""
        return self.follower.finished

    def poll(self) -> RunFailure | None:
        """Read what is new, feed it to the detectors; the first failure seen so far, or None.
        Storage and format errors (errors.StorageError, errors.MalformedMetrics) are raised."""
        rows = self.follower.rows()
        if self.follower.finished:  # the writer is done: the newest step need not wait for a later one
            rows += self.follower.rows(final=True)
        for step, values in rows:
            if step in self.seen:
                continue
            self.seen.add(step)
            self.last_step = step if self.last_step is None else max(self.last_step, step)
            self.detector.update(step, values)
        if self.failure is None:
            found = [(onset.step, name) for name, onset in self.detector.onsets.items() if name in self.wanted]
            if found:
                step, name = min(found)
                self.failure = RunFailure(step, name, self.detector.onsets[name].line(name))
        return self.failure
