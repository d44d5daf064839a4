"""Super experts are never dead, however rarely they are routed (issue 41, section 6).

The super experts of real models fire on a handful of tokens (the first token, delimiters:
"Unveiling Super Experts in MoE LLMs", arXiv 2507.23279). An expert routed to 7 of 2048
calibration tokens with a max |output| 300x its layer's median was classed dead (its gate-mass
share under 1% of uniform), never judged super, and dropped from every proxy. It is now super,
kept, and listed in the manifest as `super_rarely_routed`; an expert routed to no calibration
token at all stays dead, whatever its output on the probe tokens.
"""

from __future__ import annotations

import torch

from moe_proxy.pruning.build import build_proxy
from moe_proxy.calibrate import criteria
from moe_proxy.calibrate import statistics as cal
from moe_proxy.storage import open_store

RARE, NEVER = 5, 6  # planted: routed to 7 tokens / to none, both at 300x the layer's median output
PREFIX = "model.layers.1.mlp"  # the tiny Qwen3-MoE's MoE layer: 8 experts, top-2


def plant(stats: criteria.LayerStats) -> None:
    """As the issue measured it: 7 of 2048 tokens, a share of the gate mass far under 1% of uniform."""
    n, total = len(stats.tokens), float(stats.gate_mass.sum())
    median = float(stats.max_abs.median())
    for e, tokens in ((RARE, 7.0), (NEVER, 0.0)):
        stats.tokens[e] = tokens
        stats.gate_mass[e] = tokens * 1e-4 * total / 2048  # 7 small routing weights
        stats.max_abs[e] = 300 * median
    assert set(stats.dead()) == {RARE, NEVER} and float(stats.share[RARE]) < criteria.DEAD_SHARE / n


def test_a_rarely_routed_massive_expert_is_super_kept_and_said_in_the_manifest(tiny, tmp_path):
    src = tiny("qwen3_moe")
    cal.calibrate(str(src), str(tmp_path / "real"), samples=16, seq_len=32)
    stats = cal.load(str(tmp_path / "real"))
    plant(stats.layers[PREFIX])
    cal.save(open_store(str(tmp_path / "planted")), stats)

    supers = criteria.super_experts(stats.layers)[PREFIX]
    assert "layer-outlier" in supers[RARE].split("+") and NEVER not in supers
    assert stats.layers[PREFIX].dead(supers=supers) == [NEVER]

    m = build_proxy(str(src), str(tmp_path / "p"), experts=4, calibration=str(tmp_path / "planted"),
                    reconstruct=False)
    layer = m["layers"][PREFIX]
    assert RARE in layer["kept"] and RARE in layer["super"] and NEVER not in layer["kept"]
    assert layer["dead"] == [NEVER]
    rare = layer["super_rarely_routed"][str(RARE)]
    assert rare["tokens"] == 7 and rare["gate_share_of_uniform"] < criteria.DEAD_SHARE
    assert rare["max_abs"] == layer["super_kept_by"][str(RARE)]["max_abs"]
    # --no-keep-super leaves it to the selection, but as a live expert, never a dead one
    off = build_proxy(str(src), str(tmp_path / "q"), experts=4, calibration=str(tmp_path / "planted"),
                      reconstruct=False, keep_super=False)["layers"][PREFIX]
    assert off["dead"] == [NEVER] and str(RARE) in off["super_rarely_routed"]


def test_the_rule_on_planted_statistics_alone():
    """The same rule without a checkpoint: 64 experts, 2048 tokens top-8."""
    n = 64
    tokens = torch.full((n,), 2048 * 8 / n, dtype=torch.float64)
    max_abs = torch.linspace(1.0, 3.0, n, dtype=torch.float64)
    stats = criteria.LayerStats("model.layers.0.mlp", 0, tokens, tokens / 8, torch.zeros(n), max_abs,
                           torch.zeros(n, cal.SKETCH_DIM), torch.zeros(n, cal.PROBE_TOKENS * cal.PROBE_DIM),
                           torch.zeros(n, cal.ROUTING_PROBE))
    median = float(max_abs.median())
    stats.tokens[RARE], stats.gate_mass[RARE], stats.max_abs[RARE] = 7, 7 * 0.02, 300 * median
    stats.tokens[NEVER], stats.gate_mass[NEVER], stats.max_abs[NEVER] = 0, 0, 300 * median
    supers = criteria.super_experts({stats.prefix: stats})[stats.prefix]
    assert sorted(supers) == [RARE] and stats.dead(supers=supers) == [NEVER]
    assert list(stats.rarely_routed(supers)) == [str(RARE)]
