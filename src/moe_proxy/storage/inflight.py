"""How much I/O a process keeps in flight: requests each way, read part size, and one budget of
bytes shared by reads and uploads. Torch-free.

A remote object store gives each request tens of milliseconds before its first byte and each
connection a fraction of the link, so throughput comes from requests in flight. By Little's
law a link of R bytes/s, with first-byte latency L and P-byte requests that one connection
carries at r bytes/s, is full with

    streams >= R / r + R x L / P      requests in flight each way (down and up),

which hold about 2 x streams x P bytes. `Transfer` keeps that many requests in flight, never
more bytes than its budget: a read reserves its bytes before its request is sent and frees
them once the writer has taken them; an upload part reserves its bytes when it is cut and
frees them once the store acknowledged it. Reads may hold at most half the budget, so uploads,
which free what reads hold, can always go on (no deadlock); uploads may use whatever reads
leave. Memory is then the process itself plus at most the budget plus a few parts being
copied, at every concurrency.

Default rule (`Transfer.sized`, applied by a build once it knows the checkpoint): the budget is
half of one MoE layer's routed experts (the memory target is 1.5 x that + 512 MiB, so the
budget always fits), at least 64 MiB and at most what `MAX_STREAMS` parts each way need;
streams each way = budget / 2 / read part. Read parts are 8 MiB, smaller when the streams
asked for would not fit the budget (`--streams` with a small `--max-inflight-mb`). A user who
knows the link sets `--streams` from the rule above and `--max-inflight-mb` >= 2 x streams x
part.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

MiB = 1 << 20
READ_PART = 8 * MiB  # bytes per read request, at most (and the upload part S3Store uses)
MIN_PART = 1 * MiB  # read parts never shrink below this
MAX_STREAMS = 64  # requests in flight each way, at most, by default
MIN_BUDGET = 64 * MiB
DEFAULT_BUDGET = 256 * MiB  # before a build has sized it (and for other commands)


class Budget:
    """A byte semaphore with two classes of holders. `acquire(n, read=True)` succeeds while reads
    together hold at most half the limit; uploads (`read=False`) may take anything free. So that
    nothing waits forever, the first read (no reads held) waits only for the total to fit, or
    for nothing to be held, and the first upload (no uploads held) never waits: the budget is
    then exceeded by at most one part, only where a part is larger than half the budget.
    Counts the peak held (for tests and benchmarks)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.held = self.reads = self.peak = 0
        self._cond = threading.Condition()

    def _fits(self, n: int, read: bool) -> bool:
        if not read:  # waits only for other uploads, which finish on their own
            return self.held == self.reads or self.held + n <= self.limit
        if self.reads and self.reads + n > self.limit // 2:
            return False
        return self.held == 0 or self.held + n <= self.limit

    def acquire(self, n: int, read: bool = False, block: bool = True) -> bool:
        """Reserve n bytes; False if `block` is False and they are not free now. A first holder
        always gets its bytes (one request larger than the budget must still be able to run)."""
        with self._cond:
            while not self._fits(n, read):
                if not block:
                    return False
                self._cond.wait()
            self.held += n
            self.reads += n if read else 0
            self.peak = max(self.peak, self.held)
            return True

    def release(self, n: int, read: bool = False) -> None:
        with self._cond:
            self.held -= n
            if read:
                self.reads -= n
            self._cond.notify_all()


@dataclass
class Transfer:
    """Concurrency and the in-flight byte budget of one process's reads and uploads (see the
    module docstring). Values None are sized by `sized` (or the defaults)."""

    max_inflight: int | None = None  # bytes, reads and uploads together
    streams: int | None = None  # requests in flight each way
    read_part: int | None = None  # bytes per read request, at most
    budget: Budget = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.budget = Budget(self.max_inflight or DEFAULT_BUDGET)
        self._fixed = (self.max_inflight, self.streams, self.read_part)
        self.sized(None)

    @classmethod
    def from_options(cls, options: dict | None) -> "Transfer":
        """A Transfer from CLI-style storage options (max_inflight_mb, streams, read_part_mb),
        which are removed from `options`."""
        options = options if options is not None else {}
        mb = lambda key: int(float(v) * MiB) if (v := options.pop(key, None)) else None  # noqa: E731
        return cls(mb("max_inflight_mb"), options.pop("streams", None) or None, mb("read_part_mb"))

    def sized(self, layer_expert_bytes: int | None) -> "Transfer":
        """Apply the default rule for a checkpoint whose MoE layers hold `layer_expert_bytes` of
        routed experts (None: the defaults); values the user set are kept."""
        budget, streams, part = self._fixed
        if budget is None:
            budget = DEFAULT_BUDGET if layer_expert_bytes is None else layer_expert_bytes // 2
            budget = max(MIN_BUDGET, min(budget, 2 * (streams or MAX_STREAMS) * (part or READ_PART)))
        part = part or READ_PART
        streams = streams or max(4, min(MAX_STREAMS, budget // 2 // part))
        # Reads may hold half the budget: with more streams than that fits, each request is smaller.
        part = min(part, max(MIN_PART, budget // 2 // streams))
        self.max_inflight, self.streams, self.read_part = int(budget), int(streams), int(part)
        self.budget.limit = self.max_inflight
        return self


SHARED = Transfer()  # stores opened without one (other commands; tests' own stores)
