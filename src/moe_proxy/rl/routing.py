"""Which experts each token was routed to: recorded in one model's forward passes (the rollout's
incremental decoding, the trainer's recompute), compared between them, and replayed in another
(routing replay, R2/R3: arXiv 2510.11370; verl actor.router_replay.mode).

Everything works on transformers' router modules through forward hooks, never by editing model
code. Every router transformers 5 ships for the architectures moe-proxy builds returns
(logits, top-k weights, top-k indices); a replay swaps the indices and recomputes the weights
from the router's own logits by that router's rule (`WEIGHT_RULES`), so the gate weights still
get their gradients. A router whose rule is not known here is refused by name.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moe_proxy.errors import InvalidReproConfig
from moe_proxy.rl.routers import Router, router_output


def _softmax_topk(router, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Qwen2/3-MoE, OLMoE, Mixtral: softmax over all experts, gathered, renormalised if asked."""
    w = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, idx)
    if getattr(router, "norm_topk_prob", True):  # Mixtral has no switch: always renormalised
        w = w / w.sum(-1, keepdim=True)
    return w.to(logits.dtype)


def _sigmoid_scaled(router, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3, GLM-4.5: sigmoid scores (without the correction bias), renormalised, scaled."""
    w = logits.float().sigmoid().gather(1, idx)
    if router.norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * router.routed_scaling_factor


def _softmax_scaled(router, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V2: softmax over all experts, gathered, scaled."""
    return torch.softmax(logits, dim=-1, dtype=torch.float32).gather(1, idx) * router.routed_scaling_factor


def _softmax_of_chosen(_router, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """GPT-OSS: softmax over the chosen experts' logits only."""
    return torch.softmax(logits.gather(1, idx), dim=1, dtype=logits.dtype)


WEIGHT_RULES: dict[str, Callable] = {
    "Qwen3MoeTopKRouter": _softmax_topk, "Qwen2MoeTopKRouter": _softmax_topk, "OlmoeTopKRouter": _softmax_topk,
    "MixtralTopKRouter": _softmax_topk, "DeepseekV3TopkRouter": _sigmoid_scaled,
    "Glm4MoeTopkRouter": _sigmoid_scaled, "DeepseekV2TopkRouter": _softmax_scaled,
    "GptOssTopKRouter": _softmax_of_chosen,
}


class RoutingRecorder:
    """Records every router's chosen experts while `recording`: per layer, a [rows, positions, k]
    tensor, the forward passes' chunks (a prefill, then one position per decode step) joined in
    order. `rows` is the batch size of the passes (the router sees rows x chunk tokens, row-major)."""

    def __init__(self, routers: list[Router]):
        self.rows, self.recording = 0, False
        self.chunks: dict[int, list[torch.Tensor]] = {}
        for router in routers:
            router.module.register_forward_hook(self._hook(router))

    def _hook(self, router: Router):
        def hook(_module, _inputs, output):
            if not self.recording:
                return
            idx = router_output(output)[1]
            if idx is None:
                raise InvalidReproConfig(f"{router.name} ({type(router.module).__name__}) does not return its chosen "
                                         "experts: its routing cannot be recorded")
            self.chunks.setdefault(router.layer, []).append(idx.detach().reshape(self.rows, -1, idx.shape[-1]))
        return hook

    def start(self, rows: int) -> None:
        self.rows, self.recording = rows, True
        self.chunks.clear()

    def stop(self) -> dict[int, torch.Tensor]:
        self.recording = False
        return {layer: torch.cat(chunks, dim=1) for layer, chunks in self.chunks.items()}


class RoutingReplay:
    """Makes the routers route as told: `use(choices)` with per layer a [rows, positions, k] tensor
    of expert indices (-1 where the router chooses for itself) for the next forward passes, whose
    tokens are rows x positions. Registered ahead of any other hook on the routers, so taps and
    recorders see the routing that was used."""

    def __init__(self, routers: list[Router]):
        unknown = sorted({type(r.module).__name__ for r in routers} - set(WEIGHT_RULES))
        if unknown:
            raise InvalidReproConfig(f"--routing-replay: cannot replay routing through {', '.join(unknown)} "
                                     f"(replayable routers: {', '.join(sorted(WEIGHT_RULES))})")
        self.choices: dict[int, torch.Tensor] | None = None
        for router in routers:
            router.module.register_forward_hook(self._hook(router), prepend=True)

    def use(self, choices: dict[int, torch.Tensor] | None) -> None:
        self.choices = choices

    def _hook(self, router: Router):
        rule = WEIGHT_RULES[type(router.module).__name__]

        def hook(module, _inputs, output):
            if self.choices is None or router.layer not in self.choices:
                return None
            logits, _, natural = output[:3]
            told = self.choices[router.layer].reshape(-1, natural.shape[-1]).to(natural.device)
            if told.shape != natural.shape:
                raise RuntimeError(f"{router.name}: routing replay for {tuple(told.shape)} token slots, the forward "
                                   f"has {tuple(natural.shape)}")
            idx = torch.where(told >= 0, told, natural)
            return (logits, rule(module, logits.reshape(-1, logits.shape[-1]), idx), idx, *output[3:])
        return hook


def mismatch_counts(rollout: dict[int, torch.Tensor], trainer: dict[int, torch.Tensor],
                    valid: torch.Tensor) -> dict[int, tuple[float, float]]:
    """Per layer: (tokens whose routed expert *set* differs, tokens compared), over the positions
    `valid` ([rows, positions] bool) that both forwards routed."""
    out = {}
    for layer, mine in trainer.items():
        if layer not in rollout:
            continue
        width = min(mine.shape[1], rollout[layer].shape[1], valid.shape[1])
        a = rollout[layer][:, :width].to(mine.device).sort(-1).values
        b = mine[:, :width].sort(-1).values
        keep = valid[:, :width].to(mine.device)
        differs = (a != b).any(-1) & keep
        out[layer] = (float(differs.sum()), float(keep.sum()))
    return out


def replay_choices(choices: dict[int, torch.Tensor], rows: torch.Tensor, positions: int) -> dict[int, torch.Tensor]:
    """The recorded `choices` of `rows`, cut or padded (with -1: not replayed) to `positions`."""
    out = {}
    for layer, idx in choices.items():
        part = idx[rows.to(idx.device)]
        if part.shape[1] < positions:
            part = torch.nn.functional.pad(part, (0, 0, 0, positions - part.shape[1]), value=-1)
        out[layer] = part[:, :positions]
    return out
