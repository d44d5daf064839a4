"""The update's gradient figures and clipping (rl.runner: `_Loop._grad_stats`, `clip_grads`): each
gradient's sum of squares and zero count are taken once (rl.grad_sums: one compiled pass for a
large one, else torch's multi-tensor norm and a zero count) and give the per-layer norms, the total
norm (`actor/grad_norm`), the clipping's factor and the zero fractions; they are torch's own figures."""

import logging
import math

import pytest
import torch

from moe_proxy.rl.config import ReproConfig
from moe_proxy.rl.distributed import Comm
from moe_proxy.rl import grad_sums as sums
from moe_proxy.rl.grad_sums import grad_sums, zero_count
from moe_proxy.rl.runner import _LAYER, _Loop, clip_grads, clipped_step


@pytest.fixture(scope="module")
def loop(tiny_qwen3):
    return _Loop(tiny_qwen3, ReproConfig(steps=1), Comm())


def _random_grads(loop, seed: int, scale: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    for i, p in enumerate(loop.params):
        p.grad = None if i == 3 else torch.randn(p.shape, generator=gen) * scale  # one parameter without


def test_the_norms_are_torchs(loop):
    _random_grads(loop, 0, 0.1)
    stats = loop._grad_stats()
    grads = [p.grad for p in loop.params if p.grad is not None]
    expected = torch.nn.utils.get_total_norm(grads).item()
    assert stats["actor/grad_norm"] == pytest.approx(expected, rel=1e-6)
    for layer in (0, 1):
        mine = [p.grad for p in loop.params if p.grad is not None and (m := _LAYER.search(loop.names[id(p)]))
                and int(m.group(1)) == layer]
        assert stats[f"numerics/grad_norm/layer_{layer}"] == pytest.approx(
            math.sqrt(sum(float(torch.dot(g.reshape(-1), g.reshape(-1))) for g in mine)), rel=1e-6)
    assert stats["numerics/nonfinite_grads"] == 0 and stats["numerics/grad_zero_frac"] == 0


@pytest.mark.parametrize("max_norm", [1.0, 1e6, math.inf])  # clipped, and not (no pass)
def test_clipping_is_clip_grad_norm(loop, max_norm):
    _random_grads(loop, 1, 0.1)
    shadow = [torch.nn.Parameter(p.detach().clone()) for p in loop.params if p.grad is not None]
    for s, p in zip(shadow, [p for p in loop.params if p.grad is not None]):
        s.grad = p.grad.clone()
    norm = torch.nn.utils.clip_grad_norm_(shadow, max_norm).item()
    stats = loop._grad_stats()
    clip_grads(loop.params, stats["actor/grad_norm"], max_norm)
    ours = [p.grad for p in loop.params if p.grad is not None]
    assert stats["actor/grad_norm"] == pytest.approx(norm, rel=1e-6) and norm > 1.0
    assert all(torch.allclose(a, s.grad, rtol=1e-6, atol=0) for a, s in zip(ours, shadow))
    after = torch.nn.utils.get_total_norm(ours).item()
    assert after == pytest.approx(1.0, rel=1e-5) if max_norm == 1.0 else after > 1.0


@pytest.mark.parametrize("fused", [True, False])  # the factor in the fused kernel; clip_grads, then the step
def test_a_clipped_step_is_clip_grad_norm_then_the_step(fused):
    gen = torch.Generator().manual_seed(4)
    ours = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (50, 300)]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    kernel = {"fused": True} if fused else {"foreach": True}
    optimizers = [torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.0, **kernel) for ps in (ours, theirs)]
    for step in range(3):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn(a.shape, generator=gen) * (step + 1)
            b.grad = a.grad.clone()
        norm = torch.nn.utils.clip_grad_norm_(theirs, 1.0).item()
        optimizers[1].step()
        clipped_step(optimizers[0], ours, norm, 1.0)
        assert norm > 1.0 and not hasattr(optimizers[0], "grad_scale")
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)


def test_a_non_finite_gradient_is_counted_and_makes_the_norm_and_the_clipped_gradients_so(loop):
    _random_grads(loop, 2, 0.1)
    loop.params[0].grad[0, 0], loop.params[5].grad.view(-1)[1] = math.nan, math.inf
    stats = loop._grad_stats()
    assert stats["numerics/nonfinite_grads"] == 2 and math.isnan(stats["actor/grad_norm"])
    clip_grads(loop.params, stats["actor/grad_norm"], 1.0)
    assert all(p.grad.isnan().all() for p in loop.params if p.grad is not None)  # as clip_grad_norm_ leaves them


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_zeros_are_counted_with_their_sign_and_nothing_else(dtype):
    flat = torch.randn(1000).to(dtype)
    flat[::10], flat[5::20], flat[7], flat[8] = 0.0, -0.0, math.nan, -math.inf
    assert zero_count(flat) == 150 == int((flat == 0).sum())  # 100 of +0.0, 50 of -0.0
    assert zero_count(flat[:0]) == 0 and zero_count(torch.full((4,), -0.0, dtype=dtype)) == 4
    tiny = torch.tensor([-1e-45, 1e-45, -2.0**-126], dtype=torch.float32)  # the least patterns near -0.0
    assert zero_count(tiny) == 0


def _mixed_grads() -> list[torch.Tensor]:
    """Gradients as a step has them: zeros of both signs, a NaN in one, an inf in another, one that
    overflows when squared, one empty, and two below the fused pass's size."""
    gen = torch.Generator().manual_seed(3)
    flats = [torch.randn(n, generator=gen) for n in (300, 5000, 4096, 4096, 4096, 0, 4096)]
    flats[1][::7], flats[1][3::14] = 0.0, -0.0
    flats[2][10], flats[3][11], flats[4][12] = math.nan, -math.inf, 3e19
    flats[6][:] = -0.0
    return flats


def test_the_one_pass_figures_are_the_two_passes(monkeypatch):
    """The compiled pass (here for every fp32 gradient of 1000 elements or more) gives the eager
    passes' figures: the same zero counts, sums of squares to fp32 rounding, non-finite alike."""
    flats = _mixed_grads()
    monkeypatch.setattr(sums, "FUSED_MIN", 10**9)
    eager = grad_sums(flats)
    monkeypatch.setattr(sums, "FUSED_MIN", 1000)
    monkeypatch.setattr(sums, "_compiled", None)
    fused = grad_sums(flats)
    assert sums._compiled not in (None, False)  # compiled, not fallen back
    assert [z for _, z in fused] == [z for _, z in eager] == [zero_count(f) for f in flats]
    assert fused[1][1] == 715 + 357 and fused[6][1] == 4096  # +0.0 at every 7th, -0.0 at every 14th from 3; all -0.0
    assert math.isnan(fused[2][0]) and fused[3][0] == fused[4][0] == math.inf  # 3e19 squared overflows fp32
    for (a, _), (b, _), f in zip(fused, eager, flats):
        if math.isfinite(b):
            assert a == pytest.approx(b, rel=1e-5) == float(torch.dot(f.double(), f.double()))


def test_without_a_compiler_the_eager_passes_give_the_figures(monkeypatch, caplog):
    flats = _mixed_grads()
    monkeypatch.setattr(sums, "FUSED_MIN", 1000)
    monkeypatch.setattr(sums, "_compiled", None)

    def no_compiler(*_args, **_kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(torch, "compile", no_compiler)
    with caplog.at_level(logging.WARNING, logger=sums.__name__):
        figures = grad_sums(flats)
    assert "no C++ compiler" in caplog.text and sums._compiled is False
    assert [z for _, z in figures] == [zero_count(f) for f in flats]
    assert figures[1][0] == pytest.approx(float(torch.dot(flats[1], flats[1])), rel=1e-5)
