"""`build --heal`: re-fit the kept router rows so each proxy MoE block reproduces the
original block's output on the calibration hidden states.

Layer by layer (layerwise.py, same memory bound as `calibrate`): the calibration tokens of
the statistics are pushed through the *original* model; at each MoE layer the block's input
X and output Y are captured, the proxy block (the model's own MoE module class, built from
the proxy config with the kept experts' tensors) is instantiated, and only its router
parameters are trained:

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

import torch
from tqdm.auto import tqdm

from moe_proxy.checkpoint.reader import Checkpoint
from moe_proxy.calibrate.layerwise import HiddenStates, LayerwiseModel, moe_modules, transformers_config
from moe_proxy.calibrate.proxy import block_io, proxy_block
from moe_proxy.checkpoint.layout import Layout
from moe_proxy.build.config import rewrite_config
from moe_proxy.checkpoint.tensors import TORCH_DTYPES

log = logging.getLogger(__name__)
HEAL_STEPS = 200
HEAL_LR = 0.02
HEAL_SAMPLES = 32  # calibration sequences used for healing (all of them if fewer)
HOLDOUT = 4  # one token in HOLDOUT is held out to choose the step kept


def _router_params(block: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The router's trainable tensors, named as the checkpoint's router leaves (`gate.weight`, ...)."""
    for attr in ("gate", "router"):
        router = getattr(block, attr, None)
        if isinstance(router, torch.nn.Module) and isinstance(getattr(router, "weight", None), torch.nn.Parameter):
            return {f"{attr}.{name}": p for name, p in router.named_parameters()}
    raise ValueError(f"{type(block).__name__} has no router module")


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
    params = _router_params(block)
    # Every HOLDOUT-th token is held out: it picks the step to keep (early stopping), so the
    # router is not fitted to the calibration tokens' noise.
    held = torch.arange(x.shape[1]) % HOLDOUT == 0
    weight = next(p for name, p in params.items() if name.endswith("weight"))
    lr = HEAL_LR * float(weight.detach().pow(2).mean().sqrt())
    r = fit(block, [(list(params.values()), lr)], (x[:, ~held], y[:, ~held]), (x[:, held], y[:, held]), HEAL_STEPS)
    return r["before"], r["after"]


def heal_routers(ckpt: Checkpoint, layout: Layout, plan, calibration, progress: bool = False) -> dict[str, bytes]:
    """Healed router tensors of every calibrated MoE block: tensor name -> bytes in the source dtype.
    Records each layer's objective before and after in its selection's manifest record."""
    proxy_config = transformers_config(rewrite_config(ckpt.config, plan))
    model = LayerwiseModel(ckpt)
    states = HiddenStates(model, calibration.token_ids[:HEAL_SAMPLES], 8)
    overrides: dict[str, bytes] = {}
    for i in tqdm(range(model.n_layers), desc="healing routers", unit="layer", disable=not progress):
        block = next((b for b in layout.blocks if b.layer == i), None)
        with model.layer(i) as layer:
            mods = moe_modules(layer)
            if mods is None or block is None:
                states.advance(layer, i)
                continue
            with block_io(mods.block) as (xs, ys):  # the original block's input and output
                states.advance(layer, i)
            sel = plan.selections[block.prefix]
            proxy = proxy_block(mods.block, proxy_config, sel.kept)
            x = torch.cat([t.reshape(-1, t.shape[-1]) for t in xs]).float()[None]  # [1, tokens, H]
            y = torch.cat([t.reshape(-1, t.shape[-1]) for t in ys]).float()[None]
            before, after = _fit(proxy, x, y)
            sel.record["heal"] = {"objective": "relative squared error of the block output",
                                  "before": round(before, 6), "after": round(after, 6)}
            for leaf, p in _router_params(proxy).items():
                info = block.router.get(leaf)
                if info is None:  # a router parameter the checkpoint does not store: nothing to write
                    continue
                t, axis = info
                if axis != 0:
                    continue
                value = p.detach().to(TORCH_DTYPES[t.dtype]).contiguous()
                overrides[t.name] = value.view(torch.uint8).numpy().tobytes()
            log.info("%s: healed router, relative error %.4f -> %.4f", block.prefix, before, after)
    return overrides
