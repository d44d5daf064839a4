"""The read path of a build, in one place: which byte ranges of a source shard are fetched in
which requests, and how fetching runs ahead of writing. Torch-free.

- `read_coalesced`: many ranges of one file in as few requests as their gaps allow.
- `part_readers`: ranges split into tasks of about `part` bytes, for a pool.
- `read_tasks`: one output shard's tasks, ranges pooled across its tensors (PART bytes each).
- `read_ahead`: the tasks' bytes in order, up to `window` fetched ahead while earlier ones are
  written, so download and upload overlap; with a budget (storage/inflight.py), each task
  holds its bytes from before its request until the consumer has taken them, so memory is
  bounded by the budget whatever the window. A `Later` among the tasks (a shard whose experts
  are still being selected) stops the running ahead while earlier bytes are in flight.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Executor
from dataclasses import dataclass
from functools import partial
from itertools import chain
from typing import Callable, Iterable, Protocol

from moe_proxy.storage import Store
from moe_proxy.storage.inflight import READ_PART, Budget

PART = READ_PART  # bytes per read task, at most


class Sourced(Protocol):
    """A tensor to write and where its bytes come from (pruning.writer.OutTensor)."""

    # (start, length) ranges of the source shard, in order, or a function that returns the bytes
    source: list[tuple[int, int]] | Callable[[], bytes]

    @property
    def nbytes(self) -> int: ...


@dataclass(frozen=True)
class ReadTask:
    """A callable that returns `nbytes` bytes (what it holds of an in-flight budget)."""
    read: Callable[[], bytes]
    nbytes: int

    def __call__(self) -> bytes:
        return self.read()


def read_coalesced(store: Store, file: str, ranges: list[tuple[int, int]], gap: int = 0) -> bytes:
    """The bytes of many ranges of one file, in order, merging neighbours (within `gap` bytes)
    into one request. A request whose ranges leave no gap is used as read, without copies."""
    out: list[bytes | memoryview] = []
    i = 0
    while i < len(ranges):
        start, length = ranges[i]
        j, end = i + 1, start + length
        while j < len(ranges) and ranges[j][0] >= end and ranges[j][0] - end <= gap:
            end = ranges[j][0] + ranges[j][1]
            j += 1
        blob = store.read_range(file, start, end - start)
        if sum(n for _, n in ranges[i:j]) == len(blob):  # one contiguous run: all of it
            out.append(blob)
        else:  # views of what is kept: the join below is the only copy
            view = memoryview(blob)
            out.extend(view[s - start : s - start + n] for s, n in ranges[i:j])
        i = j
    return out[0] if len(out) == 1 and isinstance(out[0], bytes) else b"".join(out)


def part_readers(store: Store, file: str, ranges: list[tuple[int, int]], part: int) -> list[Callable[[], bytes]]:
    """Split the reading of `ranges` (in order) into tasks of about `part` bytes each, so a
    pool can fetch them concurrently while earlier ones are being written."""
    pieces: list[tuple[int, int]] = []
    for start, length in ranges:  # split ranges larger than a part
        pieces += [(s, min(part, start + length - s)) for s in range(start, start + length, part)] or [(start, 0)]
    tasks, batch, size = [], [], 0
    for r in pieces:
        if batch and size + r[1] > part:
            tasks.append(batch)
            batch, size = [], 0
        batch.append(r)
        size += r[1]
    if batch:
        tasks.append(batch)
    return [ReadTask(partial(read_coalesced, store, file, b), sum(n for _, n in b)) for b in tasks]


def read_tasks(store: Store, file: str, tensors: list[Sourced], part: int = PART) -> list[Callable[[], bytes]]:
    """Tasks of about `part` bytes that read one output shard's data in order. Ranges are pooled
    across tensors, so kept tensors that sit next to each other in the source (a layer's
    backbone, a kept expert's projections) come in one request, not one per tensor; a tensor
    whose bytes come from a function (router rows, healed routers) is its own task."""
    tasks: list[Callable[[], bytes]] = []
    ranges: list[tuple[int, int]] = []
    for t in tensors:
        if callable(t.source):
            tasks += part_readers(store, file, ranges, part)
            tasks.append(ReadTask(t.source, t.nbytes))
            ranges = []
        else:
            ranges += t.source
    return tasks + part_readers(store, file, ranges, part)


@dataclass(frozen=True)
class Later:
    """Parts not known yet (a shard whose experts are still being selected): `read_ahead` stops
    running ahead at it while it has parts in flight, and waits for `parts()` only when it has none."""
    ready: Callable[[], bool]
    parts: Callable[[], Iterable[Callable[[], bytes]]]


def read_ahead(parts: Iterable[Callable[[], bytes] | Later], pool: Executor | None = None, window: int = 4,
               budget: Budget | None = None) -> Iterable[bytes]:
    """Each part's bytes, in order. With a pool, up to `window` parts are fetched ahead while
    earlier ones are written, overlapping download and upload. With a `budget`, a part (a
    ReadTask: its nbytes) is sent only once its bytes are reserved, and they are freed when the
    consumer asks for the next part; while fetched parts wait to be taken, no reservation
    blocks (the consumer frees them), so reads and uploads sharing the budget cannot deadlock.
    `parts` may hold `Later`s, which stand for the parts they give once ready."""
    if pool is None:
        for p in parts:
            yield from (q() for q in p.parts()) if isinstance(p, Later) else [p()]
        return
    ahead: deque = deque()  # (future, bytes reserved)
    todo = iter(parts)
    nxt, holding = next(todo, None), 0
    try:
        while nxt is not None or ahead:
            while nxt is not None and len(ahead) < window:
                if isinstance(nxt, Later):
                    if ahead and not nxt.ready():
                        break
                    todo = chain(nxt.parts(), todo)
                    nxt = next(todo, None)
                    continue
                n = getattr(nxt, "nbytes", 0) if budget is not None else 0
                if n and not budget.acquire(n, read=True, block=not ahead):
                    break
                ahead.append((pool.submit(nxt), n))
                nxt = next(todo, None)
            future, holding = ahead.popleft()
            data = future.result()
            yield data
            del data
            if holding:
                budget.release(holding, read=True)
                holding = 0
    finally:  # the consumer stopped early (an error): free what is still reserved
        for future, n in ahead:
            future.cancel()
            holding += n
        if holding:
            budget.release(holding, read=True)
