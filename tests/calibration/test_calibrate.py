"""`moe-proxy calibrate`: statistics checked against an independent computation on the full
transformers model, the artifact's schema and identity, reuse, and the command's output."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from moe_proxy.calibrate import statistics as cal
from moe_proxy.cli import main
from moe_proxy.layerwise.model import moe_modules
from moe_proxy.demo.tiny import make_tiny


def full_model_routing(path, ids) -> dict[int, tuple]:
    """Per MoE layer: (expert inputs, top-k index, top-k weights) as the full model used them."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    seen: dict[int, list] = {}
    for i, layer in enumerate(model.model.layers):
        mods = moe_modules(layer)
        if mods is not None:
            mods.experts.register_forward_pre_hook(lambda m, a, i=i: seen.setdefault(i, []).append(a) and None)
    with torch.no_grad():
        for batch in ids.split(4):
            model(batch)
    return {i: tuple(torch.cat(parts) for parts in zip(*calls)) for i, calls in seen.items()}, model


def test_statistics_match_the_full_model(tiny, tmp_path):
    path = tiny("qwen3_moe")
    summary = cal.calibrate(str(path), str(tmp_path / "stats"), samples=8, seq_len=16, seed=3, batch_size=4)
    stats = cal.load(str(tmp_path / "stats"))
    routing, model = full_model_routing(path, stats.token_ids)
    assert summary["tokens"]["random"] and "random" in summary["tokens"]["origin"]
    assert list(stats.layers) == ["model.layers.1.mlp"]  # layer 0 is dense (mlp_only_layers)
    s = stats.layers["model.layers.1.mlp"]
    x, idx, w = routing[1]
    n = 8
    assert torch.equal(s.tokens, torch.bincount(idx.flatten(), minlength=n).double())
    assert int(s.tokens.sum()) == 8 * 16 * 2  # every token, top-2
    assert torch.allclose(s.gate_mass, torch.zeros(n, dtype=torch.float64).index_add_(0, idx.flatten(), w.flatten().double()))
    # REAP saliency of each expert, from its weights written out by hand (SwiGLU), not the experts module.
    experts = model.model.layers[1].mlp.experts
    for e in range(n):
        tok, slot = torch.where(idx == e)
        gate, up = (x[tok] @ experts.gate_up_proj[e].T).chunk(2, dim=-1)
        out = (torch.nn.functional.silu(gate) * up) @ experts.down_proj[e].T
        want = (w[tok, slot].double() * out.double().norm(dim=-1)).mean()
        assert torch.allclose(s.saliency[e], want, rtol=1e-5), e
        assert s.max_abs[e] >= out.abs().max() * (1 - 1e-5)
    assert s.output_mean.shape == (n, cal.SKETCH_DIM) and s.output_probe.shape == (n, cal.PROBE_TOKENS * cal.PROBE_DIM)
    assert s.routing_probe.shape == (n, cal.ROUTING_PROBE)


def test_artifact_schema_identity_and_reuse(tiny, tmp_path):
    path = tiny("mixtral")
    out = tmp_path / "stats"
    first = cal.calibrate(str(path), str(out), samples=4, seq_len=16)
    on_disk = json.loads((out / cal.SUMMARY).read_text())
    assert on_disk["format"] == cal.FORMAT and on_disk["source"]["architecture"] == "Mixtral"
    assert set(on_disk["layers"]) == {"model.layers.0.block_sparse_moe", "model.layers.1.block_sparse_moe"}
    tensors = load_file(out / cal.TENSORS)
    assert tensors["tokens"].shape == (4, 16)
    assert {f"layers.0.{name}" for name in cal.LayerStats.NAMES} <= set(tensors)
    # Same checkpoint and tokens: reused, nothing recomputed.
    again = cal.calibrate(str(path), str(out), samples=4, seq_len=16)
    assert again.get("up_to_date") and again["source"]["identity"] == first["source"]["identity"]
    # Other tokens: recomputed, and the tokens' hash says so.
    other = cal.calibrate(str(path), str(out), samples=4, seq_len=16, seed=1)
    assert not other.get("up_to_date") and other["tokens"]["sha256"] != first["tokens"]["sha256"]


def test_identity_tells_two_steps_of_one_run_apart(tmp_path):
    """Same architecture, same shapes, same tensor table: only router values differ."""
    a, b = tmp_path / "step1", tmp_path / "step2"
    make_tiny("qwen3_moe", a, seed=0)
    make_tiny("qwen3_moe", b, seed=1)
    ia = cal.calibrate(str(a), str(tmp_path / "sa"), samples=2, seq_len=8)["source"]["identity"]
    ib = cal.calibrate(str(b), str(tmp_path / "sb"), samples=2, seq_len=8)["source"]["identity"]
    assert ia != ib


def test_calibrate_command_prints_dead_super_and_imbalance(planted, tmp_path, capsys):
    assert main(["calibrate", str(planted), "--out", str(tmp_path / "s"), "--samples", "16", "--seq-len", "32",
                 "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "seeded random token ids" in text and "no --dataset given" in text
    assert "model.layers.1.mlp" in text and "[12]" in text  # the planted super expert
    assert "skipped model.layers.2.mlp" in text  # DeepSeek-V3's MTP layer: no statistics
    summary = json.loads((tmp_path / "s" / cal.SUMMARY).read_text())
    layer = summary["layers"]["model.layers.1.mlp"]
    assert layer["dead"] == [1, 9] and layer["super"] == [12] and layer["load_imbalance"] > 1
    assert "model.layers.0.mlp" not in summary["layers"]  # dense first layer


def test_reused_only_while_source_and_tokens_are_unchanged(tmp_path, monkeypatch, capsys):
    """What the operator's calibrate-then-build Job relies on: STATS beside the proxy are reused
    for the same checkpoint and tokens, and recomputed when either changed."""
    step1, step2, out = tmp_path / "step1", tmp_path / "step2", tmp_path / "stats"
    make_tiny("qwen3_moe", step1, seed=0)
    make_tiny("qwen3_moe", step2, seed=1)  # another step of the same run: same shapes, other values
    passes = []
    run = cal.run_statistics
    monkeypatch.setattr(cal, "run_statistics", lambda *a, **k: passes.append(a[0].uri) or run(*a, **k))
    args = ["--out", str(out), "--samples", "2", "--seq-len", "8", "--no-progress"]

    assert main(["calibrate", str(step1), *args]) == 0 and len(passes) == 1
    written, identity1 = (out / cal.TENSORS).stat().st_mtime_ns, cal.load(str(out)).identity
    assert main(["calibrate", str(step1), *args]) == 0 and len(passes) == 1  # no layer pass
    assert "[up to date: reused]" in capsys.readouterr().out and (out / cal.TENSORS).stat().st_mtime_ns == written
    # Another checkpoint into the same STATS: recomputed, and the statistics now name it.
    assert main(["calibrate", str(step2), *args]) == 0 and len(passes) == 2
    assert "up to date" not in capsys.readouterr().out
    stats = cal.load(str(out))
    assert stats.identity != identity1 and stats.summary["source"]["uri"].endswith("step2")
    # Other tokens (seed): recomputed.
    assert main(["calibrate", str(step2), *args, "--seed", "5"]) == 0 and len(passes) == 3
    # Statistics whose tensors are missing are incomplete: recomputed, not reused.
    (out / cal.TENSORS).unlink()
    assert main(["calibrate", str(step2), *args, "--seed", "5"]) == 0 and len(passes) == 4
    assert (out / cal.TENSORS).exists()


@pytest.mark.parametrize("model_type", ["deepseek_v3", "gpt_oss"])
def test_statistics_are_finite_and_complete(tiny, tmp_path, model_type):
    summary = cal.calibrate(str(tiny(model_type)), str(tmp_path / "s"), samples=4, seq_len=16)
    stats = cal.load(str(tmp_path / "s"))
    for s in stats.layers.values():
        assert int(s.tokens.sum()) == summary["layers"][s.prefix]["tokens_routed"] == 4 * 16 * 2
        for name in cal.LayerStats.NAMES:
            assert torch.isfinite(getattr(s, name)).all()


def test_callers_own_token_ids(tiny, tmp_path):
    ids = torch.randint(0, 256, (3, 12), generator=torch.Generator().manual_seed(8))
    summary = cal.calibrate(str(tiny("qwen3_moe")), str(tmp_path / "s"), token_ids=ids)
    assert summary["tokens"]["origin"] == "token ids given by the caller" and summary["tokens"]["seq_len"] == 12
    assert torch.equal(cal.load(str(tmp_path / "s")).token_ids, ids)
    with pytest.raises(cal.MoeProxyError, match="token_ids must be"):
        cal.calibrate(str(tiny("qwen3_moe")), str(tmp_path / "t"), token_ids=ids + 1000)
