"""numerics/params_nonfinite (rl.weight_check): the weights are read at the first step and where
AdamW's bound cannot rule out a non-finite weight; elsewhere the bound holds every weight."""

import math

import pytest
import torch

from moe_proxy.rl.config import Faults, ReproConfig
from moe_proxy.rl.distributed import Comm
from moe_proxy.rl.runner import run_repro
from moe_proxy.rl.weight_check import LIMIT, WeightBound


@pytest.mark.parametrize("eps", [1e-8, 1e-30])  # 1e-30: squares of 1e-25 underflow, v stays 0
def test_the_bound_holds_every_weight_through_fused_adamw_updates(eps):
    """As the runner keeps it: read at first, then after each update either the bound holds every
    weight, or it cannot rule a bad one out and the weights are read (and bound it again)."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (64, 300)]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0, eps=eps, fused=True)
    bound, reads = WeightBound(), 0
    assert not bound.finite() and bound.read(params, Comm()) == 0 and bound.finite()
    for step, scale in enumerate([1.0, 1e-25, 0.0, 1e6, 1e-25, 3.0]):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * scale
        opt.param_groups[0]["lr"] = 1e-3 * (step + 1)
        opt.step()
        bound.stepped(math.sqrt(sum(float(p.grad.double().square().sum()) for p in params)), opt.param_groups[0])
        largest = max(float(p.detach().abs().max()) for p in params)
        assert largest <= bound.weights  # the weights moved, and stayed within the bound
        if not bound.finite():
            assert bound.read(params, Comm()) == 0 and largest <= bound.weights < LIMIT
            reads += 1
    # eps 1e-8: no read after the first; 1e-30: a gradient of 1 could move a weight by 1e28 a step
    assert (reads == 0) == (eps == 1e-8)


def test_a_read_counts_the_bad_tensors_and_sets_the_bound():
    params = [torch.ones(4), torch.tensor([1.0, math.nan]), torch.tensor([2.0, -math.inf]), torch.full((3,), 1e20)]
    bound = WeightBound()
    assert bound.read(params, Comm()) == 2 and bound.weights == math.inf  # read again next step
    assert bound.read([params[0], params[3]], Comm()) == 0 and bound.weights == math.inf  # its norm overflows
    assert bound.read([torch.full((4,), 3.0), torch.zeros(0)], Comm()) == 0 and bound.weights == 6.0


def test_a_non_finite_gradient_taken_or_a_large_step_means_a_read():
    bound, group = WeightBound(weights=1.0), {"lr": 1e-5, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    bound.stepped(0.5, group)
    assert bound.finite() and bound.weights == pytest.approx(1.0 + 2 * 1e-5 * 0.5 / (0.1 * 1e-8))
    for grad_norm, changes in ((math.nan, {}), (1.0, {"lr": 1e30}), (1.0, {"eps": 1e-40}),
                               (1.0, {"weight_decay": 0.1})):
        bound = WeightBound(weights=1.0)
        bound.stepped(grad_norm, {**group, **changes})
        assert not bound.finite()


def _reads(monkeypatch) -> list[int]:
    """One entry per read of the weights by the runner, the count of bad tensors it found."""
    found, read = [], WeightBound.read

    def counted(self, params, comm):
        found.append(read(self, params, comm))
        return found[-1]

    monkeypatch.setattr(WeightBound, "read", counted)
    return found


def test_a_learning_rate_that_overflows_the_weights_is_caught_at_its_step(tiny_qwen3, tmp_path, monkeypatch):
    """Finite gradients, and an update that makes the weights inf (lr 1e40 at step 2): the bound
    sends the runner to read them at that step; the steps before read only the first."""
    reads = _reads(monkeypatch)
    faults = Faults(lr_spike_step=2, lr_spike_factor=1e45)
    config = ReproConfig(steps=3, batch_size=2, group_size=2, mini_batches=1, faults=faults)
    result = run_repro(str(tiny_qwen3), tmp_path, config)
    assert result.signature == "nan" and result.step == 2 and result.last_metrics["numerics/nonfinite_grads"] == 0
    assert reads[0] == 0 and reads[1] == result.last_metrics["numerics/params_nonfinite"] > 0
    assert len(reads) == 2  # steps 0 and 2
