"""Taps on a loaded model's routers: capture router logits in the forward pass, derive the
MoE metrics (entropy, expert load, logit size) and the router auxiliary / z losses.

Routers are found by shape, not by class, so every architecture transformers runs is covered:
a submodule named `gate` or `router` whose 2-D weight has one row per routed expert."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from moe_proxy.errors import NotMoE

EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_LAYER = re.compile(r"layers\.(\d+)\.")


def expert_count(config) -> int | None:
    for key in EXPERT_COUNT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


@dataclass
class Router:
    name: str
    layer: int
    module: nn.Module


def find_routers(model: nn.Module) -> list[Router]:
    experts = expert_count(model.config)
    routers = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        layer = _LAYER.search(name)
        if (name.rsplit(".", 1)[-1] in ("gate", "router") and layer and isinstance(weight, torch.Tensor)
                and weight.dim() == 2 and weight.shape[0] == experts):
            routers.append(Router(name, int(layer.group(1)), module))
    if not routers:
        raise NotMoE(f"{type(model).__name__}: no router with {experts} experts found; repro needs an MoE model")
    return routers


def router_output(output) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits, chosen experts or None) of a router's forward output: transformers' routers return
    the logits alone or first, and the top-k indices third when they choose themselves."""
    if not isinstance(output, tuple):
        return output, None
    chosen = output[2] if len(output) >= 3 and not output[2].is_floating_point() else None
    return output[0], chosen


def load_max_excess(max_share: float, uniform_share: float) -> float | None:
    """The busiest expert's share of the tokens on a scale from uniform routing (0: top_k /
    experts, what every expert gets when routing is even) to collapse (1: one expert in every
    token's top-k); None when experts <= top_k, where every token uses every expert and no
    collapse can show. Scale-free: a 4-of-32 proxy's clean routing and its original's read alike,
    where the raw share of a clean proxy keeping 4 experts under top-2 is 0.5 at the very least."""
    if uniform_share >= 1.0:
        return None
    return (max_share - uniform_share) / (1.0 - uniform_share)


def moe_metrics(per_layer: dict[int, dict[str, float]], uniform_share: float) -> dict[str, float]:
    """The moe/ metrics from each layer's router_entropy (per token), load_max_share and
    load_min_share (share of tokens routed to an expert; uniform routing gives top_k / experts,
    `uniform_share`) and router_logit_max: per layer, and summed up over the layers; and
    load_max_excess (see there) per layer and of the busiest layer, unless experts <= top_k."""
    out = {f"moe/{key}/layer_{layer}": value for layer, row in per_layer.items() for key, value in row.items()}
    rows = list(per_layer.values())
    max_shares = [r["load_max_share"] for r in rows]
    out["moe/router_entropy/mean"] = sum(r["router_entropy"] for r in rows) / len(rows)
    out["moe/load_max_share"] = max(max_shares)
    # The busiest layer saturates first; the mean shows routing narrowing in every layer.
    out["moe/load_max_share/mean"] = sum(max_shares) / len(max_shares)
    out["moe/load_min_share"] = min(r["load_min_share"] for r in rows)
    out["moe/router_logit_max"] = max(r["router_logit_max"] for r in rows)
    out["moe/load_uniform_share"] = uniform_share
    if uniform_share < 1.0:  # every layer has the same experts and top-k: the busiest layer's is the max
        for layer, row in per_layer.items():
            out[f"moe/load_max_excess/layer_{layer}"] = load_max_excess(row["load_max_share"], uniform_share)
        out["moe/load_max_excess"] = load_max_excess(max(max_shares), uniform_share)
    return out


class RouterTap:
    """Records each router's logits (and chosen experts when the router returns them) while
    `recording` is on. `token_mask` (flattened attention mask) drops padding positions."""

    def __init__(self, model: nn.Module, top_k: int):
        self.routers = find_routers(model)
        self.top_k = top_k
        self.recording = False
        self.token_mask: torch.Tensor | None = None
        self.logits: dict[int, torch.Tensor] = {}
        self.chosen: dict[int, torch.Tensor] = {}
        for router in self.routers:
            router.module.register_forward_hook(self._hook(router.layer))

    def _hook(self, layer: int):
        def hook(_module, _inputs, output):
            if not self.recording:
                return
            logits, chosen = router_output(output)
            logits = logits.reshape(-1, logits.shape[-1])
            if self.token_mask is not None and self.token_mask.numel() == logits.shape[0]:
                logits = logits[self.token_mask]
                chosen = chosen.reshape(self.token_mask.numel(), -1)[self.token_mask] if chosen is not None else None
            self.logits[layer] = logits
            if chosen is not None:
                self.chosen[layer] = chosen
        return hook

    def start(self, attention_mask: torch.Tensor) -> None:
        self.logits.clear()
        self.chosen.clear()
        self.token_mask = attention_mask.reshape(-1).bool()
        self.recording = True

    def stop(self) -> None:
        self.recording = False

    def aux_losses(self, comm=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(load-balancing loss, z-loss), averaged over layers, with gradients. In a distributed run
        (`comm`, see distributed.Comm) expert loads and token counts are the global batch's, and
        each rank returns its share of the global losses: the shares add up to them."""
        layers = sorted(self.logits)
        if not layers:
            zero = torch.zeros(())
            return zero, zero
        logits = {layer: self.logits[layer].float() for layer in layers}
        # Per layer: routed slots per expert, then the token count; one reduction for all layers.
        stats = []
        for layer in layers:
            chosen = self.chosen_experts(layer, logits[layer])
            slots = torch.zeros(logits[layer].shape[-1], device=chosen.device).index_add_(
                0, chosen.reshape(-1), torch.ones(chosen.numel(), device=chosen.device))
            stats.append(torch.cat([slots, slots.new_tensor([float(logits[layer].shape[0])])]))
        stats = _sum_over_ranks(comm, torch.cat(stats)).split([s.numel() for s in stats])
        aux, z = [], []
        for layer, stat in zip(layers, stats):
            slots, tokens = stat[:-1], stat[-1]
            experts = slots.numel()
            probs = logits[layer].softmax(-1)
            # Switch Transformer: E * sum_e (share of routed slots to e) * (mean router prob of e).
            aux.append(experts * (slots / slots.sum() * probs.sum(0) / tokens).sum())
            z.append(torch.logsumexp(logits[layer], -1).pow(2).sum() / tokens)
        return torch.stack(aux).mean(), torch.stack(z).mean()

    def metrics(self, comm=None) -> dict[str, float]:
        """Per-layer and summary MoE metrics of the last recorded forward pass (of the global
        batch in a distributed run: entropy sums, expert loads and token counts are summed over
        ranks, logit maxima maxed)."""
        out: dict[str, float] = {}
        layers = sorted(self.logits)
        if not layers:
            return out
        stats, logit_max = [], []
        for layer in layers:
            logits = self.logits[layer].detach().float()
            probs = logits.softmax(-1)
            entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1).sum()
            chosen = self.chosen_experts(layer, logits)
            load = torch.bincount(chosen.reshape(-1), minlength=logits.shape[-1]).to(entropy.dtype)
            stats.append(torch.cat([entropy.reshape(1), entropy.new_tensor([float(logits.shape[0])]), load]))
            logit_max.append(logits.abs().max().item())
        stats = _sum_over_ranks(comm, torch.cat(stats)).split([s.numel() for s in stats])
        logit_max = comm.max(logit_max) if comm is not None else logit_max
        per_layer = {}
        for layer, stat, largest in zip(layers, stats, logit_max):
            tokens = max(1.0, stat[1].item())
            share = stat[2:] / tokens
            per_layer[layer] = {"router_entropy": stat[0].item() / tokens, "load_max_share": share.max().item(),
                                "load_min_share": share.min().item(), "router_logit_max": largest}
        return moe_metrics(per_layer, self.top_k / stats[0][2:].numel())

    def chosen_experts(self, layer: int, logits: torch.Tensor) -> torch.Tensor:
        # Routers that return their choice (Qwen, Mixtral) are exact; for the others (grouped or
        # bias-corrected routing) the plain top-k of the logits is an approximation.
        if layer in self.chosen:
            return self.chosen[layer]
        return logits.topk(min(self.top_k, logits.shape[-1]), dim=-1).indices


def _sum_over_ranks(comm, t: torch.Tensor) -> torch.Tensor:
    return comm.sum_tensor(t) if comm is not None else t
