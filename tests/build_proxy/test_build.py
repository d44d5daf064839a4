"""The builder end to end on real tiny checkpoints: clustering on planted experts, what is
read, quantised companions, odd but real checkpoints, and the CLI."""

import hashlib
import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_proxy.pruning.build import build_proxy
from moe_proxy.pruning.steps import prepare, write_share
from moe_proxy.options import PruningOptions
from moe_proxy.checkpoint.reader import open_checkpoint
from moe_proxy.cli import main
from moe_proxy.errors import MoeProxyError
from moe_proxy.storage import LocalStore
from moe_proxy.demo.tiny import make_tiny
from moe_proxy.pruning.verify import verify


def rewrite_tensors(path, fn):
    """Apply fn(state_dict) -> state_dict to a single-file checkpoint in place."""
    sd = load_file(path / "model.safetensors")
    save_file(fn(sd), path / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture
def qwen3(tmp_path):
    path = tmp_path / "qwen3"
    make_tiny("qwen3_moe", path, num_experts=16, num_experts_per_tok=4)
    return path


def test_planted_router_groups_give_one_expert_per_group(qwen3, tmp_path):
    groups = torch.tensor([3, 0, 2, 1, 0, 3, 1, 2, 2, 0, 3, 1, 1, 2, 0, 3])
    centres = torch.randn(4, 64) * 5

    def plant(sd):
        sd["model.layers.1.mlp.gate.weight"] = centres[groups] + 1e-3 * torch.randn(16, 64)
        return sd

    rewrite_tensors(qwen3, plant)
    for clustering in ("kmeans", "agglomerative"):
        m = build_proxy(str(qwen3), str(tmp_path / clustering), experts=4, clustering=clustering)
        kept = m["layers"]["model.layers.1.mlp"]["kept"]
        assert sorted(groups[kept].tolist()) == [0, 1, 2, 3]
        assert m["layers"]["model.layers.1.mlp"]["cluster_sizes"] == [4, 4, 4, 4]


def test_planted_weight_groups_with_weight_features(qwen3, tmp_path):
    """Router rows random, expert weights near-duplicates in groups: --features weights finds them."""
    groups = [1, 0, 2, 1, 0, 2, 3, 3, 0, 1, 2, 3, 0, 1, 2, 3]

    def plant(sd):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            base = [sd[f"model.layers.1.mlp.experts.{g}.{proj}.weight"].clone() * 5 for g in range(4)]
            for e, g in enumerate(groups):
                w = base[g]
                sd[f"model.layers.1.mlp.experts.{e}.{proj}.weight"] = w + 1e-4 * torch.randn_like(w)
        return sd

    rewrite_tensors(qwen3, plant)
    m = build_proxy(str(qwen3), str(tmp_path / "w"), experts=4, features="weights")
    kept = m["layers"]["model.layers.1.mlp"]["kept"]
    assert sorted(groups[e] for e in kept) == [0, 1, 2, 3]


class CountingStore(LocalStore):
    def __init__(self, root):
        super().__init__(root)
        self.read = 0
        self.requests: list[tuple[str, int, int]] = []

    def read_range(self, name, start, length):
        self.read += length
        self.requests.append((name, start, length))
        return super().read_range(name, start, length)


def test_dropped_experts_are_never_read(tmp_path):
    src = tmp_path / "src"
    make_tiny("qwen3_moe", src, num_experts=32, num_experts_per_tok=2, num_hidden_layers=3, mlp_only_layers=[])
    store = CountingStore(src)
    m = build_proxy(store, str(tmp_path / "dst"), experts=4)
    ckpt = open_checkpoint(str(src))
    headers = min(t.start for t in ckpt.tensors.values())  # one file: 8 + its header
    routers = sum(t.nbytes for n, t in ckpt.tensors.items() if n.endswith("mlp.gate.weight"))
    # Routers are read once (for the source identity, the features and the written rows alike);
    # everything else kept is read once, and nothing dropped at all.
    assert store.read <= m["bytes"]["after"] + headers + routers
    assert m["bytes"]["after"] < 0.3 * m["bytes"]["before"]


def test_routers_are_read_once(tmp_path):
    """Each router tensor's bytes (weight and correction bias) are requested once in a whole
    build, although the source identity, the features and the written rows all use them."""
    src = tmp_path / "src"
    make_tiny("deepseek_v3", src)
    store = CountingStore(src)
    build_proxy(store, str(tmp_path / "dst"), experts=4)
    ckpt = open_checkpoint(str(src))
    routers = [t for n, t in ckpt.tensors.items() if n.endswith(("mlp.gate.weight", "e_score_correction_bias"))]
    assert len(routers) >= 2
    for r in routers:
        covering = [(s, n) for _, s, n in store.requests if s < r.end and r.start < s + n]
        assert len(covering) == 1, (r.name, covering)


def test_neighbouring_kept_tensors_come_in_one_request(tmp_path):
    """Writing reads every run of contiguous bytes the proxy needs with one ranged request:
    a layer's backbone, a kept expert's projections, kept experts that are neighbours."""
    src = tmp_path / "src"
    make_tiny("qwen3_moe", src, num_experts=16, num_experts_per_tok=2, num_hidden_layers=3, mlp_only_layers=[])
    store = CountingStore(src)
    # Experts 0 and 1 kept everywhere: neighbours in the source, so one request for both.
    p = prepare(store, str(tmp_path / "dst"), PruningOptions(experts=4, pins={i: [0, 1] for i in range(3)}),
                overwrite=False, progress=False, store_options=None)
    store.requests.clear()
    write_share(p, 0, 1)

    routers = [t for name, t in p.ckpt.tensors.items() if name.endswith("mlp.gate.weight")]
    in_router = lambda s, n: any(r.start <= s and s + n <= r.end for r in routers)  # noqa: E731
    reads = sorted((s, n) for _, s, n in store.requests)
    # Routers were read once while planning (prepare): writing their kept rows reads nothing.
    assert not [r for r in reads if in_router(*r)]
    rest = [r for r in reads if not in_router(*r)]
    for (s1, n1), (s2, _) in zip(rest, rest[1:]):
        assert s1 + n1 < s2, "neighbouring or overlapping bytes fetched by separate requests"
    tensors = [t for ts in p.shards.values() for t in ts]
    assert sum(n for _, n in reads) <= sum(t.nbytes for t in tensors) + sum(t.nbytes for t in routers)
    assert 3 * len(reads) < len(tensors), (len(reads), len(tensors))


def test_block_fp8_companions_ride_along(tmp_path):
    """DeepSeek-V3 block-FP8: F8_E4M3 expert weights with F32 weight_scale_inv companions."""
    src = tmp_path / "fp8"
    make_tiny("deepseek_v3", src)
    block = 16

    def quantise(sd):
        for k in [k for k in sd if ".experts." in k and k.endswith("proj.weight")]:
            w = sd[k].float()
            o, i = w.shape
            blocks = w.reshape(o // block, block, i // block, block)
            s = blocks.abs().amax(dim=(1, 3)) / 448
            q = (blocks / s[:, None, :, None]).reshape(o, i).to(torch.float8_e4m3fn)
            sd[k], sd[k + "_scale_inv"] = q, s.contiguous()
        return sd

    rewrite_tensors(src, quantise)
    m = build_proxy(str(src), str(tmp_path / "p"), experts=4, features="weights")
    before, after = load_file(src / "model.safetensors"), load_file(tmp_path / "p" / "model.safetensors")
    for prefix, layer in m["layers"].items():
        for j, e in enumerate(layer["kept"]):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                for suffix in ("weight", "weight_scale_inv"):
                    a = before[f"{prefix}.experts.{e}.{proj}.{suffix}"]
                    b = after[f"{prefix}.experts.{j}.{proj}.{suffix}"]
                    assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert verify(str(tmp_path / "p"), forward=False).ok


def test_mxfp4_fused_gpt_oss_experts(tmp_path):
    """GPT-OSS MXFP4: fused U8 _blocks/_scales and bf16 _bias, all sliced on the expert axis."""
    src = tmp_path / "mx"
    make_tiny("gpt_oss", src)

    def pack(sd):
        for layer in range(2):
            p = f"model.layers.{layer}.mlp.experts."
            n, h, two_i = sd[p + "gate_up_proj"].shape
            for name, out, inn in (("gate_up_proj", two_i, h), ("down_proj", h, two_i // 2)):
                del sd[p + name]
                sd[p + name + "_blocks"] = torch.randint(0, 255, (n, out, inn // 32, 16), dtype=torch.uint8)
                sd[p + name + "_scales"] = torch.randint(100, 140, (n, out, inn // 32), dtype=torch.uint8)
        return sd

    rewrite_tensors(src, pack)
    m = build_proxy(str(src), str(tmp_path / "p"), experts=4)
    before, after = load_file(src / "model.safetensors"), load_file(tmp_path / "p" / "model.safetensors")
    for prefix, layer in m["layers"].items():
        keep = torch.tensor(layer["kept"])
        for name in [k for k in before if k.startswith(prefix + ".experts.") or k.startswith(prefix + ".router.")]:
            assert torch.equal(after[name], before[name].index_select(0, keep)), name
    with pytest.raises(MoeProxyError, match="use --features router"):
        build_proxy(str(src), str(tmp_path / "w"), experts=4, features="weights")


def test_identical_and_never_routed_experts(tmp_path):
    """Sparse upcycling (every expert a copy of one MLP) and experts no token can reach."""
    src = tmp_path / "up"
    make_tiny("mixtral", src)

    def upcycle(sd):
        for k in [k for k in sd if ".experts." in k]:
            layer, rest = k.split(".experts.")
            sd[k] = sd[f"{layer}.experts.0.{rest.split('.', 1)[1]}"].clone()
        for layer in range(2):
            g = sd[f"model.layers.{layer}.block_sparse_moe.gate.weight"]
            g[:] = g[0]
            g[6:] = -1e4  # experts 6 and 7 are never routed
        return sd

    rewrite_tensors(src, upcycle)
    m = build_proxy(str(src), str(tmp_path / "p"), experts=3)
    for layer in m["layers"].values():
        assert len(set(layer["kept"])) == 3 and sum(layer["cluster_sizes"]) == 8
    assert verify(str(tmp_path / "p")).ok


def test_cli_build_with_pins_json_and_termination_log(tmp_path, capsys):
    src = tmp_path / "src"
    make_tiny("olmoe", src)
    term = tmp_path / "term.json"
    rc = main(["build", str(src), str(tmp_path / "p"), "--keep-ratio", "0.5", "--pin", "0:7,1:3",
               "--pin", "1:5", "--json", "--no-progress", "--termination-log", str(term)])
    assert rc == 0
    m = json.loads(capsys.readouterr().out)
    assert 7 in m["layers"]["model.layers.0.mlp"]["kept"]
    assert {3, 5} <= set(m["layers"]["model.layers.1.mlp"]["kept"])
    t = json.loads(term.read_text())
    assert t["experts_per_layer"] == {"before": 8, "after": 4, "top_k": 2} and t["proxy_uri"] == str(tmp_path / "p")
    # The report's manifest hash (status.proxy.manifestSha256) is that of proxy-manifest.json itself,
    # from the build that wrote it and from a rerun that finds it there (a no-op).
    stored = hashlib.sha256((tmp_path / "p" / "proxy-manifest.json").read_bytes()).hexdigest()
    assert t["manifest_sha256"] == stored
    assert main(["build", str(src), str(tmp_path / "p"), "--keep-ratio", "0.5", "--pin", "0:7,1:3", "--pin", "1:5",
                 "--no-progress", "--termination-log", str(term)]) == 0
    assert json.loads(term.read_text())["manifest_sha256"] == stored
    capsys.readouterr()

    rc = main(["build", str(src), str(tmp_path / "q"), "--experts", "9", "--termination-log", str(term)])
    assert rc == 2
    assert json.loads(term.read_text())["error"] == "InvalidExpertCount"
    assert "valid values: 1, 2, 3" in capsys.readouterr().err


def test_top_k_clamped_and_overridden(tmp_path):
    src = tmp_path / "src"
    make_tiny("qwen3_moe", src, num_experts_per_tok=4)
    m = build_proxy(str(src), str(tmp_path / "a"), experts=2)
    assert m["experts"]["top_k_after"] == 2 and "clamped" in m["notes"][0]
    assert json.loads((tmp_path / "a" / "config.json").read_text())["num_experts_per_tok"] == 2
    m = build_proxy(str(src), str(tmp_path / "b"), experts=4, top_k=1)
    assert json.loads((tmp_path / "b" / "config.json").read_text())["num_experts_per_tok"] == 1
    with pytest.raises(MoeProxyError, match="--top-k 5 must be between 1 and 4"):
        build_proxy(str(src), str(tmp_path / "c"), experts=4, top_k=5)


def test_inspect_json(tmp_path, capsys):
    src = tmp_path / "src"
    make_tiny("deepseek_v3", src, mtp=True)
    assert main(["inspect", str(src), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["architecture"] == "DeepSeek-V3" and d["experts"] == 8 and d["top_k"] == 2
    assert d["moe_layers"] == [1, 2] and d["dense_layers"] == [0] and d["mtp_layers"] == [2]
    assert d["grouped_routing"] == {"n_group": 2, "topk_group": 1}
    assert d["params"]["total"] == sum(math.prod(t.shape) for t in open_checkpoint(str(src)).tensors.values())
