"""`build --reconstruct`: the kept experts and router rows re-fitted layer by layer. Checked
independently of the fitting code: block errors recomputed from the written proxies with
transformers' own modules, and the KL to the original on fresh tokens."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
import transformers

from moe_proxy.pruning import reconstruct as rec
from moe_proxy.pruning.build import build_proxy, build_share, finalize_build, fit_for_workers
from moe_proxy.pruning.verify import verify
from moe_proxy.calibrate import statistics as cal
from moe_proxy.layerwise.model import HiddenStates, LayerwiseModel, moe_modules
from moe_proxy.layerwise.blocks import block_io
from moe_proxy.checkpoint.reader import open_checkpoint
from moe_proxy.demo.tiny import make_tiny

from .test_fp8 import fp8_builds
from .test_heal import kl, logits, tensors


@pytest.fixture(autouse=True)
def short_fit(monkeypatch):
    monkeypatch.setattr(rec, "RECON_STEPS", 60)
    monkeypatch.setattr(rec, "RECON_PATIENCE", 15)


def held_out_ids(stats) -> torch.Tensor:
    ids = stats.token_ids[:rec.RECON_SAMPLES]
    return ids[torch.arange(len(ids)) % rec.HOLDOUT_SEQUENCES == 0]


def block_errors(original, proxy, ids) -> list[float]:
    """Per MoE layer, ||proxy block(X) - original block(X)||^2 / ||original block(X)||^2, X the
    proxy's own hidden states at that block (full transformers models, float32)."""
    errors = []
    for i, layer in enumerate(proxy.model.layers):
        if not hasattr(layer.mlp, "experts"):
            continue
        xs = []
        hook = layer.mlp.register_forward_pre_hook(lambda m, a: xs.append(a[0]))
        with torch.no_grad():
            proxy(ids)
        hook.remove()
        with torch.no_grad():
            y, p = original.model.layers[i].mlp(xs[0]), layer.mlp(xs[0])
        errors.append(float((p - y).pow(2).sum() / y.pow(2).sum()))
    return errors


def test_reconstruct_lowers_the_held_out_block_error(tmp_path):
    src = tmp_path / "src"
    make_tiny("qwen3_moe", src, seed=2, num_experts=16, num_experts_per_tok=2, mlp_only_layers=[])
    cal.calibrate(str(src), str(tmp_path / "stats"), samples=16, seq_len=32)
    common = dict(experts=2, method="saliency", calibration=str(tmp_path / "stats"))  # 12.5%
    build_proxy(str(src), str(tmp_path / "plain"), reconstruct=False, **common)
    m = build_proxy(str(src), str(tmp_path / "rec"), reconstruct=True, **common)

    assert m["method"]["reconstruct"] is True
    r = m["reconstruct"]
    assert r["tokens"]["sequences"] == 16 and r["tokens"]["held_out"] == {"sequences": 4, "tokens": 128}
    assert r["tokens"]["fit"] == {"sequences": 12, "tokens": 384}
    assert set(r["fitted"]) == {"gate.weight", "experts.gate_up_proj", "experts.down_proj"}
    a, b = tensors(tmp_path / "plain"), tensors(tmp_path / "rec")
    assert a.keys() == b.keys() and all(a[n].shape == b[n].shape and a[n].dtype == b[n].dtype for n in a)
    changed = {n for n in a if not torch.equal(a[n], b[n])}
    # The router rows and every tensor of the kept experts (hub layout: one tensor per expert and projection).
    kept = [f"experts.{j}.{p}_proj.weight" for j in (0, 1) for p in ("gate", "up", "down")]
    assert changed == {f"model.layers.{i}.mlp.{leaf}" for i in (0, 1) for leaf in ["gate.weight", *kept]}

    original = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "plain", dtype=torch.float32).eval()
    fitted = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "rec", dtype=torch.float32).eval()
    ids = held_out_ids(cal.load(str(tmp_path / "stats")))
    e_plain, e_rec = block_errors(original, plain, ids), block_errors(original, fitted, ids)
    layers = list(m["layers"].values())
    # Layer 0 sees the same inputs in every model: the plain proxy's error, recomputed here, is
    # the manifest's "before"; the written proxy's is its "after".
    assert e_plain[0] == pytest.approx(layers[0]["reconstruct"]["error_before"]["held_out"], rel=1e-3)
    for e, layer in zip(e_rec, layers):
        assert layer["reconstruct"]["fitted"]
        assert e == pytest.approx(layer["reconstruct"]["error_after"]["held_out"], rel=1e-3)
    assert all(x < 0.9 * y for x, y in zip(e_rec, e_plain)), (e_rec, e_plain)

    fresh = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(99))
    ref = logits(src, fresh)
    kl_plain, kl_rec = kl(ref, logits(tmp_path / "plain", fresh)), kl(ref, logits(tmp_path / "rec", fresh))
    print(json.dumps({"block_error_plain": e_plain, "block_error_reconstructed": e_rec,
                      "kl_plain": kl_plain, "kl_reconstructed": kl_rec}))
    assert kl_rec < kl_plain
    report = verify(str(tmp_path / "rec"))
    assert report.ok and report.forward.startswith("ok"), (report.problems, report.forward)


def test_reconstruct_returns_the_plain_proxy_when_fitting_cannot_help(planted, tmp_path):
    """Dropping only the two dead experts leaves nothing to fix: the pruned block is the
    original block, so no fit beats it and every layer keeps its plain bytes."""
    cal.calibrate(str(planted), str(tmp_path / "stats"), samples=16, seq_len=32)  # enough tokens that only the two planted experts are dead
    common = dict(experts=14, method="frequency", calibration=str(tmp_path / "stats"))
    plain = build_proxy(str(planted), str(tmp_path / "plain"), reconstruct=False, **common)
    m = build_proxy(str(planted), str(tmp_path / "rec"), reconstruct=True, **common)
    assert [layer["kept"] for layer in m["layers"].values()] == [layer["kept"] for layer in plain["layers"].values()]
    records = [layer["reconstruct"] for layer in m["layers"].values() if "reconstruct" in layer]
    assert records and not any(r["fitted"] for r in records)
    assert all(r["error_after"] == r["error_before"] and "plain" in r["why"] for r in records)
    assert m["reconstruct"]["layers"] == {"fitted": 0, "plain": len(records)}
    a, b = tensors(tmp_path / "plain"), tensors(tmp_path / "rec")
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_reconstruct_requantises_block_fp8_experts(tmp_path):
    """DeepSeek-V3's block-FP8 experts: fitted, re-quantised with their weight_scale_inv layout;
    the written proxy, dequantised by the layer-by-layer reader, has the error the manifest says."""
    m, a, b = fp8_builds(tmp_path, 16, 32, reconstruct=True)
    src = tmp_path / "fp8"
    changed = {n for n in a if not torch.equal(a[n], b[n])}
    assert any(n.endswith("down_proj.weight") and b[n].dtype == torch.float8_e4m3fn for n in changed)
    assert any(n.endswith("weight_scale_inv") for n in changed)  # re-quantised: new block scales
    record = m["layers"]["model.layers.1.mlp"]["reconstruct"]
    assert record["fitted"] and record["error_after"]["held_out"] < record["error_before"]["held_out"]

    # Independently: layer 1 (after the dense layer 0, same inputs everywhere) read back from
    # each written proxy, FP8 dequantised, against the original block on held-out sequences.
    ids = held_out_ids(cal.load(str(tmp_path / "stats")))
    model = LayerwiseModel(open_checkpoint(str(src)), dtype=torch.float32)
    states = HiddenStates(model, ids, len(ids))
    with model.layer(0) as layer:
        states.advance(layer, 0)
    with model.layer(1) as layer, block_io(moe_modules(layer).block) as (xs, ys):
        states.advance(layer, 1)
    x, y = xs[0], ys[0]
    out = {}
    for name in ("plain", "built"):
        model = LayerwiseModel(open_checkpoint(str(tmp_path / name)), dtype=torch.float32)
        with model.layer(1) as layer, torch.no_grad():
            out[name] = moe_modules(layer).block(x)
    err = {n: float((out[n] - y).pow(2).sum() / y.pow(2).sum()) for n in out}
    assert err["plain"] == pytest.approx(record["error_before"]["held_out"], rel=1e-3)
    assert err["built"] == pytest.approx(record["error_after"]["held_out"], rel=1e-3)
    assert err["built"] < err["plain"]


@pytest.mark.parametrize("extra", [dict(), dict(merge=True), dict(heal=True, reconstruct=False)])
def test_fits_are_made_once_for_a_scale_out_build(tmp_path, monkeypatch, extra):
    """A 2-worker build that fits (reconstruct, merge, heal) writes the same shards as a 1-worker
    build; with a fit step first, every layer is fitted once: neither the workers nor finalize
    fit again (counted), and the fits are gone once the proxy is published."""
    from moe_proxy.pruning import expert_plan
    from moe_proxy.pruning.fits import fits_name
    from moe_proxy.checkpoint.reader import MANIFEST

    src = tmp_path / "src"
    make_tiny("qwen3_moe", src, seed=3, num_experts=8, num_experts_per_tok=2, mlp_only_layers=[],
              max_shard_size="40KB")
    cal.calibrate(str(src), str(tmp_path / "stats"), samples=8, seq_len=16)
    common = dict(experts=4, calibration=str(tmp_path / "stats"), **extra)
    one = build_proxy(str(src), str(tmp_path / "one"), **common)

    real, fitted, layer, loads = expert_plan.plan_experts, [], LayerwiseModel.layer, Counter()

    def counted(*args, **kwargs):
        fitted.append(1)
        return real(*args, **kwargs)

    def loading(self, index):
        loads[(self.ckpt.uri, index)] += 1
        return layer(self, index)

    monkeypatch.setattr("moe_proxy.pruning.steps.plan_experts", counted)
    monkeypatch.setattr(LayerwiseModel, "layer", loading)
    dst = tmp_path / "two"
    done = fit_for_workers(str(src), str(dst), workers=2, **common)
    assert done and (dst / done).exists() and len(fitted) == 1
    for worker in (0, 1):
        build_share(str(src), str(dst), worker=worker, workers=2, **common)
    two = finalize_build(str(src), str(dst), workers=2, **common)
    assert len(fitted) == 1  # the workers and finalize read the fits
    # and the figure measured where they were fitted, in that one walk: each source layer loaded once
    source = open_checkpoint(str(src)).uri
    assert {i: n for (uri, i), n in loads.items() if uri == source} == {0: 1, 1: 1}
    shards = {f: v for f, v in one["files"].items() if f.endswith(".safetensors")}
    assert len(shards) > 1 and {f: two["files"][f] for f in shards} == shards  # same bytes, by sha256
    assert two["layers"] == one["layers"] and two.get("reconstruct") == one.get("reconstruct")
    assert two["fidelity"] == one["fidelity"]
    assert not any(p.name.startswith(".moe-proxy") for p in dst.iterdir()) and (dst / MANIFEST).exists()
    assert not (dst / fits_name(two["build_id"])).exists()

    # Without a fit step, the first worker fits and the rest of the build reads its fits.
    fitted.clear()
    for worker in (0, 1):
        build_share(str(src), str(tmp_path / "three"), worker=worker, workers=2, **common)
    three = finalize_build(str(src), str(tmp_path / "three"), workers=2, **common)
    assert len(fitted) == 1 and three["files"] == two["files"]
