"""`build --heal`: re-fit the kept router rows so each proxy MoE block reproduces the
original block's output on the calibration hidden states.

Layer by layer (a pass of layerwise.driver, same memory bound as `calibrate`): the
calibration tokens of the statistics are pushed through the *original* model; at each MoE
layer the block's input X and output Y are captured, the proxy block (the model's own MoE
module class, built from the proxy config with the kept experts' tensors) is instantiated,
and only its router parameters are trained:

    minimise  ||proxy_block(X) - Y||^2 / ||Y||^2      (relative squared error over all tokens)

with Adam (HEAL_STEPS full-batch steps, learning rate HEAL_LR x the router weight's RMS, so
the step size follows the router's scale), in float32, on 3 of every 4 calibration tokens;
the parameters kept are those of the step with the lowest objective on the held-out 4th
token (early stopping); if no step improves on it, the sliced router stays. Gradients reach the
router through the gate weights of the selected experts (softmax / sigmoid scores); the
DeepSeek-style correction bias only decides *which* experts are selected and has no
gradient, so it stays as sliced. Experts, shared experts and backbone are never touched:
a healed proxy differs from the unhealed one only in router tensors.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from moe_proxy.pruning.config import rewrite_config
from moe_proxy.checkpoint.layout import Layout, MoeBlock
from moe_proxy.checkpoint.reader import Checkpoint
from moe_proxy.checkpoint.tensors import TORCH_DTYPES
from moe_proxy.layerwise.blocks import block_io, proxy_block, router_params
from moe_proxy.layerwise.driver import Layer, LayerPass
from moe_proxy.layerwise.load import transformers_config

log = logging.getLogger(__name__)
HEAL_STEPS = 200
HEAL_LR = 0.02
HEAL_SAMPLES = 32  # calibration sequences used for healing (all of them if fewer)
HOLDOUT_TOKENS = 4  # one token in HOLDOUT_TOKENS is held out to choose the step kept


def relative_error(block: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """||block(x) - y||^2 / ||y||^2 over all tokens."""
    out = block(x)
    out = out[0] if isinstance(out, tuple) else out
    return (out - y).pow(2).sum() / y.pow(2).sum()


def fit(block: torch.nn.Module, groups: list[tuple[list[torch.nn.Parameter], float]], train: tuple, held: tuple,
        steps: int, patience: int | None = None) -> dict:
    """Adam on the block's parameters in `groups` ((parameters, learning rate) pairs), full batch
    on `train` (x, y), for at most `steps` steps (fewer when `patience` steps in a row bring no
    improvement on `held`). The parameters end as those of the step with the lowest held-out
    objective, or as they started if no step beats them. Returns the held-out objective before
    and after, and the step kept (0: none)."""
    params = [p for ps, _ in groups for p in ps]
    for p in block.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)

    def held_out() -> float:
        with torch.no_grad():
            return float(relative_error(block, *held))

    opt = torch.optim.Adam([{"params": ps, "lr": lr} for ps, lr in groups])
    before = best = held_out()
    best_state, best_step, step = [p.detach().clone() for p in params], 0, 0
    for step in range(1, steps + 1):
        opt.zero_grad()
        relative_error(block, *train).backward()
        opt.step()
        if (now := held_out()) < best:  # copied into place: a second copy of the block never exists
            best, best_step = now, step
            with torch.no_grad():
                for kept, p in zip(best_state, params):
                    kept.copy_(p)
        elif patience is not None and step - best_step >= patience:
            break
    with torch.no_grad():
        for p, value in zip(params, best_state):
            p.copy_(value)
            p.requires_grad_(False)
            p.grad = None  # as large as the parameters: not kept past the fit
    return {"before": before, "after": best, "steps": step, "best_step": best_step}


def _fit(block: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Train the block's router on x -> y; returns the held-out objective before and after."""
    params = router_params(block)
    # Every HOLDOUT_TOKENS-th token is held out: it picks the step to keep (early stopping), so the
    # router is not fitted to the calibration tokens' noise.
    held = torch.arange(x.shape[1]) % HOLDOUT_TOKENS == 0
    weight = next(p for name, p in params.items() if name.endswith("weight"))
    lr = HEAL_LR * float(weight.detach().pow(2).mean().sqrt())
    r = fit(block, [(list(params.values()), lr)], (x[:, ~held], y[:, ~held]), (x[:, held], y[:, held]), HEAL_STEPS)
    return r["before"], r["after"]


@dataclass
class HealedRouters:
    """What healing found: the healed router tensors and, per MoE block, its objective."""

    tensors: dict[str, bytes] = field(default_factory=dict)  # checkpoint tensor name -> bytes, source dtype
    records: dict[str, dict] = field(default_factory=dict)  # block prefix -> its manifest record's `heal`


class HealPass(LayerPass[HealedRouters]):
    """Each MoE layer: the original block's input and output on the hidden states, and the
    proxy block's router fitted to them."""

    desc = "healing routers"

    def __init__(self, proxy_config, kept: dict[str, list[int]]):
        self.proxy_config, self.kept = proxy_config, kept
        self.healed = HealedRouters()

    def visit(self, layer: Layer) -> None:
        block, mods = layer.block, layer.moe
        with block_io(mods.block) as (xs, ys):  # the original block's input and output
            layer.states.advance(layer.module, layer.index)
        proxy = proxy_block(mods.block, self.proxy_config, self.kept[block.prefix])
        x = torch.cat([t.reshape(-1, t.shape[-1]) for t in xs]).float()[None]  # [1, tokens, H]
        y = torch.cat([t.reshape(-1, t.shape[-1]) for t in ys]).float()[None]
        before, after = _fit(proxy, x, y)
        self.healed.records[block.prefix] = {"objective": "relative squared error of the block output",
                                             "before": round(before, 6), "after": round(after, 6)}
        self.healed.tensors |= _router_tensors(proxy, block)
        log.info("%s: healed router, relative error %.4f -> %.4f", block.prefix, before, after)

    def result(self) -> HealedRouters:
        return self.healed


def _router_tensors(proxy: torch.nn.Module, block: MoeBlock) -> dict[str, bytes]:
    """The proxy block's router rows as the checkpoint stores them: tensor name -> bytes."""
    out = {}
    for leaf, p in router_params(proxy).items():
        info = block.router.get(leaf)
        if info is None:  # a router parameter the checkpoint does not store: nothing to write
            continue
        t, axis = info
        if axis != 0:
            continue
        value = p.detach().to(TORCH_DTYPES[t.dtype]).contiguous()
        out[t.name] = value.view(torch.uint8).numpy().tobytes()
    return out


def heal_pass(ckpt: Checkpoint, plan, calibration) -> tuple[HealPass, torch.Tensor]:
    """The pass that heals `plan`'s routers, and the calibration tokens it walks with."""
    proxy_config = transformers_config(rewrite_config(ckpt.config, plan))
    kept = {prefix: sel.kept for prefix, sel in plan.selections.items()}
    return HealPass(proxy_config, kept), calibration.token_ids[:HEAL_SAMPLES]
