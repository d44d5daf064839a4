"""A training run's metrics in object storage, followed poll after poll (a CheckpointWatch's
spec.metrics): the failures of spec.onFailure.failOn, found by the repro detectors on the
original's own metrics.

`RunMetrics` has the interface of `moe_proxy.metrics.RunWatcher` (another engineer's, torch-free,
not on this branch yet): `RunMetrics(uri, fail_on=[signature strings], options=ReadOptions(...),
store_options={...})`, `.poll() -> RunFailure | None` (the earliest watched failure so far; the same
one on every later poll), `.last_step`, `.finished`. The integrator swaps it in with one line,
`RUN_WATCHER = RunWatcher` below. What this module adds around it, and keeps with either:

- `after_step`: only steps past it count (a resumed run's new incident comes after the last one);
- `rewound`: the metrics shrank (a run restarted over the same file): read again from the start;
- `later_hits(failure)`: for each step logged after a failure's detection, whether the detector's
  per-step test for that failure still holds (the recovery rule: docs/checkpointwatch.md).

Today's reading: the objects under the URI (a JSON lines file read by new bytes only, appended to
a local copy; TensorBoard event files and trainer_state.json copied again when their size changes)
into a temporary directory, read with `metrics.readers.read_run` and fed, step by step, to a
`metrics.detect.FailureDetector`. Torch-free, blocking (the handler runs it in a thread).
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from moe_proxy.errors import MalformedMetrics
from moe_proxy.metrics.detect import SIGNATURES, FailureDetector, Signature
from moe_proxy.metrics.readers import EVENTS_GLOB, TRAINER_STATE, ReadOptions, read_run
from moe_proxy.metrics.metrics_io import METRICS_FILE
from moe_proxy.storage.s3 import S3Store, parse_uri


@dataclass(frozen=True)
class RunFailure:
    """A watched failure of the run: its onset step, signature, and what the detector saw."""

    step: int
    signature: str
    reason: str
    seen: int | None = None  # the step the detection completed at (patience); None: = step


def _metrics_file(name: str) -> bool:
    base = PurePosixPath(name).name
    return base == TRAINER_STATE or base.endswith(".jsonl") or PurePosixPath(base).match(EVENTS_GLOB)


class RunMetrics:
    """The stand-in of moe_proxy.metrics.RunWatcher (module doc), with after_step."""

    def __init__(self, uri: str, fail_on: list[str], options: ReadOptions | None = None,
                 store_options: dict | None = None, after_step: int | None = None):
        self.uri, self.fail_on, self.options = uri.rstrip("/"), list(fail_on), options or ReadOptions()
        self.store_options, self.after_step = dict(store_options or {}), after_step
        self.local = Path(tempfile.mkdtemp(prefix="moe-proxy-metrics-"))
        self.sizes: dict[str, int] = {}
        self.store_uri = self.uri
        self.rewound = False  # the last poll found the metrics shorter than before (read again)
        self.last: int | None = None  # the run's last step (spec.metrics.lastStep): logged, it is finished
        self._reset()

    def _reset(self) -> None:
        extra = [Signature.parse(s) for s in self.fail_on if s not in SIGNATURES]
        self.detector = FailureDetector(extra=extra)
        self.rows: dict[int, dict[str, float]] = {}
        self.fed_through: int | None = None
        self.last_step: int | None = None
        self.finished: str | None = None
        self.failure: RunFailure | None = None

    def _store(self) -> tuple[S3Store, dict[str, int]]:
        """The store and the metrics objects under the URI (the URI itself when it names one)."""
        store = S3Store(self.uri, **self.store_options)
        found = {k: v for k, v in store.list_sizes().items() if k and _metrics_file(k)}
        if found:
            return store, found
        bucket, key = parse_uri(self.uri)
        parent, _, base = key.rpartition("/")
        store = S3Store(f"s3://{bucket}/{parent}", **self.store_options)
        return store, {k: v for k, v in store.list_sizes(base).items() if k == base}

    def _fetch(self) -> None:
        store, sizes = self._store()
        self.store_uri = store.uri  # what the local copy's paths are relative to (for messages)
        if any(sizes.get(name, 0) < size for name, size in self.sizes.items()):
            self.rewound = True  # a file shrank or went: the run started over; read it all again
            for path in self.local.rglob("*"):
                if path.is_file():
                    path.unlink()
            self.sizes = {}
            self._reset()
        for name, size in sizes.items():
            old, target = self.sizes.get(name, 0), self.local / name
            if size == old:
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            if name.endswith(".jsonl") and old:  # append-only: only the new bytes
                with target.open("ab") as f:
                    f.write(store.read_range(name, old, size - old))
            else:
                target.write_bytes(store.read_bytes(name))
            self.sizes[name] = size

    def _source(self) -> Path | None:
        files = [p for p in self.local.rglob("*") if p.is_file()]
        if not files:
            return None
        if len(files) == 1:
            return files[0]
        jsonl = [p for p in files if p.name == METRICS_FILE]
        return jsonl[0] if jsonl else self.local

    def poll(self) -> RunFailure | None:
        """Read what is new; the earliest watched failure so far (None: none yet). Raises
        MalformedMetrics (a line without a step, not JSON) and the store's errors."""
        self.rewound = False
        self._fetch()
        source = self._source()
        if source is None:
            return self.failure
        try:
            rows, _ = read_run(source, self.options)
        except MalformedMetrics as exc:
            if "no steps recorded" in str(exc):
                return self.failure
            self.sizes = {}  # rewritten in place, maybe: the next poll reads every file whole again
            raise MalformedMetrics(str(exc).replace(str(self.local), self.store_uri)) from None
        self._feed(rows)
        return self.failure

    def _feed(self, rows: dict[int, dict[str, float]]) -> None:
        for step, metrics in sorted(rows.items()):
            if (self.fed_through is not None and step <= self.fed_through) or \
                    (self.after_step is not None and step <= self.after_step):
                continue
            self.rows[step] = metrics
            self.fed_through = step
            found = self.detector.update(step, metrics)
            if self.failure is None:
                for name in (n for n in found if n in self.fail_on):
                    onset = self.detector.onsets[name]
                    self.failure = RunFailure(onset.step, name, onset.line(name), onset.seen)
                    break
        self.last_step = max(rows) if rows else self.last_step
        if self.last is not None and self.last_step is not None and self.last_step >= self.last:
            self.finished = f"step {self.last} logged (spec.metrics.lastStep)"

    def close(self) -> None:
        """Drop the local copy (a watcher replaced: another after_step, another spec)."""
        shutil.rmtree(self.local, ignore_errors=True)

    def later_hits(self, failure: RunFailure) -> list[bool]:
        """For each step logged after the failure's detection, in order: whether the detector's
        per-step test for its signature holds there (the same test, the run's own baseline)."""
        seen = getattr(failure, "seen", None)  # RunWatcher's Failure may not say: from the onset then
        seen = failure.step if seen is None else seen
        out = []
        for step in sorted(s for s in self.rows if s > seen):
            checks = self.detector._checks(self.rows[step])  # noqa: SLF001 - the detector's per-step test
            hit = checks.get(failure.signature)
            out.append(bool(hit and hit[0]))
        return out


RUN_WATCHER = RunMetrics  # the integrator: `RUN_WATCHER = moe_proxy.metrics.RunWatcher` (with after_step as above)


def watcher_for(uri: str, fail_on: list[str], fmt: str | None, profile: str | None, last_step: int | None,
                store_options: dict, after_step: int | None) -> RunMetrics:
    w = RUN_WATCHER(uri, fail_on=fail_on, options=ReadOptions(format=fmt, profile=profile), store_options=store_options,
                after_step=after_step)
    w.last = last_step
    return w
