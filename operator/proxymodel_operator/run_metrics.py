"""A training run's metrics in object storage, followed poll after poll (a CheckpointWatch's
spec.metrics): the failures of spec.onFailure.failOn, found by the repro detectors on the
original's own metrics, by `moe_proxy.metrics.incident.RunWatcher` (new bytes only, every format
`moe-proxy watch` reads; a NaN always counts, as in `repro` and `watch`). What the watched run
adds around it:

- `watcher_for`: the watch's RunWatcher; `after_step`: only steps past it count (a resumed run's
  new incident comes after the last one handled);
- `poll`: one poll, and the recovery rule's per-step hits for the failure (docs/checkpointwatch.md);
  metrics that shrank (a run restarted over the same file: errors.MetricsShrank) are read again
  from the start by a fresh watcher, and the poll says `rewound`.

Torch-free, blocking (the handler runs `poll` in a thread).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from moe_proxy.errors import MetricsShrank
from moe_proxy.metrics.incident import RunFailure, RunWatcher
from moe_proxy.metrics.readers import ReadOptions


def watcher_for(uri: str, fail_on: list[str], fmt: str | None, profile: str | None, last_step: int | None,
                store_options: dict, after_step: int | None) -> RunWatcher:
    """The watch's RunWatcher: `last_step` is spec.metrics.lastStep (logged, the run is finished)."""
    return RunWatcher(uri, fail_on=fail_on, options=ReadOptions(format=fmt, profile=profile),
                      store_options=store_options, last_step=last_step, after_step=after_step,
                      last_step_said="spec.metrics.lastStep")


@dataclass(frozen=True)
class Polled:
    watcher: RunWatcher  # the one to keep: a fresh one when the metrics shrank
    failure: RunFailure | None  # the earliest watched failure so far (the same on every later poll)
    hits: list[bool]  # for each step logged after its detection: whether its test still holds
    rewound: bool  # the metrics shrank: read again from the start


def poll(watcher: RunWatcher, fresh: Callable[[], RunWatcher]) -> Polled:
    """One poll of the run's metrics. When they shrank, `fresh()` builds the watcher that reads
    them from the start; the other errors (errors.StorageError, errors.MalformedMetrics) are raised."""
    rewound = False
    try:
        failure = watcher.poll()
    except MetricsShrank:
        watcher, rewound = fresh(), True
        failure = watcher.poll()
    return Polled(watcher, failure, watcher.still_failing_after(failure) if failure else [], rewound)
