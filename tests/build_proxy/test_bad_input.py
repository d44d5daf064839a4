"""Bad input: a clear error naming the problem, and nothing written that looks complete."""

import json
import struct

import pytest
import torch
import transformers

import moe_proxy.pruning.steps as build_module
from moe_proxy.pruning.build import build_proxy
from moe_proxy.checkpoint.reader import MANIFEST
from moe_proxy.cli import main
from moe_proxy.errors import CorruptCheckpoint, DestinationExists, InvalidExpertCount, NotMoE, UnsupportedArchitecture
from moe_proxy.demo.tiny import make_tiny
from moe_proxy.pruning.verify import verify

from .corrupt import edit_config, edit_shard, renumber_expert, shard_of


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path = tmp_path_factory.mktemp("bad") / "qwen3"
    make_tiny("qwen3_moe", path, max_shard_size="100KB")
    return path


@pytest.fixture(scope="module")
def dsv3(tmp_path_factory):
    path = tmp_path_factory.mktemp("bad") / "dsv3"
    make_tiny("deepseek_v3", path, n_routed_experts=16, n_group=4, topk_group=2)
    return path


def no_proxy(dst):
    assert not (dst / MANIFEST).exists()


def test_dense_model(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   intermediate_size=64)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "llama")
    with pytest.raises(NotMoE, match="not a mixture-of-experts model"):
        build_proxy(str(tmp_path / "llama"), str(tmp_path / "out"), experts=2)
    no_proxy(tmp_path / "out")


def test_unknown_architecture_lists_supported(src, tmp_path):
    fake = tmp_path / "fake"
    fake.mkdir()
    for f in src.iterdir():
        (fake / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((fake / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "mystery_moe", ["MysteryMoeForCausalLM"]
    (fake / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitecture, match=r"'mystery_moe'.*supported: Mixtral.*Qwen3-MoE.*GPT-OSS"):
        build_proxy(str(fake), str(tmp_path / "out"), experts=2)


@pytest.mark.parametrize("n, message", [(9, "has 8 routed experts"), (0, "has 8 routed experts"),
                                        (-1, "valid values: 1, 2, 3, 4, 5, 6, 7, 8")])
def test_impossible_expert_counts(src, tmp_path, n, message):
    with pytest.raises(InvalidExpertCount, match=message):
        build_proxy(str(src), str(tmp_path / "out"), experts=n)
    no_proxy(tmp_path / "out")


@pytest.mark.parametrize("n", [6, 4, 17])
def test_counts_that_break_grouped_routing(dsv3, tmp_path, n):
    with pytest.raises(InvalidExpertCount, match="valid values: 8, 12, 16"):
        build_proxy(str(dsv3), str(tmp_path / "out"), experts=n)


def test_keep_ratio_rounds_to_valid_grouped_count(dsv3, tmp_path):
    m = build_proxy(str(dsv3), str(tmp_path / "out"), keep_ratio=0.5)
    assert m["experts"]["after"] == 8
    kept = m["layers"]["model.layers.1.mlp"]["kept"]
    assert [sum(1 for e in kept if e // 4 == g) for g in range(4)] == [2, 2, 2, 2]


def test_pin_out_of_range(src, tmp_path):
    with pytest.raises(InvalidExpertCount, match="experts are numbered 0..7"):
        build_proxy(str(src), str(tmp_path / "out"), experts=2, pins={1: [8]})
    with pytest.raises(InvalidExpertCount, match=r"no routed experts; MoE layers: \[1\]"):
        build_proxy(str(src), str(tmp_path / "out"), experts=2, pins={0: [1]})


def copy_of(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def first_shard(path):
    return path / sorted(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values())[0]


def test_header_not_json(src, tmp_path):
    bad = copy_of(src, tmp_path / "c")
    shard = first_shard(bad)
    data = shard.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    shard.write_bytes(data[:8] + b"{" + b"x" * (n - 1) + data[8 + n:])
    with pytest.raises(CorruptCheckpoint, match=f"{shard.name}: safetensors header is not valid JSON"):
        build_proxy(str(bad), str(tmp_path / "out"), experts=2)


def test_header_length_exceeds_file(src, tmp_path):
    bad = copy_of(src, tmp_path / "c")
    shard = first_shard(bad)
    data = shard.read_bytes()
    shard.write_bytes(struct.pack("<Q", len(data) * 2) + data[8:])
    with pytest.raises(CorruptCheckpoint, match="header length .* exceeds the file"):
        build_proxy(str(bad), str(tmp_path / "out"), experts=2)


def test_truncated_shard(src, tmp_path):
    bad = copy_of(src, tmp_path / "c")
    shard = first_shard(bad)
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CorruptCheckpoint, match="offsets .* exceed the file.*truncated"):
        build_proxy(str(bad), str(tmp_path / "out"), experts=2)


def test_shard_missing_from_index(src, tmp_path):
    bad = copy_of(src, tmp_path / "c")
    first_shard(bad).unlink()
    with pytest.raises(CorruptCheckpoint, match="missing: model-00001-of"):
        build_proxy(str(bad), str(tmp_path / "out"), experts=2)


def test_destination_with_a_different_proxy(src, tmp_path):
    dst = tmp_path / "out"
    build_proxy(str(src), str(dst), experts=4)
    again = build_proxy(str(src), str(dst), experts=4)
    assert again.up_to_date
    with pytest.raises(DestinationExists, match="already holds a different proxy.*--overwrite"):
        build_proxy(str(src), str(dst), experts=2)
    assert json.loads((dst / MANIFEST).read_text())["experts"]["after"] == 4  # untouched
    m = build_proxy(str(src), str(dst), experts=2, overwrite=True)
    assert m["experts"]["after"] == 2 and verify(str(dst)).ok


def test_destination_that_is_not_a_proxy(src, tmp_path):
    other = copy_of(src, tmp_path / "other")
    with pytest.raises(DestinationExists, match="not empty and is not a moe-proxy output"):
        build_proxy(str(src), str(other), experts=2)
    with pytest.raises(DestinationExists, match="is the source checkpoint itself"):
        build_proxy(str(src), str(src), experts=2, overwrite=True)


def test_run_killed_midway_leaves_no_manifest_and_rerun_completes(src, tmp_path, monkeypatch, caplog):
    dst = tmp_path / "out"
    real, calls = build_module.write_file, []

    def dies_in_third_file(store, name, pieces, *args):
        calls.append(name)

        def interrupted():
            yield next(iter(pieces))
            raise KeyboardInterrupt  # as a SIGINT halfway through a shard would

        return real(store, name, interrupted() if len(calls) == 3 else pieces, *args)

    monkeypatch.setattr(build_module, "write_file", dies_in_third_file)
    with pytest.raises(KeyboardInterrupt):
        build_proxy(str(src), str(dst), experts=2)
    no_proxy(dst)
    assert not any(p.name.startswith(".moe-proxy-tmp-") for p in dst.iterdir())  # partial file removed
    with pytest.raises(CorruptCheckpoint, match="not a complete proxy"):
        verify(str(dst))

    monkeypatch.setattr(build_module, "write_file", real)
    with caplog.at_level("INFO"):
        m = build_proxy(str(src), str(dst), experts=2)
    assert sum("already complete from an interrupted run" in r.message for r in caplog.records) == 2
    assert verify(str(dst)).ok and m["experts"]["after"] == 2


def test_cli_reports_errors_in_one_line(src, tmp_path, capsys):
    assert main(["build", str(tmp_path / "nowhere"), str(tmp_path / "out"), "--experts", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no config.json" in err


# The same damage that fails `verify` on a proxy stops a build of a source, naming the file.

def test_source_expert_numbering_gap(src, tmp_path):
    bad = copy_of(src, tmp_path / "c")
    shards = renumber_expert(bad, "model.layers.1.mlp", 5, 9)
    with pytest.raises(CorruptCheckpoint, match=rf"{shards[0]}.*missing \[5\], unexpected \[9\]"):
        build_proxy(str(bad), str(tmp_path / "out"), experts=2)
    no_proxy(tmp_path / "out")


def test_source_router_rows_disagree_with_config(src, tmp_path):
    bad = copy_of(src, tmp_path / "c")
    gate = "model.layers.1.mlp.gate.weight"
    shard = shard_of(bad, gate)
    edit_shard(bad, shard, lambda ts: ts | {gate: ts[gate][:7].clone()})
    with pytest.raises(CorruptCheckpoint, match=rf"{shard}: router tensor {gate} \[7, 64\].*expert count 8"):
        build_proxy(str(bad), str(tmp_path / "out"), experts=2)
    edit_config(copy_of(src, tmp_path / "d"), num_experts=6)
    with pytest.raises(CorruptCheckpoint, match=r"\[8, 64\] has no axis of config.json's expert count 6"):
        build_proxy(str(tmp_path / "d"), str(tmp_path / "out"), experts=2)
    no_proxy(tmp_path / "out")


def test_header_span_disagrees_with_shape(src, tmp_path):
    """A shape edited in the header (offsets untouched): the tensor's bytes no longer fit it."""
    bad = copy_of(src, tmp_path / "c")
    shard = first_shard(bad)
    data = shard.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"] = [2 * header[name]["shape"][0], *header[name]["shape"][1:]]
    raw = json.dumps(header, separators=(",", ":")).encode().ljust(n)  # safetensors pads with spaces too
    assert len(raw) == n
    shard.write_bytes(data[:8] + raw + data[8 + n:])
    with pytest.raises(CorruptCheckpoint, match=rf"{shard.name}: tensor '{name}' spans \d+ bytes, but"):
        build_proxy(str(bad), str(tmp_path / "out"), experts=2)


def test_index_names_a_tensor_its_shard_lacks(src, tmp_path):
    bad = copy_of(src, tmp_path / "c")
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.1.mlp.experts.8.up_proj.weight"] = first_shard(bad).name
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CorruptCheckpoint, match=r"not in the shard it names.*experts\.8\.up_proj"):
        build_proxy(str(bad), str(tmp_path / "out"), experts=2)


def test_cli_refuses_a_corrupt_source_with_status_2(src, tmp_path, capsys):
    bad = copy_of(src, tmp_path / "c")
    shard = first_shard(bad)
    shard.write_bytes(shard.read_bytes()[:-100])
    assert main(["build", str(bad), str(tmp_path / "out"), "--experts", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert shard.name in err and "truncated" in err
    no_proxy(tmp_path / "out")
