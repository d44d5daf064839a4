"""`build --merge`: kept experts become gate-mass-weighted merges of their clusters, members'
hidden units aligned first. Checked against merges recomputed here from the source tensors and
the statistics, and by loading the written proxies in transformers."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from moe_proxy.pruning import reconstruct as rec
from moe_proxy.pruning.merge import align, expert_layout, neurons, permute
from moe_proxy.errors import CannotMerge
from moe_proxy.pruning.build import build_proxy, build_share, finalize_build
from moe_proxy.pruning.verify import verify
from moe_proxy.calibrate import statistics as cal
from moe_proxy.checkpoint.tensors import dequantize_fp8
from moe_proxy.cli import main
from moe_proxy.demo.tiny import make_tiny, tiny_config

from .conftest import FAMILIES, save_model
from .test_fp8 import fp8_builds
from .test_heal import tensors


def expert(intermediate: int = 24, hidden: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2 * intermediate, hidden, generator=g), torch.randn(hidden, intermediate, generator=g)


def test_alignment_recovers_a_known_permutation():
    gate_up, down = expert()
    shuffle = torch.randperm(24, generator=torch.Generator().manual_seed(5))
    m_gate_up, m_down = permute(gate_up, down, shuffle)  # member neuron i = representative neuron shuffle[i]
    perm = align(neurons(gate_up, down), neurons(m_gate_up, m_down))
    assert torch.equal(shuffle[perm], torch.arange(24))  # perm is shuffle's inverse
    back = permute(m_gate_up, m_down, perm)
    assert torch.equal(back[0], gate_up) and torch.equal(back[1], down)
    # The same with the member slightly perturbed (experts trained apart are never exact copies).
    noisy = permute(gate_up + 0.05 * torch.randn_like(gate_up), down + 0.05 * torch.randn_like(down), shuffle)
    assert torch.equal(align(neurons(gate_up, down), neurons(*noisy)), perm)


def upcycled(path, seed: int = 3):
    """Qwen3-MoE, 16 experts, top-2, both layers sparse-upcycled: every expert is expert 0,
    odd experts with their hidden units in another order (the same function); routers random."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        tiny_config("qwen3_moe", num_experts=16, num_experts_per_tok=2, mlp_only_layers=[])).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
            ex = layer.mlp.experts
            for e in range(1, 16):
                perm = torch.randperm(ex.down_proj.shape[2]) if e % 2 else torch.arange(ex.down_proj.shape[2])
                ex.gate_up_proj[e], ex.down_proj[e] = permute(ex.gate_up_proj[0], ex.down_proj[0], perm)
    return save_model(model, path)


def test_merging_upcycled_experts_gives_exactly_the_representative(tmp_path):
    src = upcycled(tmp_path / "src")
    cal.calibrate(str(src), str(tmp_path / "stats"), samples=8, seq_len=16)
    common = dict(experts=4, calibration=str(tmp_path / "stats"), reconstruct=False)  # merged only
    build_proxy(str(src), str(tmp_path / "plain"), **common)
    m = build_proxy(str(src), str(tmp_path / "merged"), merge=True, **common)
    a, b = tensors(tmp_path / "plain"), tensors(tmp_path / "merged")
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    for layer in m["layers"].values():  # every member took part, with a positive weight
        assert sorted(e for r in layer["merge"] for e in r["members"]) == list(range(16))
        assert sum(w > 0 for r in layer["merge"] for w in r["weights"]) == 16


def test_merge_scaled_out_equals_one_build(tmp_path):
    """Workers write the merged experts, finalize takes their plan (merge record included)."""
    src = upcycled(tmp_path / "src")
    cal.calibrate(str(src), str(tmp_path / "stats"), samples=8, seq_len=16)
    common = dict(experts=4, calibration=str(tmp_path / "stats"), merge=True, reconstruct=False)
    single = build_proxy(str(src), str(tmp_path / "single"), **common)
    for i in (1, 0):
        build_share(str(src), str(tmp_path / "multi"), worker=i, workers=2, **common)
    multi = finalize_build(str(src), str(tmp_path / "multi"), workers=2, **common)
    assert multi["merge"] == single["merge"] and multi["layers"] == single["layers"]
    files = lambda d: {p.name: p.read_bytes() for p in sorted(d.iterdir())}  # noqa: E731
    assert files(tmp_path / "multi") == files(tmp_path / "single")


def test_merged_proxy_is_the_weighted_average_of_each_cluster_and_runs(duplicates, tmp_path):
    """Clusters on expert outputs find the 4 families of near-copies in layer 1; each kept
    expert is written as its family's gate-mass-weighted average (recomputed here: near-copies
    need no permutation), in the plain proxy's names, shapes and dtypes."""
    cal.calibrate(str(duplicates), str(tmp_path / "stats"), samples=16, seq_len=32)
    common = dict(experts=FAMILIES, features="output", calibration=str(tmp_path / "stats"), reconstruct=False)
    build_proxy(str(duplicates), str(tmp_path / "plain"), **common)
    m = build_proxy(str(duplicates), str(tmp_path / "merged"), merge=True, **common)

    stats = cal.load(str(tmp_path / "stats")).layers["model.layers.1.mlp"]
    layer = m["layers"]["model.layers.1.mlp"]
    assert m["method"]["merge"] is True and m["merge"]["layers"] == ["model.layers.1.mlp"]  # layer 0 is dense
    source = tensors(duplicates)
    proxy = tensors(tmp_path / "merged")
    for j, r in enumerate(layer["merge"]):
        assert r["kept"] == layer["kept"][j] == r["members"][0]
        assert sorted(r["members"]) == [e for e in range(16) if e % FAMILIES == r["kept"] % FAMILIES]
        mass = stats.gate_mass[r["members"]].double()
        assert r["weights"] == pytest.approx((mass / mass.sum()).tolist(), abs=1e-6)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            want = sum(w * source[f"model.layers.1.mlp.experts.{e}.{proj}.weight"].double()
                       for e, w in zip(r["members"], r["weights"]))
            got = proxy[f"model.layers.1.mlp.experts.{j}.{proj}.weight"].double()
            assert torch.allclose(got, want, atol=1e-5), proj
    plain = tensors(tmp_path / "plain")
    assert plain.keys() == proxy.keys()
    assert all(plain[n].shape == proxy[n].shape and plain[n].dtype == proxy[n].dtype for n in plain)
    changed = {n for n in plain if not torch.equal(plain[n], proxy[n])}
    assert changed and all(".experts." in n for n in changed)  # routers and backbone as the plain proxy's
    report = verify(str(tmp_path / "merged"))
    assert report.ok and report.forward.startswith("ok"), (report.problems, report.forward)
    assert json.loads((tmp_path / "merged" / "proxy-manifest.json").read_text())["merge"] == m["merge"]


def test_merge_requantises_block_fp8_experts(tmp_path):
    """DeepSeek-V3 block-FP8 experts: dequantised, merged, re-quantised with their scale layout."""
    m, a, b = fp8_builds(tmp_path, 8, 16, merge=True)
    src = tmp_path / "fp8"
    assert any(n.endswith("weight_scale_inv") and not torch.equal(a[n], b[n]) for n in a)  # new block scales
    source = tensors(src)

    def weights(e: int) -> tuple[torch.Tensor, torch.Tensor]:  # expert e of layer 1, dequantised, module layout
        name = "model.layers.1.mlp.experts.{}.{}_proj.weight"
        w = {p: dequantize_fp8(source[name.format(e, p)], source[name.format(e, p) + "_scale_inv"]).double()
             for p in ("gate", "up", "down")}
        return torch.cat([w["gate"], w["up"]]), w["down"]

    for j, r in enumerate(m["layers"]["model.layers.1.mlp"]["merge"]):
        (rep_gu, rep_down), want = weights(r["kept"]), None
        for e, w in zip(r["members"], r["weights"]):  # the merge, recomputed with align/permute
            aligned = permute(*weights(e), align(neurons(rep_gu, rep_down), neurons(*weights(e))))
            want = [w * x for x in aligned] if want is None else [a + w * x for a, x in zip(want, aligned)]
        name = "model.layers.1.mlp.experts.{}.{}_proj.weight"
        got = dequantize_fp8(b[name.format(j, "down")], b[name.format(j, "down") + "_scale_inv"]).double()
        err = float((got - want[1]).norm() / want[1].norm())
        assert err < 0.05  # e4m3 keeps 3 mantissa bits: a few per cent
        if len(r["members"]) > 1:
            assert err < float((got - rep_down).norm() / want[1].norm())  # closer to the merge than to the rep
    assert verify(str(tmp_path / "built")).ok


def test_merge_then_reconstruct_starts_from_the_merged_experts(tmp_path, monkeypatch):
    monkeypatch.setattr(rec, "RECON_STEPS", 10)
    monkeypatch.setattr(rec, "RECON_PATIENCE", 5)
    src = tmp_path / "src"
    make_tiny("qwen3_moe", src, seed=2, num_experts=16, num_experts_per_tok=2, mlp_only_layers=[])
    cal.calibrate(str(src), str(tmp_path / "stats"), samples=8, seq_len=16)
    common = dict(experts=4, method="saliency", calibration=str(tmp_path / "stats"))
    merged = build_proxy(str(src), str(tmp_path / "merged"), merge=True, reconstruct=False, **common)
    both = build_proxy(str(src), str(tmp_path / "both"), merge=True, reconstruct=True, **common)
    plain_rec = build_proxy(str(src), str(tmp_path / "rec"), reconstruct=True, **common)
    assert both["merge"]["layers"] == merged["merge"]["layers"] and both["reconstruct"]
    first = "model.layers.0.mlp"  # the first layer sees the same inputs in every build
    assert both["layers"][first]["merge"] == merged["layers"][first]["merge"]
    # The fit starts from the merged experts, not from the plain selection.
    before = both["layers"][first]["reconstruct"]["error_before"]["held_out"]
    assert before != plain_rec["layers"][first]["reconstruct"]["error_before"]["held_out"]
    a, b = tensors(tmp_path / "merged"), tensors(tmp_path / "both")
    for prefix, layer in both["layers"].items():
        names = [n for n in a if n.startswith(prefix + ".")]
        same = all(torch.equal(a[n], b[n]) for n in names)
        assert same == (not layer["reconstruct"]["fitted"]), prefix  # a layer fitting did not help: merged bytes
    assert verify(str(tmp_path / "both")).ok


def test_merge_refusals(tmp_path, capsys):
    src = tmp_path / "src"
    make_tiny("qwen3_moe", src, num_experts=8, num_experts_per_tok=2)
    with pytest.raises(CannotMerge, match="--merge needs --calibration STATS"):
        build_proxy(str(src), str(tmp_path / "a"), experts=4, merge=True)
    cal.calibrate(str(src), str(tmp_path / "stats"), samples=4, seq_len=8)
    for method in ("random", "first-n"):
        with pytest.raises(CannotMerge, match=f"--merge with --method {method}: a baseline"):
            build_proxy(str(src), str(tmp_path / "a"), experts=4, method=method, merge=True,
                        calibration=str(tmp_path / "stats"))
    with pytest.raises(CannotMerge, match="--merge and --heal"):
        build_proxy(str(src), str(tmp_path / "a"), experts=4, merge=True, heal=True,
                    calibration=str(tmp_path / "stats"))
    assert not (tmp_path / "a").exists()
    assert main(["build", str(src), str(tmp_path / "b"), "--experts", "4", "--merge", "--no-progress"]) == 2
    assert "--merge needs --calibration STATS" in capsys.readouterr().err


def test_merge_refuses_expert_layouts_it_cannot_align():
    """GPT-OSS keeps gate and up interleaved in one [E, H, 2I] tensor, with biases."""
    config = tiny_config("gpt_oss")
    with torch.device("meta"):
        experts = transformers.AutoModelForCausalLM.from_config(config).model.layers[0].mlp.experts
    with pytest.raises(CannotMerge, match="GPT-OSS's interleaved experts with biases are not supported"):
        expert_layout(experts)
