"""Calibration-based selection for models that fit in memory: run calibration tokens through
the whole model once, record per MoE layer how the router uses each expert, and choose the
kept experts from that rather than from weight space.

- `frequency`: keep the k experts with the most gate mass (sum of the routing weights they
  received; ties broken by token count).
- `routing` features for clustering: each expert's vector of router probabilities over the
  calibration tokens, so experts that fire on the same tokens fall in one cluster; the
  representative is the most used member of its cluster.

The result is a `pins` map (layer -> kept experts) that `build_proxy(..., pins=...)` writes
exactly. The layer-by-layer `moe-proxy calibrate` pass (any model size) supersedes this pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .errors import MoeProxyError
from .repro.routers import RouterTap

METHODS = ("frequency", "routing")


@dataclass
class RoutingStats:
    layer: int
    tokens: int
    counts: np.ndarray  # [E] tokens routed to each expert
    gate_mass: np.ndarray  # [E] sum of the (top-k) routing weights each expert received
    profile: np.ndarray  # [E, T] router probability of each expert on each calibration token


@torch.no_grad()
def collect(model_dir: str | Path, token_batches: list[torch.Tensor], device: str = "cpu") -> dict[int, RoutingStats]:
    """Push `token_batches` ([B, T] token ids) through the model; routing statistics per MoE layer."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    tap = RouterTap(model, getattr(model.config, "num_experts_per_tok", 1))
    logits: dict[int, list[torch.Tensor]] = {}
    chosen: dict[int, list[torch.Tensor]] = {}
    for ids in token_batches:
        ids = ids.to(device)
        tap.start(torch.ones_like(ids))
        model(input_ids=ids)
        tap.stop()
        for layer, value in tap.logits.items():
            logits.setdefault(layer, []).append(value.float().cpu())
            chosen.setdefault(layer, []).append(tap.chosen_experts(layer, value).cpu())
    stats = {}
    for layer in logits:
        probs = torch.cat(logits[layer]).softmax(-1)  # [T, E]
        picks = torch.cat(chosen[layer])  # [T, k]
        weights = probs.gather(-1, picks)
        weights = weights / weights.sum(-1, keepdim=True)  # renormalised top-k weights
        experts = probs.shape[-1]
        counts = torch.bincount(picks.reshape(-1), minlength=experts)
        mass = torch.zeros(experts).index_add_(0, picks.reshape(-1), weights.reshape(-1))
        stats[layer] = RoutingStats(layer, probs.shape[0], counts.numpy(), mass.numpy(), probs.T.numpy())
    return stats


def routing_pins(stats: dict[int, RoutingStats], k: int, method: str, seed: int = 0) -> dict[int, list[int]]:
    """Kept experts per layer (ascending ids), `k` per layer, by `method` (see module doc)."""
    if method not in METHODS:
        raise MoeProxyError(f"unknown routing-based method {method!r}: choose one of {', '.join(METHODS)}")
    pins = {}
    for layer, s in stats.items():
        if not 1 <= k <= len(s.counts):
            raise MoeProxyError(f"cannot keep {k} of {len(s.counts)} experts in layer {layer}")
        usage = np.lexsort((s.counts, s.gate_mass))[::-1]  # most gate mass first
        if method == "frequency":
            pins[layer] = sorted(int(e) for e in usage[:k])
        else:
            pins[layer] = _cluster_by_profile(s, k, seed)
    return pins


def _cluster_by_profile(s: RoutingStats, k: int, seed: int) -> list[int]:
    from sklearn.cluster import KMeans

    # Normalise each expert's profile so clusters group *where* an expert fires, not how much.
    x = s.profile / np.maximum(np.linalg.norm(s.profile, axis=1, keepdims=True), 1e-12)
    labels = KMeans(n_clusters=k, n_init=10, random_state=seed).fit_predict(x)
    kept = []
    for c in np.unique(labels):
        members = np.flatnonzero(labels == c)
        kept.append(int(members[np.argmax(s.gate_mass[members])]))
    # KMeans can leave fewer non-empty clusters than k on degenerate data: fill by usage.
    for e in np.argsort(-s.gate_mass):
        if len(kept) >= k:
            break
        if int(e) not in kept:
            kept.append(int(e))
    return sorted(kept)
