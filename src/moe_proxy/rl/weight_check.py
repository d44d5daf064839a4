"""`numerics/params_nonfinite` after a step: how many of the policy's weight tensors hold a NaN or
an inf. Reading every weight is a pass over the model (19 ms a step of 54M weights on one CPU
thread, docs/performance.md); `WeightBound` skips that read where arithmetic rules out a
non-finite weight, and the figure is then 0 without it.

Why it can. Only the optimizer writes the weights, and AdamW with weight decay 0 (rl.runner.adamw)
moves each one by lr * m_hat / (sqrt(v_hat) + eps), where
- m, a running average of the gradients started at 0, is never larger than the largest gradient
  element taken, itself at most that gradient's norm: |m| <= G, the largest norm taken;
- m_hat = m / (1 - beta1^t) with t >= 1: at most G / (1 - beta1);
- v_hat >= 0 (squares; one overflowing to inf makes the move 0, not a NaN) and eps > 0 (a checked
  option), so the denominator is at least eps: no division by 0.
So one update moves a weight by at most lr * G / ((1 - beta1) * eps), and every weight stays
within W, the bound of the last read (the largest tensor norm), plus the sum of the moves since.
While that and G stay far below fp32's largest value (LIMIT: 1e30 against 3.4e38, room for every
rounding), no operation of the update can overflow or make a NaN, so every weight is finite.
The first step reads the weights (a checkpoint may hold a NaN). A non-finite gradient that an
update takes (--no-skip-nonfinite), a learning-rate spike or a tiny eps raises the bound past
LIMIT, and every weight is read again, at that step and each step until it is back under."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moe_proxy.rl.distributed import Comm, local

LIMIT = 1e30


@dataclass
class WeightBound:
    """An upper bound on every weight's magnitude (`weights`) and on AdamW's first moment (`grads`,
    the largest gradient norm an update took); inf until the weights are read."""

    weights: float = math.inf
    grads: float = 0.0

    def stepped(self, grad_norm: float, group: dict) -> None:
        """An AdamW update with `group`'s settings took a gradient of norm `grad_norm` (before
        clipping: at least the one taken)."""
        self.grads = max(self.grads, grad_norm) if math.isfinite(grad_norm) else math.inf
        if group["weight_decay"] or group["eps"] <= 0:  # not the update bounded above: read
            self.weights = math.inf
            return
        # 2x: room for the fp32 roundings of the update's few operations
        self.weights += 2 * abs(group["lr"]) * self.grads / ((1 - group["betas"][0]) * group["eps"])

    def finite(self) -> bool:
        """Whether every weight is surely finite without a read."""
        return self.weights < LIMIT and self.grads < LIMIT

    def read(self, params: list[torch.nn.Parameter], comm: Comm) -> int:
        """How many of `params` hold a NaN or inf (on any rank): one multi-tensor norm over the
        weights; a non-finite norm is one with a NaN or inf, or an overflow of finite values (then
        looked at again). The norms bound the weights from here on."""
        shards = [local(p.detach()).reshape(-1) for p in params]
        norms = torch.stack(torch._foreach_norm(shards, 2)).tolist() if shards else []
        bad = [float(not math.isfinite(n) and not bool(torch.isfinite(s).all())) for n, s in zip(norms, shards)]
        # inf after a bad weight or an overflow: read again next step
        largest = max(norms, default=0.0) if all(math.isfinite(n) for n in norms) else math.inf
        *bad, self.weights = comm.max([*bad, largest])
        return sum(b > 0 for b in bad)
