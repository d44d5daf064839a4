"""The super-expert rules (REAP's get_super_expert_indices, and issue 30's fp16-range and
layer-outlier rules in every layer) on statistics shaped like real ones: a heavy-tailed spread of
max |output| with many dead experts flags nothing but a true outlier."""

from __future__ import annotations

import torch

from moe_proxy.calibrate import criteria
from moe_proxy.calibrate import statistics as cal

E = 64


def layer(index: int, max_abs: torch.Tensor, dead: list[int] = ()) -> criteria.LayerStats:
    gate_mass = torch.ones(E, dtype=torch.float64)
    gate_mass[list(dead)] = 0.0
    zeros = torch.zeros(E, dtype=torch.float64)
    return criteria.LayerStats(f"model.layers.{index}.mlp", index, gate_mass * 10, gate_mass, zeros, max_abs,
                          torch.zeros(E, cal.SKETCH_DIM), torch.zeros(E, cal.PROBE_TOKENS * cal.PROBE_DIM),
                          torch.zeros(E, cal.ROUTING_PROBE))


def heavy_tailed(n_layers: int, seed: int = 0) -> dict[str, criteria.LayerStats]:
    """Like the lab's trained qwen3: per layer 20-30 dead experts whose max |output| (probe tokens
    only) is small, and live ones spread log-normally (largest 15-40x the layer's median)."""
    g = torch.Generator().manual_seed(seed)
    layers = {}
    for i in range(n_layers):
        dead = torch.randperm(E, generator=g)[:20 + 3 * i].tolist()
        values = torch.exp(torch.randn(E, generator=g, dtype=torch.float64) * 0.9 + 1.0)
        values[dead] = 0.05 + 0.2 * torch.rand(len(dead), generator=g, dtype=torch.float64)
        layers[f"model.layers.{i}.mlp"] = layer(i, values, dead)
    return layers


def old_rule_count(layers: dict[str, criteria.LayerStats]) -> int:
    """The rule this module replaced: 10x the layer's median and 1/10 of the model's largest."""
    top = max(float(s.max_abs.max()) for s in layers.values())
    return sum(int(((s.max_abs >= 10 * s.max_abs.median()) & (s.max_abs >= 0.1 * top)).sum())
               for s in layers.values())


def test_heavy_tailed_layers_without_outliers_flag_at_most_the_models_top_two():
    layers = heavy_tailed(4)
    assert old_rule_count(layers) >= 8  # the old rule took ordinary experts of a skewed layer for super
    supers = criteria.super_experts(layers)
    flagged = [(p, e) for p, es in supers.items() for e in es]
    # above the 99.5th percentile of 256 values: the largest two at most
    assert len(flagged) <= 2
    values = torch.cat([s.max_abs for s in layers.values()])
    assert all(float(layers[p].max_abs[e]) > float(torch.quantile(values, 0.995)) for p, e in flagged)


def test_a_genuine_outlier_is_flagged_and_nothing_else():
    layers = heavy_tailed(4, seed=1)
    live = next(e for e in range(E) if e not in layers["model.layers.1.mlp"].dead())
    # orders of magnitude above every other expert, as in "Unveiling Super Experts"
    layers["model.layers.1.mlp"].max_abs[live] = 30 * max(float(s.max_abs.max()) for s in layers.values())
    supers = {p: sorted(v) for p, v in criteria.super_experts(layers).items()}
    assert supers == {"model.layers.0.mlp": [], "model.layers.1.mlp": [live], "model.layers.2.mlp": [],
                      "model.layers.3.mlp": []}


def test_dead_experts_are_never_super_and_reap_skips_the_last_quarter():
    layers = heavy_tailed(4, seed=2)
    dead = layers["model.layers.0.mlp"].dead()[0]
    layers["model.layers.0.mlp"].max_abs[dead] = 1e4  # a huge output on the probe tokens, never routed
    layers["model.layers.3.mlp"].max_abs[5] = 1e4  # REAP looks at the first int(0.75 x 4) = 3 layers only ...
    supers = criteria.super_experts(layers)
    assert not any("reap" in rule.split("+") for v in supers.values() for rule in v.values())
    # ... but 1e4 is within 1/8 of fp16's range: kept for what it can make fail, in any layer (issue 30)
    assert supers["model.layers.3.mlp"] == {5: "fp16-range+layer-outlier"}
    assert dead not in supers["model.layers.0.mlp"]  # never a dead one
    # Sequential statistics score layers one at a time: with 2 of 4 layers scored, both are
    # among the first three, so layer 1's outlier counts; judged as a 2-layer model it would not.
    first_two = {p: layers[p] for p in ("model.layers.0.mlp", "model.layers.1.mlp")}
    live = next(e for e in range(E) if e not in first_two["model.layers.1.mlp"].dead())
    first_two["model.layers.1.mlp"].max_abs[live] = 1e6
    assert "reap" in criteria.super_experts(first_two, moe_layers=4)["model.layers.1.mlp"][live]
    assert "reap" not in criteria.super_experts(first_two)["model.layers.1.mlp"].get(live, "")


def test_a_single_moe_layer_stays_eligible():
    one = {"model.layers.1.mlp": layer(1, torch.cat([torch.ones(E - 1), torch.tensor([500.0])]).double())}
    assert criteria.super_experts(one) == {"model.layers.1.mlp": {E - 1: "reap+layer-outlier"}}
