"""Selecting experts while the shards stream (pruning/plan_ahead.py, issue 31 item 2): the same bytes as
selecting first, at any number of workers, each worker selecting only its own layers; resumable;
and selecting first where a layer's experts are split over shards."""

from __future__ import annotations

import json

import pytest

from moe_proxy.pruning import plan_ahead
from moe_proxy.pruning.build import build_proxy, build_share, finalize_build
from moe_proxy.pruning.shares import journal_name
from moe_proxy.pruning.steps import prepare
from moe_proxy.demo.tiny import make_tiny
from moe_proxy.errors import CorruptCheckpoint
from moe_proxy.options import PruningOptions
from moe_proxy.storage import LocalStore


@pytest.fixture
def src(dsv3_16):
    return dsv3_16


@pytest.fixture(scope="module")
def first_then_write(dsv3_16, tmp_path_factory):
    """The proxy as selected before anything is written (the path of calibrated and fitted builds)."""
    out = tmp_path_factory.mktemp("first") / "p"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plan_ahead, "applies", lambda *a: False)
        build_proxy(str(dsv3_16), str(out), experts=8)
    return files(out)


def files(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_selecting_ahead_gives_the_bytes_of_selecting_first(src, tmp_path, first_then_write, workers):
    dst = tmp_path / "p"
    for i in reversed(range(workers)):
        build_share(str(src), str(dst), experts=8, worker=i, workers=workers)
    assert not (dst / "proxy-manifest.json").exists()
    finalize_build(str(src), str(dst), experts=8, workers=workers)
    assert files(dst) == first_then_write  # every shard, and the manifest with each one's sha256


def test_each_worker_selects_only_the_layers_of_its_shards(src, tmp_path):
    dst = tmp_path / "p"
    p = prepare(str(src), str(tmp_path / "x"), PruningOptions(experts=8), False, False, None)
    assert p.planned is None  # (selected ahead)
    every = {b.prefix for b in p.layout.blocks}
    first, selected = p.layout.blocks[0].prefix, []
    for i in range(3):
        files_ = build_share(str(src), str(dst), experts=8, worker=i, workers=3).files
        selected.append(set(json.loads((dst / journal_name(i, 3)).read_text())["plan"]["selections"]))
        assert selected[i] == {b.prefix for b in p.blocks_of(list(files_))} | {first}, i
    assert any(s < every for s in selected), selected  # not every worker selected the whole model
    finalize_build(str(src), str(dst), experts=8, workers=3)
    manifest = json.loads((dst / "proxy-manifest.json").read_text())
    assert set(manifest["layers"]) == every


class Destination:
    """A local destination; subclasses watch or break its writers."""

    def __init__(self, root):
        self.store = LocalStore(root)
        self.uri = self.store.uri

    def __getattr__(self, name):
        return getattr(self.store, name)

    def writer(self, name):
        return self.store.writer(name)


def test_shards_without_routed_experts_need_no_selection(src, tmp_path, monkeypatch, first_then_write):
    """Every layer's selection fails: the shards before the first one with routed experts are
    written all the same, byte for byte as a build that selects first writes them, and none
    with routed experts is (the build fails there). No order is imposed on the two threads."""
    real = plan_ahead.plan_experts

    def no_selection(ckpt, layout, options, *args, **kwargs):
        if layout.blocks:  # a layer's selection (the call without blocks gives the counts and notes)
            raise RuntimeError("no layer can be selected")
        return real(ckpt, layout, options, *args, **kwargs)

    monkeypatch.setattr(plan_ahead, "plan_experts", no_selection)
    with pytest.raises(RuntimeError, match="no layer can be selected"):
        build_proxy(str(src), str(tmp_path / "p"), experts=8)
    p = prepare(str(src), str(tmp_path / "x"), PruningOptions(experts=8), False, False, None)
    expertless = {f for f in p.layout_shards if not p.blocks_of([f])}
    written = {f: data for f, data in files(tmp_path / "p").items() if f.startswith("model-")}
    assert next(iter(p.layout_shards)) in written and set(written) <= expertless, (sorted(written), expertless)
    assert all(data == first_then_write[f] for f, data in written.items())


class JournalFirst(Destination):
    """Notes, as each output shard's writer opens, whether worker 0 of 2's journal is there."""

    def __init__(self, root):
        super().__init__(root)
        self.journaled = []

    def writer(self, name):
        if name.startswith("model-"):
            self.journaled.append(self.store.exists(journal_name(0, 2)))
        return self.store.writer(name)


def test_a_worker_leaves_its_journal_before_its_first_shard(src, tmp_path):
    # Workers run at once: one that starts while another's first shard is there must find a
    # build in the destination, not files it did not write (which it refuses to touch).
    dst = JournalFirst(tmp_path / "p")
    build_share(str(src), dst, experts=8, worker=0, workers=2)
    assert dst.journaled and all(dst.journaled)
    build_share(str(src), str(tmp_path / "p"), experts=8, worker=1, workers=2)
    finalize_build(str(src), str(tmp_path / "p"), experts=8, workers=2)


class FailingDestination(Destination):
    """Fails the third output shard's first write, as a killed worker stops."""

    def __init__(self, root):
        super().__init__(root)
        self.shards = 0

    def writer(self, name):
        w = self.store.writer(name)
        if name.startswith("model-"):
            self.shards += 1
            if self.shards == 3:
                def fail(data):
                    raise OSError("killed")
                w.write = fail
        return w


def test_an_interrupted_worker_resumes_and_finalize_refuses_it_until_then(src, tmp_path, first_then_write):
    dst = tmp_path / "p"
    build_share(str(src), str(dst), experts=8, worker=1, workers=2)
    with pytest.raises(OSError, match="killed"):
        build_share(str(src), FailingDestination(dst), experts=8, worker=0, workers=2)
    j = json.loads((dst / journal_name(0, 2)).read_text())
    assert len(j["files"]) == 2 and "complete" not in j  # the shards written so far, their layers' selections
    with pytest.raises(CorruptCheckpoint, match="worker 0 of 2 has not finished: its journal .* interrupted run"):
        finalize_build(str(src), str(dst), experts=8, workers=2)
    kept = {f: (dst / f).stat().st_mtime_ns for f in j["files"]}
    build_share(str(src), str(dst), experts=8, worker=0, workers=2)
    assert {f: (dst / f).stat().st_mtime_ns for f in kept} == kept  # resumed: not written again
    finalize_build(str(src), str(dst), experts=8, workers=2)
    assert files(dst) == first_then_write


def split_experts(src, dst):
    """src resharded so that each MoE layer's experts lie in two shards, half in each."""
    from safetensors.torch import load_file, save_file

    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    shards: dict[str, dict] = {}
    for name, t in tensors.items():
        parts = name.split(".")
        half = int(parts[parts.index("experts") + 1]) // 4 if "experts" in parts and parts[
            parts.index("experts") + 1].isdigit() else 0
        shards.setdefault(f"model-{half}.safetensors", {})[name] = t
    dst.mkdir()
    for f, ts in shards.items():
        save_file(ts, str(dst / f), metadata={"format": "pt"})
    (dst / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, ts in shards.items() for n in ts}}))
    for f in src.iterdir():
        if f.suffix == ".json" and f.name != "model.safetensors.index.json":
            (dst / f.name).write_bytes(f.read_bytes())


def test_a_layer_split_over_shards_is_selected_first(tmp_path):
    make_tiny("qwen3_moe", tmp_path / "q", max_shard_size="100KB")
    split_experts(tmp_path / "q", tmp_path / "src")
    p = prepare(str(tmp_path / "src"), str(tmp_path / "x"), PruningOptions(experts=4), False, False, None)
    assert p.planned is not None  # which experts are kept decides each shard's size: selected before writing
    build_proxy(str(tmp_path / "src"), str(tmp_path / "one"), experts=4)
    for i in range(2):
        build_share(str(tmp_path / "src"), str(tmp_path / "two"), experts=4, worker=i, workers=2)
    finalize_build(str(tmp_path / "src"), str(tmp_path / "two"), experts=4, workers=2)
    assert files(tmp_path / "two") == files(tmp_path / "one")
