"""`verify` on damaged proxies: each integrity claim has a real corruption of a real proxy
that makes it fail, naming the file and the reason, with exit status 1 from the CLI.
Damage that a bad tool could hide (a re-hashed manifest) is caught by the later checks."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

from moe_proxy.pruning.build import build_proxy
from moe_proxy.checkpoint.reader import MANIFEST
from moe_proxy.cli import main
from moe_proxy.demo.tiny import make_tiny
from moe_proxy.pruning.verify import verify

from .corrupt import edit_config, edit_shard, renumber_expert, shard_of

BLOCK = "model.layers.1.mlp"  # qwen3_moe tiny: layer 0 is dense (mlp_only_layers=[0])


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify")
    make_tiny("qwen3_moe", root / "src", max_shard_size="100KB")
    build_proxy(str(root / "src"), str(root / "proxy"), experts=4)
    assert verify(str(root / "proxy")).ok
    return root / "proxy"


@pytest.fixture
def proxy(good, tmp_path):
    return shutil.copytree(good, tmp_path / "proxy")


def failed(path, *expected, forward=False):
    """verify reports not OK, and one problem contains all of `expected`."""
    report = verify(str(path), forward=forward)
    assert not report.ok
    assert any(all(e in p for e in expected) for p in report.problems), report.problems
    return report


def test_changed_bytes_fail_the_hash(proxy):
    shard = shard_of(proxy, f"{BLOCK}.experts.0.up_proj.weight")
    data = bytearray((proxy / shard).read_bytes())
    data[-10] ^= 0xFF  # inside the last tensor's data: same size, headers still valid
    (proxy / shard).write_bytes(bytes(data))
    report = failed(proxy, shard, "sha256 differs from the manifest", forward=True)
    assert report.forward == "skipped"  # a damaged proxy is not loaded


def test_truncated_shard(proxy):
    shard = shard_of(proxy, f"{BLOCK}.gate.weight")
    size = (proxy / shard).stat().st_size
    (proxy / shard).write_bytes((proxy / shard).read_bytes()[:-100])
    failed(proxy, shard, f"{size - 100} bytes, manifest says {size}", "truncated")
    failed(proxy, shard, "exceed the file", "truncated")  # its header no longer fits either


def test_file_missing_or_unlisted(proxy):
    shard = shard_of(proxy, f"{BLOCK}.gate.weight")
    manifest = json.loads((proxy / MANIFEST).read_text())
    del manifest["files"][shard]
    (proxy / MANIFEST).write_text(json.dumps(manifest))
    failed(proxy, shard, "not listed in the manifest")
    (proxy / "config.json").unlink()
    failed(proxy, "config.json", "listed in the manifest but missing")


def test_expert_numbering_gap(proxy):
    """Expert 3 renumbered 4 (and the index and manifest made to agree): transformers would
    load this without a word and route to an uninitialised expert."""
    shards = renumber_expert(proxy, BLOCK, 3, 4)
    failed(proxy, *shards, BLOCK, "missing [3], unexpected [4]", "config's 4 experts numbered 0..3")


def test_router_rows_disagree_with_config(proxy):
    shard = shard_of(proxy, f"{BLOCK}.gate.weight")
    edit_shard(proxy, shard, lambda ts: ts | {f"{BLOCK}.gate.weight": ts[f"{BLOCK}.gate.weight"][:3].clone()})
    failed(proxy, shard, f"{BLOCK}.gate.weight [3, 64]", "config.json's expert count 4", "disagree")


def test_config_expert_count_disagrees_with_router(proxy):
    edit_config(proxy, num_experts=5)
    failed(proxy, f"{BLOCK}.gate.weight [4, 64]", "config.json's expert count 5")


def test_top_k_beyond_experts(proxy):
    edit_config(proxy, num_experts_per_tok=5)
    failed(proxy, "top-k 5 is not within 1..4 experts")


def test_forward_pass_non_finite(proxy):
    """A NaN written into a backbone weight with the manifest re-hashed: every structural check
    passes, only running the model finds it, and the report names the tensor and its shard."""
    shard = shard_of(proxy, "model.norm.weight")
    edit_shard(proxy, shard, lambda ts: ts | {"model.norm.weight": torch.full_like(ts["model.norm.weight"], float("nan"))})
    assert verify(str(proxy), forward=False).ok  # what --no-forward cannot see
    report = failed(proxy, "transformers: failed", "non-finite logits", f"model.norm.weight ({shard})", forward=True)
    assert report.forward.startswith("failed")


def test_forward_pass_fails_to_load(proxy):
    """config.json's expert width no longer matches the expert tensors (config re-hashed):
    the header checks do not read widths, the transformers load does."""
    edit_config(proxy, moe_intermediate_size=16)
    assert verify(str(proxy), forward=False).ok
    failed(proxy, "transformers: failed", "config.json and the tensors disagree", "mismatched",
           f"{BLOCK}.experts", "[4, 64, 32] in the file, [4, 64, 16] from config", forward=True)


def test_cli_exit_status(good, proxy, capsys):
    assert main(["verify", str(good), "--no-progress"]) == 0
    assert capsys.readouterr().out.startswith("OK")
    shard = shard_of(proxy, f"{BLOCK}.gate.weight")
    (proxy / shard).write_bytes((proxy / shard).read_bytes()[:-1])
    assert main(["verify", str(proxy), "--no-progress", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert not out["ok"] and any(shard in p and "truncated" in p for p in out["problems"])
    # the installed entry point's real exit status, as a shell or a Job sees it
    r = subprocess.run([sys.executable, "-m", "moe_proxy", "verify", str(proxy), "--no-forward", "--no-progress"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and r.stdout.startswith("FAILED") and shard in r.stdout, r.stdout + r.stderr
