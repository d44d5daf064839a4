"""`moe_proxy.checkpoint.listing` on a local training run: which directories are checkpoints, at
which step, complete or not and why, and that only headers and small JSON files are read."""

from __future__ import annotations

import json

import pytest

from moe_proxy.checkpoint.listing import (DENSE, INDEX_HEAD, MOE, PROXY, UNKNOWN, CountingStore, find, latest_before,
                                   list_checkpoints, matches, step_of)
from moe_proxy.errors import StorageError
from moe_proxy.storage import LocalStore

from . import synthetic
from .conftest import HF

VERL = "global_step_*/actor/huggingface"


def by_step(entries):
    return {c.step: c for c in entries}


def test_verl_layout_by_pattern(local_run):
    found = list_checkpoints(str(local_run), pattern=VERL)
    assert [c.step for c in found] == [50, 100, 200, 300, 400, 500, 600, 1000]  # by number, not by text
    c = by_step(found)
    for step in (50, 100, 200, 1000):
        assert c[step].complete and c[step].kind == MOE and c[step].source, c[step]
        assert c[step].architecture == "Qwen3-MoE" and c[step].reason is None
        assert c[step].uri == f"{local_run}/global_step_{step}/{HF}"
    assert c[50].shards == 1 and c[100].shards == 2
    # Still uploading: the missing shard is named.
    assert not c[300].complete and not c[300].source
    assert c[300].reason == "1 of 2 shards missing: model-00002-of-00002.safetensors"
    # A crashed writer: the short shard and by how much.
    assert not c[400].complete
    assert c[400].reason.startswith("model-00002-of-00002.safetensors")
    assert "truncated" in c[400].reason
    # A matching directory without config.json yet.
    assert not c[500].complete and c[500].reason == "config.json missing" and c[500].kind == UNKNOWN
    # A dense model is complete but no source.
    assert c[600].complete and c[600].kind == DENSE and not c[600].source
    assert "not a mixture-of-experts" in c[600].reason
    # Sizes are the directory's files, from the listing.
    expected = sum(len(v) for k, v in synthetic.files().items())
    assert c[100].bytes == expected


def test_default_finds_every_config_json(local_run):
    found = list_checkpoints(str(local_run))
    paths = {c.path: c for c in found}
    # No pattern: directories with a config.json, the proxy and the Hydra folder included,
    # step 500 (no config.json yet) not.
    assert f"global_step_500/{HF}" not in paths
    proxy = paths[f"global_step_200/{HF}-proxies/team-a/run-step-200"]
    assert proxy.kind == PROXY and proxy.complete and not proxy.source and proxy.step == 200
    hydra = paths["hydra"]
    assert hydra.kind == UNKNOWN and not hydra.source and hydra.step is None
    assert "names no model" in hydra.reason
    assert found[-1] is hydra  # no step: listed last
    assert [c.step for c in found if c.source] == [50, 100, 200, 1000]


def test_a_proxy_being_written_is_not_a_source(tmp_path):
    """Under a *-proxies/ folder (moe-proxy's default destinations) even before its manifest."""
    content = synthetic.files()
    synthetic.write(tmp_path / "global_step_7-proxies" / "ns" / "p", content)
    (entry,) = list_checkpoints(str(tmp_path))
    assert entry.kind == PROXY and entry.complete and not entry.source


def test_reads_only_headers_and_json(local_run, tree):
    """Every byte read is a JSON file or a shard's length prefix and header: never tensor data."""
    store, reads = recorded(local_run)
    found = list_checkpoints(store, pattern=VERL)
    assert len(found) == 8
    for name, start, length in reads:
        if name.endswith(".json"):
            assert start == 0 and length in (len(tree[name]), INDEX_HEAD), name  # whole, or the index's start
        else:
            assert name.endswith(".safetensors")
            assert start + length <= synthetic.header_size(tree[name]), (name, start, length)
    assert store.bytes_read == sum(n for _, _, n in reads)
    # What the listing needs, and no more: JSON files, shards' 8-byte length prefixes, and
    # headers only where sizes do not add up; a step whose config or shard list is incomplete
    # stops early.
    total = sum(len(v) for v in tree.values())
    assert store.bytes_read < total / 50
    shards_read = {name for name, _, _ in reads if name.endswith(".safetensors")}
    assert not any(name.startswith(("global_step_300/", "global_step_500/")) for name in shards_read)


def test_step_from_path():
    assert step_of("global_step_300/actor/huggingface") == 300
    assert step_of("run2/ckpt-7/iter_0000300") == 300  # the last integer by default
    assert step_of("run2/ckpt-7/iter_0000300", r"ckpt-(\d+)") == 7
    assert step_of("hf", r"step_(\d+)") is None
    assert step_of("hydra") is None


def test_glob_stays_within_a_segment():
    assert matches("global_step_1/actor/huggingface", VERL)
    assert not matches("global_step_1/actor/huggingface-proxies/a/b", VERL)
    assert not matches("x/global_step_1/actor/huggingface", VERL)
    assert matches("x/global_step_1/actor/huggingface", "**/global_step_*/actor/huggingface")
    assert matches("global_step_1/actor/huggingface", "**/global_step_*/actor/huggingface")


def test_step_regex_filters_and_numbers(tmp_path):
    for path in ("iter_0000100/hf", "iter_0000200/hf", "best/hf"):
        synthetic.write(tmp_path / path, synthetic.files(shards=1))
    found = list_checkpoints(str(tmp_path), step_regex=r"iter_(\d+)")
    assert [(c.path, c.step) for c in found] == [("iter_0000100/hf", 100), ("iter_0000200/hf", 200), ("best/hf", None)]


def test_latest_before_picks_the_checkpoint_before_a_failure(local_run):
    found = list_checkpoints(str(local_run), pattern=VERL)
    assert latest_before(found, 1000).step == 200  # 300 and 400 are incomplete, 600 is dense
    assert latest_before(found, 201).step == 200
    assert latest_before(found, 200).step == 100
    assert latest_before(found, 50) is None


@pytest.mark.parametrize("damage, reason, deep", [
    (lambda d: d[:5], "too short for a safetensors file", False),
    (lambda d: d[:8] + b"{not json" + d[17:], "header is not valid JSON", True),  # same size: deep only
    (lambda d: d + b"\0" * 16, "trailing bytes", False),
], ids=["stub", "garbage-header", "trailing-bytes"])
def test_damaged_shards_are_named(tmp_path, damage, reason, deep):
    content = synthetic.files()
    content["model-00001-of-00002.safetensors"] = damage(content["model-00001-of-00002.safetensors"])
    synthetic.write(tmp_path / "global_step_9", content)
    (entry,) = list_checkpoints(str(tmp_path), deep=deep)
    assert not entry.complete and not entry.source
    assert entry.reason.startswith("model-00001-of-00002.safetensors") and reason in entry.reason, entry.reason


def test_index_naming_a_tensor_its_shard_lacks(tmp_path):
    content = synthetic.files()
    index = json.loads(content["model.safetensors.index.json"])
    index["weight_map"]["model.extra.weight"] = "model-00001-of-00002.safetensors"
    content["model.safetensors.index.json"] = json.dumps(index).encode()
    synthetic.write(tmp_path / "step_1", content)
    (entry,) = list_checkpoints(str(tmp_path), deep=True)
    assert not entry.complete and "'model.extra.weight'" in entry.reason


def test_a_real_transformers_checkpoint_is_complete(tmp_path):
    from moe_proxy.demo.tiny import make_tiny

    make_tiny("qwen3_moe", tmp_path / "global_step_3" / "actor" / "huggingface", max_shard_size="100KB")
    (entry,) = list_checkpoints(str(tmp_path), pattern=VERL)
    assert entry.complete and entry.source and entry.shards > 1 and entry.step == 3, entry


def test_missing_directory_is_an_error(tmp_path):
    with pytest.raises(StorageError, match="no such directory"):
        list_checkpoints(str(tmp_path / "nope"))


def test_find_reads_nothing(local_run):
    store = CountingStore(LocalStore(local_run))
    candidates = find(store, VERL)
    assert [c.step for c in candidates] == [50, 100, 200, 300, 400, 500, 600, 1000]
    assert store.bytes_read == 0 and store.reads == 0


def recorded(root):
    """A store that records every read: (file, start, length)."""
    reads: list[tuple[str, int, int]] = []

    class Recording(CountingStore):
        def read_range(self, name, start, length):
            reads.append((name, start, length))
            return super().read_range(name, start, length)

        def read_bytes(self, name):
            data = super().read_bytes(name)
            reads.append((name, 0, len(data)))
            return data

    return Recording(LocalStore(root)), reads


def test_quick_check_reads_8_bytes_per_shard(tmp_path):
    """A complete sharded checkpoint is decided by config.json, the start of the index and each
    shard's length prefix: no header, no weight map beyond the first few KB."""
    content = synthetic.files(shards=4)
    index = json.loads(content["model.safetensors.index.json"])
    index["weight_map"].update({f"padding.{i}": "model-00001-of-00004.safetensors" for i in range(3000)})
    content["model.safetensors.index.json"] = json.dumps(index).encode()  # > 64 KB, like a real one
    synthetic.write(tmp_path / "step_1", content)
    store, reads = recorded(tmp_path)
    (entry,) = list_checkpoints(store)
    assert entry.complete and entry.shards == 4
    assert sorted((n, s, k) for n, s, k in reads if n.endswith(".safetensors")) == \
        [(f"step_1/model-0000{i}-of-00004.safetensors", 0, 8) for i in range(1, 5)]
    assert ("step_1/model.safetensors.index.json", 0, INDEX_HEAD) in reads
    assert store.bytes_read < len(content["model.safetensors.index.json"]) / 2


@pytest.mark.parametrize("change", [
    "total_size wrong", "no total_size", "weight_map first", "unconventional names", "leftover shards",
])
def test_quick_check_defers_to_the_deep_one(tmp_path, change):
    """When names and sizes cannot decide, the headers are read and the answer is still right."""
    content = synthetic.files()
    index = json.loads(content["model.safetensors.index.json"])
    if change == "total_size wrong":  # some converters write a parameter count here
        index["metadata"]["total_size"] //= 2
    elif change == "no total_size":
        index["metadata"] = {}
    elif change == "weight_map first":
        index = {"weight_map": index["weight_map"], "metadata": index["metadata"]}
    elif change == "unconventional names":
        for old in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
            new = old.replace("model-0000", "part").replace("-of-00002", "")
            content[new] = content.pop(old)
            index["weight_map"] = {k: new if v == old else v for k, v in index["weight_map"].items()}
    else:  # an earlier save with another sharding left a file behind
        content["model-00001-of-00003.safetensors"] = content["model-00001-of-00002.safetensors"]
    content["model.safetensors.index.json"] = json.dumps(index).encode()
    synthetic.write(tmp_path / "step_1", content)
    store, reads = recorded(tmp_path)
    (entry,) = list_checkpoints(store)
    assert entry.complete and entry.shards == 2, entry
    assert any(n.endswith(".safetensors") and k > 8 for n, _, k in reads)  # headers were read

    # ... and a shard cut short in its data is still named.
    shard = sorted(n for n in content if n.endswith(".safetensors") and n in json.dumps(index["weight_map"]))[0]
    (tmp_path / "step_1" / shard).write_bytes(content[shard][:-100])
    (entry,) = list_checkpoints(str(tmp_path))
    assert not entry.complete and entry.reason.startswith(shard) and "truncated" in entry.reason, entry.reason


def test_deep_reads_every_header(tmp_path):
    content = synthetic.files(shards=3)
    synthetic.write(tmp_path / "step_1", content)
    store, reads = recorded(tmp_path)
    (entry,) = list_checkpoints(store, deep=True)
    assert entry.complete and entry.shards == 3
    for name in (n for n in content if n.endswith(".safetensors")):
        assert (f"step_1/{name}", 8, synthetic.header_size(content[name]) - 8) in reads
    assert (f"step_1/model.safetensors.index.json", 0, len(content["model.safetensors.index.json"])) in reads


def test_a_nested_proxys_step_is_its_sources_not_its_names():
    """#32 item 11: `proxy-8` under step 200's proxies folder is step 200."""
    from moe_proxy.checkpoint.listing import step_of

    assert step_of("global_step_200/actor/huggingface-proxies/team-a/proxy-8") == 200
    assert step_of("global_step_7-proxies/ns/p12") == 7
    assert step_of("run/global_step_30/actor/huggingface") == 30  # no proxies folder: the last integer
