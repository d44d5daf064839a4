"""Scale-out: W workers plus finalize give the single-worker build byte for byte."""

import pytest

from moe_proxy.build.pipeline import assign_shards, build_proxy, journal_name
from moe_proxy.cli import main
from moe_proxy.errors import CorruptCheckpoint
from moe_proxy.demo.tiny import make_tiny
from moe_proxy.build.verify import verify


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path = tmp_path_factory.mktemp("workers") / "dsv3"
    make_tiny("deepseek_v3", path, max_shard_size="60KB", mtp=True, num_hidden_layers=4, n_routed_experts=16,
              n_group=4, topk_group=2)
    return path


def files(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_three_workers_and_finalize_equal_one_worker(src, tmp_path):
    single = tmp_path / "single"
    build_proxy(str(src), str(single), experts=8)
    multi = tmp_path / "multi"
    shares = []
    for i in (2, 0, 1):  # any order
        shares.append(build_proxy(str(src), str(multi), experts=8, worker=i, workers=3))
    assert not (multi / "proxy-manifest.json").exists()
    assert sorted(f for s in shares for f in s["files"]) == sorted(f for f in files(single) if f.startswith("model-"))
    assert all(s["files"] for s in shares)  # every worker had work
    build_proxy(str(src), str(multi), experts=8, workers=3, finalize_only=True)
    assert files(multi) == files(single)
    assert verify(str(multi)).ok


def test_finalize_names_a_missing_or_corrupt_shard(src, tmp_path):
    dst = tmp_path / "p"
    for i in range(3):
        main(["build", str(src), str(dst), "--experts", "8", "--worker", str(i), "--workers", "3", "--no-progress"])
    victim = sorted(build_proxy(str(src), str(tmp_path / "q"), experts=8, worker=1, workers=3)["files"])[0]
    data = (dst / victim).read_bytes()
    (dst / victim).write_bytes(data[:-8] + b"\x00" * 8)
    with pytest.raises(CorruptCheckpoint, match=f"worker 1's shard {victim} is corrupt.*rerun worker 1"):
        build_proxy(str(src), str(dst), experts=8, workers=3, finalize_only=True)
    (dst / victim).unlink()
    with pytest.raises(CorruptCheckpoint, match=f"worker 1's shard {victim} is missing"):
        build_proxy(str(src), str(dst), experts=8, workers=3, finalize_only=True)
    assert not (dst / "proxy-manifest.json").exists()

    # Retrying worker 1 redoes only its own share; then finalize succeeds.
    before = {f.name: f.stat().st_mtime_ns for f in dst.iterdir()}
    redo = build_proxy(str(src), str(dst), experts=8, worker=1, workers=3)
    changed = {f.name for f in dst.iterdir() if before.get(f.name) != f.stat().st_mtime_ns}
    assert victim in changed and changed <= set(redo["files"]) | {journal_name(1, 3)}
    assert build_proxy(str(src), str(dst), experts=8, workers=3, finalize_only=True)["experts"]["after"] == 8
    assert verify(str(dst)).ok


def test_finalize_before_a_worker_ran(src, tmp_path):
    dst = tmp_path / "p"
    build_proxy(str(src), str(dst), experts=8, worker=0, workers=2)
    with pytest.raises(CorruptCheckpoint, match="worker 1 of 2 has not finished"):
        build_proxy(str(src), str(dst), experts=8, workers=2, finalize_only=True)


def test_partition_is_balanced_and_complete(src, tmp_path):
    from moe_proxy.build.pipeline import prepare
    from moe_proxy.build.expert_plan import PruningOptions

    p = prepare(str(src), str(tmp_path / "x"), PruningOptions(experts=8), False, False, None)
    for w in (1, 2, 3, 5):
        shares = assign_shards(p.shards, w)
        assert sorted(f for s in shares for f in s) == sorted(p.shards)
        assert shares == assign_shards(p.shards, w)
