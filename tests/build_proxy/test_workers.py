"""Scale-out: W workers plus finalize give the single-worker build byte for byte."""

import pytest

from moe_proxy.pruning.build import build_proxy, build_share, finalize_build
from moe_proxy.pruning.shares import assign_shards, journal_name
from moe_proxy.cli import main
from moe_proxy.errors import CorruptCheckpoint
from moe_proxy.pruning.verify import verify


@pytest.fixture
def src(dsv3_16):
    return dsv3_16


def files(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_three_workers_and_finalize_equal_one_worker(src, tmp_path):
    single = tmp_path / "single"
    build_proxy(str(src), str(single), experts=8)
    multi = tmp_path / "multi"
    shares = []
    for i in (2, 0, 1):  # any order
        shares.append(build_share(str(src), str(multi), experts=8, worker=i, workers=3))
    assert not (multi / "proxy-manifest.json").exists()
    assert sorted(f for s in shares for f in s.files) == sorted(f for f in files(single) if f.startswith("model-"))
    assert all(s.files for s in shares)  # every worker had work
    finalize_build(str(src), str(multi), experts=8, workers=3)
    assert files(multi) == files(single)
    assert verify(str(multi)).ok


def test_finalize_names_a_missing_or_corrupt_shard(src, tmp_path):
    dst = tmp_path / "p"
    for i in range(3):
        main(["build", str(src), str(dst), "--experts", "8", "--worker", str(i), "--workers", "3", "--no-progress"])
    victim = sorted(build_share(str(src), str(tmp_path / "q"), experts=8, worker=1, workers=3).files)[0]
    data = (dst / victim).read_bytes()
    (dst / victim).write_bytes(data[:-8] + b"\x00" * 8)
    with pytest.raises(CorruptCheckpoint, match=f"worker 1's shard {victim} is corrupt.*rerun worker 1"):
        finalize_build(str(src), str(dst), experts=8, workers=3)
    (dst / victim).unlink()
    with pytest.raises(CorruptCheckpoint, match=f"worker 1's shard {victim} is missing"):
        finalize_build(str(src), str(dst), experts=8, workers=3)
    assert not (dst / "proxy-manifest.json").exists()

    # Retrying worker 1 redoes only its own share; then finalize succeeds.
    before = {f.name: f.stat().st_mtime_ns for f in dst.iterdir()}
    redo = build_share(str(src), str(dst), experts=8, worker=1, workers=3)
    changed = {f.name for f in dst.iterdir() if before.get(f.name) != f.stat().st_mtime_ns}
    assert victim in changed and changed <= set(redo.files) | {journal_name(1, 3)}
    assert finalize_build(str(src), str(dst), experts=8, workers=3)["experts"]["after"] == 8
    assert verify(str(dst)).ok


def test_finalize_before_a_worker_ran(src, tmp_path):
    dst = tmp_path / "p"
    build_share(str(src), str(dst), experts=8, worker=0, workers=2)
    with pytest.raises(CorruptCheckpoint, match="worker 1 of 2 has not finished"):
        finalize_build(str(src), str(dst), experts=8, workers=2)


def test_partition_is_balanced_and_complete(src, tmp_path):
    """Every shard once; no worker's bytes above 1.02 x the mean, unless one shard alone is (the
    embeddings' here, at 5 workers: it then sets the most loaded worker). Split in file order,
    round robin or in runs, the heaviest worker gets 1.2-1.7 x the mean."""
    from moe_proxy.pruning.steps import prepare
    from moe_proxy.pruning.writer import shard_size
    from moe_proxy.options import PruningOptions

    p = prepare(str(src), str(tmp_path / "x"), PruningOptions(experts=8), False, False, None)
    size = {f: shard_size(ts) for f, ts in p.shards.items()}
    for w in (1, 2, 3, 5):
        shares = assign_shards(p.shards, w)
        assert sorted(f for s in shares for f in s) == sorted(p.shards)
        assert shares == assign_shards(p.shards, w)
        loads = [sum(size[f] for f in s) for s in shares]
        assert max(loads) <= max(1.02 * sum(loads) / w, max(size.values())), (w, loads)


def test_split_balances_bytes_where_largest_first_does_not():
    from moe_proxy.pruning.writer import OutTensor, shard_size

    # The 8 GB benchmark checkpoint's proxy shards: two with the embeddings, 18 equal layer shards.
    # Largest-first alone gives two workers 5 shards' worth more: 518 MB against a 451 MB mean.
    mb = [208_500_000, 201_600_000] + [77_400_000] * 18
    shards = {f"model-{i:05d}.safetensors": [OutTensor("w", "BF16", (n // 2,), [])] for i, n in enumerate(mb)}
    shares = assign_shards(shards, 4)
    loads = [sum(shard_size(shards[f]) for f in s) for s in shares]
    assert sorted(f for s in shares for f in s) == sorted(shards)
    assert max(loads) <= 1.04 * sum(loads) / 4, loads
    assert shares == assign_shards(shards, 4)  # deterministic: every worker computes the same split


def _two_workers(src, dst):
    for i in range(2):
        build_share(str(src), str(dst), experts=8, worker=i, workers=2)


def test_finalize_takes_the_workers_plan(src, tmp_path, monkeypatch):
    import sys

    import moe_proxy.pruning.steps as pipeline

    single = tmp_path / "single"
    build_proxy(str(src), str(single), experts=8)
    multi = tmp_path / "multi"
    _two_workers(src, multi)

    def replan(*args, **kwargs):
        raise AssertionError("finalize planned the experts again")

    monkeypatch.setattr(pipeline, "plan_experts", replan)
    monkeypatch.setitem(sys.modules, "sklearn.cluster", None)  # nor can it cluster: importing it fails
    finalize_build(str(src), str(multi), experts=8, workers=2)
    assert files(multi) == files(single)


def test_finalize_refuses_workers_that_selected_differently(src, tmp_path):
    import json

    dst = tmp_path / "p"
    _two_workers(src, dst)
    journal = dst / journal_name(1, 2)
    original = journal.read_text()
    j = json.loads(original)
    # each worker selects its own shards' layers and the first MoE layer, which finalize compares
    layer = sorted(set(j["plan"]["selections"]) & set(json.loads((dst / journal_name(0, 2)).read_text())["plan"][
        "selections"]))[0]
    kept = j["plan"]["selections"][layer]["kept"]
    j["plan"]["selections"][layer]["kept"] = [min(set(range(16)) - set(kept))] + kept[1:]  # another expert
    journal.write_text(json.dumps(j))
    with pytest.raises(CorruptCheckpoint, match=f"worker 1 selected other experts than worker 0 \\({layer}: kept"):
        finalize_build(str(src), str(dst), experts=8, workers=2)

    # Both journals agree on a plan that is no valid choice for this checkpoint: refused too.
    journal.write_text(original)
    for i in range(2):
        j = json.loads((dst / journal_name(i, 2)).read_text())
        j["plan"]["selections"][layer]["kept"] = kept[:-1]
        (dst / journal_name(i, 2)).write_text(json.dumps(j))
    with pytest.raises(CorruptCheckpoint, match=f"plan for {layer} .* is not a valid choice of 8"):
        finalize_build(str(src), str(dst), experts=8, workers=2)

    # A journal of another build (other options): refused, naming the worker to rerun.
    build_share(str(src), str(tmp_path / "other"), experts=12, worker=0, workers=2)
    (dst / journal_name(0, 2)).write_text((tmp_path / "other" / journal_name(0, 2)).read_text())
    with pytest.raises(CorruptCheckpoint, match="worker 0's journal .* is of another build.*rerun worker 0"):
        finalize_build(str(src), str(dst), experts=8, workers=2)
    assert not (dst / "proxy-manifest.json").exists()


def test_a_rerun_worker_keeps_no_shard_of_another_plan(src, tmp_path):
    import json

    dst = tmp_path / "p"
    build_share(str(src), str(dst), experts=8, worker=0, workers=2)
    journal = dst / journal_name(0, 2)
    j = json.loads(journal.read_text())
    layer = sorted(j["plan"]["selections"])[0]
    kept = j["plan"]["selections"][layer]["kept"]
    j["plan"]["selections"][layer]["kept"] = [min(set(range(16)) - set(kept))] + kept[1:]  # another expert
    journal.write_text(json.dumps(j))
    before = {f.name: f.stat().st_mtime_ns for f in dst.iterdir() if f.name.startswith("model-")}
    build_share(str(src), str(dst), experts=8, worker=0, workers=2)
    assert before and all(f.stat().st_mtime_ns != before[f.name] for f in dst.iterdir() if f.name in before)


class RecordingDestination:
    """A local destination that logs each file's first write and its commit, and holds a
    shard's commit until a later shard's first bytes arrived (5 s at most; the last shard is
    not held): the log's order shows whether uploads overlap, nothing is timed."""

    def __init__(self, root):
        from moe_proxy.storage import LocalStore

        self.store, self.events, self.names, self.started, self.last = LocalStore(root), [], [], [], None
        self.uri = self.store.uri

    def __getattr__(self, name):
        return getattr(self.store, name)

    def writer(self, name):
        import threading
        import time

        w, index = self.store.writer(name), len(self.names)
        self.names.append(name)
        self.started.append(threading.Event())
        write, commit = w.write, w.commit

        def logged_write(data):
            if not self.started[index].is_set():
                self.events.append(("write", name))
                self.started[index].set()
            return write(data)

        def held_commit():
            later = lambda: any(e.is_set() for n, e in zip(self.names[index + 1:], self.started[index + 1:])
                                if n.startswith("model-"))
            deadline = time.monotonic() + 5
            while name.startswith("model-") and name != self.last and not later() and time.monotonic() < deadline:
                time.sleep(0.01)
            commit()
            self.events.append(("commit", name))

        w.write, w.commit = logged_write, held_commit
        return w


def test_uploads_overlap_by_one_shard_and_commit_in_order(src, tmp_path):
    from moe_proxy.options import PruningOptions
    from moe_proxy.pruning.steps import prepare, write_share

    dst = RecordingDestination(tmp_path / "dst")
    p = prepare(str(src), dst, PruningOptions(experts=8), False, False, None)
    dst.last = list(p.shards)[-1]
    written = write_share(p, 0, 1)
    shards = [f for f in p.shards if f in written]
    events = dst.events
    commits = [n for kind, n in events if kind == "commit" and n in written]
    assert commits == shards  # one at a time, in shard order
    for f, g in zip(shards, shards[1:]):
        # the next shard's first bytes went up before this one's commit, and it was committed
        # only after this one's journal entry was written
        assert events.index(("write", g)) < events.index(("commit", f)), (f, g)
        journal_after_f = [i for i, e in enumerate(events) if e == ("commit", journal_name(0, 1))
                           and i > events.index(("commit", f))]
        assert journal_after_f and journal_after_f[0] < events.index(("commit", g))
