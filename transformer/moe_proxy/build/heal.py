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
from moe_proxy.checkpoint.layout import Layout
from moe_proxy.build.config import rewrite_config
from moe_proxy.checkpoint.tensors import TORCH_DTYPES

log = logging.getLogger(__name__)
HEAL_STEPS = 200
HEAL_LR = 0.02
HEAL_SAMPLES = 32  # calibration sequences used for healing (all of them if fewer)
HOLDOUT = 4  # one token in HOLDOUT is held out to choose the step kept


def _proxy_block(original: torch.nn.Module, proxy_config, kept: list[int], n: int) -> torch.nn.Module:
    """The model's own MoE block class for the proxy config, holding the kept experts' tensors."""
    with torch.device("meta"):
        block = type(original)(proxy_config)
    keep = torch.tensor(kept)
    state = {}
    for key, value in original.state_dict().items():
        # Every tensor with one row per routed expert (router rows, correction bias, fused experts).
        state[key] = value.index_select(0, keep) if value.dim() and value.shape[0] == n else value
        state[key] = state[key].float().clone()
    block.load_state_dict(state, strict=True, assign=True)
    return block.train(False)


def _router_params(block: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The router's trainable tensors, named as the checkpoint's router leaves (`gate.weight`, ...)."""
    for attr in ("gate", "router"):
        router = getattr(block, attr, None)
        if isinstance(router, torch.nn.Module) and isinstance(getattr(router, "weight", None), torch.nn.Parameter):
            return {f"{attr}.{name}": p for name, p in router.named_parameters()}
    raise ValueError(f"{type(block).__name__} has no router module")


def _fit(block: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Train the block's router on x -> y; returns the held-out objective before and after."""
    params = _router_params(block)
    for p in block.parameters():
        p.requires_grad_(False)
    for p in params.values():
        p.requires_grad_(True)
    # Every HOLDOUT-th token is held out: it picks the step to keep (early stopping), so the
    # router is not fitted to the calibration tokens' noise.
    held = torch.arange(x.shape[1]) % HOLDOUT == 0
    fit_x, fit_y, val_x, val_y = x[:, ~held], y[:, ~held], x[:, held], y[:, held]

    def objective(inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        out = block(inputs)
        out = out[0] if isinstance(out, tuple) else out
        return (out - target).pow(2).sum() / target.pow(2).sum()

    def held_out() -> float:
        with torch.no_grad():
            return float(objective(val_x, val_y))

    weight = next(p for name, p in params.items() if name.endswith("weight"))
    opt = torch.optim.Adam(params.values(), lr=HEAL_LR * float(weight.detach().pow(2).mean().sqrt()))
    before = best = held_out()
    best_state = {k: p.detach().clone() for k, p in params.items()}
    for _ in range(HEAL_STEPS):
        opt.zero_grad()
        objective(fit_x, fit_y).backward()
        opt.step()
        if (now := held_out()) < best:
            best, best_state = now, {k: p.detach().clone() for k, p in params.items()}
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(best_state[k])
            p.requires_grad_(False)
    return before, best


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
            xs, ys = [], []

            def capture(module, args, out) -> None:  # the original block's input and output
                xs.append(args[0].detach())
                ys.append((out[0] if isinstance(out, tuple) else out).detach())

            hook = mods.block.register_forward_hook(capture)
            states.advance(layer, i)
            hook.remove()
            sel = plan.selections[block.prefix]
            proxy = _proxy_block(mods.block, proxy_config, sel.kept, block.n_experts)
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
