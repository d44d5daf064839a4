"""Calibration-based selection in memory: routing statistics of a real tiny model, the
frequency and routing-cluster choices, and a proxy built from them."""

import json

import numpy as np
import torch

from moe_proxy.build import build_proxy
from moe_proxy.routing_stats import RoutingStats, collect, routing_pins


def test_collect_counts_every_routed_slot(tiny_qwen3):
    batches = [torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    stats = collect(tiny_qwen3, batches)
    assert list(stats) == [1]  # layer 0 is dense
    s = stats[1]
    assert s.tokens == 2 * 4 * 16
    assert s.counts.sum() == s.tokens * 2  # top-2
    assert np.isclose(s.gate_mass.sum(), s.tokens, rtol=1e-5)  # renormalised weights sum to 1 per token
    assert s.profile.shape == (8, s.tokens)


def planted_stats():
    # 8 experts in 4 planted pairs that fire on the same tokens; within a pair the odd one is used more.
    rng = np.random.default_rng(0)
    base = rng.random((4, 50)) ** 4
    profile = np.repeat(base, 2, axis=0) + rng.random((8, 50)) * 0.01
    mass = np.array([1, 5, 2, 6, 30, 31, 0, 3], dtype=float)
    return {1: RoutingStats(1, 50, mass.astype(int), mass, profile)}


def test_frequency_keeps_most_used_and_routing_one_per_cluster():
    stats = planted_stats()
    assert routing_pins(stats, 3, "frequency") == {1: [3, 4, 5]}
    # one per planted pair, the more used member
    assert routing_pins(stats, 4, "routing") == {1: [1, 3, 5, 7]}


def test_proxy_built_from_routing_pins_keeps_them(tiny_qwen3, tmp_path):
    batches = [torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))]
    pins = routing_pins(collect(tiny_qwen3, batches), 4, "frequency")
    manifest = build_proxy(str(tiny_qwen3), str(tmp_path / "proxy"), experts=4, method="first-n", pins=pins)
    kept = {v["layer"]: v["kept"] for v in manifest["layers"].values()}
    assert kept == pins
    config = json.loads((tmp_path / "proxy" / "config.json").read_text())
    assert config.get("num_experts", config.get("num_local_experts")) == 4
