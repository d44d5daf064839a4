"""Reads and uploads in flight stay within one byte budget (storage/inflight.py), whatever the
concurrency: measured by the sources' own counts and by Python's allocations, not only by the
budget's word."""

import threading
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import pytest

from moe_proxy.options import PruningOptions
from moe_proxy.pruning.build import build_proxy
from moe_proxy.pruning.steps import prepare, write_share
from moe_proxy.checkpoint.reads import ReadTask, read_ahead
from moe_proxy.demo.tiny import make_tiny
from moe_proxy.storage import LocalStore
from moe_proxy.storage.inflight import MiB, Budget, Transfer

KiB = 1 << 10


class Held:
    """Bytes a read path holds: counted up when a read starts, down when the consumer is done."""

    def __init__(self):
        self.lock = threading.Lock()
        self.now = self.peak = 0

    def add(self, n: int) -> None:
        with self.lock:
            self.now += n
            self.peak = max(self.peak, self.now)


def test_read_ahead_holds_at_most_half_the_budget_ahead_of_a_slow_consumer():
    def run(budget):
        held = Held()

        def fetch(n=128 * KiB):
            held.add(n)
            return bytes(n)

        tasks = [ReadTask(fetch, 128 * KiB) for _ in range(40)]
        with ThreadPoolExecutor(32) as pool:
            for data in read_ahead(tasks, pool, window=32, budget=budget):
                time.sleep(0.002)  # a slow writer: reads would race ahead
                held.add(-len(data))
        return held.peak

    budget = Budget(1 * MiB)
    assert run(budget) <= 512 * KiB  # reads hold at most half the budget
    assert budget.held == 0 and budget.peak <= 512 * KiB
    assert run(None) > 1 * MiB  # without a budget the same read-ahead holds far more: the check bites


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """Two MoE layers of 16 experts of 384 KiB, 2 shards: keeping 8 is ~6 MB of reads."""
    path = tmp_path_factory.mktemp("inflight") / "qwen3"
    make_tiny("qwen3_moe", path, max_shard_size="8MB", hidden_size=128, moe_intermediate_size=256,
              num_experts=16, num_experts_per_tok=2, mlp_only_layers=[])
    # One build first, unmeasured: the selection's imports (torch, scikit-learn: ~55 MiB once
    # per process) are not bytes a build holds in flight.
    build_proxy(str(path), str(path.parent / "warm"), experts=8)
    return path


class SlowSource(LocalStore):
    """Reads that take a while, counting the bytes requested at once."""

    def __init__(self, root):
        super().__init__(root)
        self.held = Held()

    def read_range(self, name, start, length):
        self.held.add(length)
        try:
            time.sleep(0.001)
            return super().read_range(name, start, length)
        finally:
            self.held.add(-length)


class SlowDestination(LocalStore):
    """A destination slower than the source, so reads would pile up without a budget."""

    def writer(self, name):
        w = super().writer(name)
        write = w.write

        def slow(data):
            time.sleep(0.003)
            return write(data)

        w.write = slow
        return w


@pytest.mark.parametrize("streams", [2, 32])
def test_a_build_stays_within_its_inflight_budget_at_every_concurrency(src, tmp_path, streams):
    store = SlowSource(src)
    transfer = Transfer(max_inflight=1 * MiB, streams=streams, read_part=128 * KiB)
    p = prepare(store, SlowDestination(tmp_path / "dst"), PruningOptions(experts=8), overwrite=False,
                progress=False, store_options={"transfer": transfer})
    tracemalloc.start()
    try:
        written = write_share(p, 0, 1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    data = sum(w.size for w in written.values())
    assert data > 4 * MiB  # far more than the budget went through
    assert transfer.streams == streams and transfer.read_part <= 128 * KiB
    assert 0 < transfer.budget.peak <= 512 * KiB and transfer.budget.held == 0
    assert store.held.peak <= 512 * KiB  # requests at once, counted by the source itself
    # Everything the write allocated: the reads it held, the piece being written and hashed,
    # headers and journal, and the experts being selected meanwhile (plan_ahead.py: measured
    # ~0.45 MiB here, one layer's weight features); 32 streams of 128 KiB unbudgeted would be
    # 4 MiB on their own.
    one_expert = 384 * KiB
    assert peak < 1 * MiB + one_expert, f"peak {peak / MiB:.2f} MiB"


def test_a_budget_smaller_than_a_read_part_still_builds_the_same_proxy(src, tmp_path):
    small = build_proxy(str(src), str(tmp_path / "small"), experts=8,
                        store_options={"max_inflight_mb": 0.1, "read_part_mb": 1, "streams": 8})
    plain = build_proxy(str(src), str(tmp_path / "plain"), experts=8)
    assert small["files"] == plain["files"]
