"""A layer's usage statistics (LayerStats, statistics.py's module docstring says what each
holds) and the criteria they are judged by, as `moe-proxy calibrate` records them and
`build --calibration` applies them; and the key of the proxy that sequential statistics are
made for (selection_key).

Criteria:
- dead: gate-mass share below DEAD_SHARE x the uniform share 1/E (default 1% of uniform), unless
  super: an expert whose output is massive is never dead, however rarely it is routed (the super
  experts of real models fire on a handful of tokens, the first one and delimiters: arXiv
  2507.23279). Before, one routed to 7 of 2048 tokens at 300x its layer's median max |output|
  was dead, and dropped. Such experts are listed per layer as `super_rarely_routed`;
- super (REAP's `model_util.get_super_expert_indices`, after "Unveiling Super Experts in MoE
  LLMs", arXiv 2507.23279, where super experts are a handful in a whole model): max_abs above
  both the SUPER_PERCENTILE (99.5th) percentile of the max_abs of every routed expert of every
  scored MoE layer (the threshold is taken over all of them) and SUPER_GLOBAL (1/10) of the
  largest one; as REAP does by default (`--perserve_super_experts`), only experts of the first
  SUPER_LAYERS (75%, int(0.75 x the MoE layer count)) of the MoE layers are flagged, since the
  last layers' large outputs are their normal scale. Two departures: a model with a single MoE
  layer keeps it eligible (REAP's int(0.75) would flag nothing), and an expert never routed to a
  calibration token is never super (its max_abs comes from the probe tokens alone).
  That rule is made for pruning to deploy; this project prunes to reproduce failures, and a
  massive activation is what overflows in half precision (issue 30). So in every MoE layer, the
  last ones included, a live expert is super too when its max_abs reaches a share of fp16's range
  (65504; `--super-range-share`, default 1/8: "fp16-range"), or a factor of its layer's median
  max_abs over live experts (`--super-outlier`, default 100: "layer-outlier"). Each super expert
  is recorded with the rule that made it.
  (Before, an expert was super at 10x its layer's median and 1/10 of the largest: with 23-29
  of 64 experts dead the median is low, and it flagged 10 ordinary experts in one layer.)
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from moe_proxy.options import FP16_MAX, SUPER_OUTLIER, SUPER_RANGE_SHARE, flag

DEAD_SHARE = 0.01
SUPER_PERCENTILE = 99.5  # REAP: above this percentile of every routed expert's max |output| ...
SUPER_GLOBAL = 0.1  # ... and above this share of the largest one
SUPER_LAYERS = 0.75  # ... in the first 75% of the MoE layers
# Kept because they can make a failure (issue 30), in every MoE layer, the last ones included; the
# thresholds are the build's options (--super-range-share, --super-outlier), defaults in options.py.


def thresholds(range_share: float = SUPER_RANGE_SHARE, outlier: float = SUPER_OUTLIER) -> dict:
    """The thresholds statistics are judged by, as the artifact and the manifest record them."""
    return {"dead_share_of_uniform": DEAD_SHARE, "super_percentile": SUPER_PERCENTILE,
            "super_share_of_global_max": SUPER_GLOBAL, "super_first_layers_share": SUPER_LAYERS,
            "super_fp16_range_share": range_share, "super_layer_outlier_factor": outlier}


def selection_key(plan, options) -> dict:
    """What decides a proxy's kept experts (besides pins): sequential statistics are only valid
    for builds with the same key. `plan`: an ExpertPlan (counts), `options`: PruningOptions."""
    key = {"experts": plan.experts_after, "top_k": plan.top_k_after, "method": options.method,
           "keep_super": options.keep_super}
    # the super-expert thresholds only where they differ from the defaults (keys made before they
    # were options stay valid)
    key |= {name: getattr(options, name) for name, default in (("super_range_share", SUPER_RANGE_SHARE),
                                                                 ("super_outlier", SUPER_OUTLIER))
            if getattr(options, name) != default}
    if options.method == "cluster":
        key |= {"features": options.features, "representative": options.representative or "saliency",
                "clustering": options.clustering, "seed": options.seed}
    return key


def selection_flags(key: dict) -> str:
    """The options of `moe-proxy calibrate --sequential` / `build` that give this key."""
    flags = [f"--experts {key['experts']}", f"--top-k {key['top_k']}", f"--method {key['method']}"]
    flags += [f"--{name} {key[name]}" for name in ("features", "representative") if name in key]
    flags += [f"{flag(name)} {key[name]:g}" for name in ("super_range_share", "super_outlier") if name in key]
    return " ".join(flags + ([] if key["keep_super"] else ["--no-keep-super"]))


@dataclass
class LayerStats:
    prefix: str
    layer: int
    tokens: torch.Tensor
    gate_mass: torch.Tensor
    saliency: torch.Tensor
    max_abs: torch.Tensor
    output_mean: torch.Tensor
    output_probe: torch.Tensor
    routing_probe: torch.Tensor

    NAMES = ("tokens", "gate_mass", "saliency", "max_abs", "output_mean", "output_probe", "routing_probe")

    @property
    def share(self) -> torch.Tensor:
        """Each expert's share of the layer's gate mass."""
        total = self.gate_mass.sum()
        return self.gate_mass / total if total > 0 else torch.zeros_like(self.gate_mass)

    def dead(self, threshold: float = DEAD_SHARE, supers: Collection[int] = ()) -> list[int]:
        """Experts under `threshold` x uniform of the gate mass, the layer's `supers` left out."""
        n = len(self.gate_mass)
        return [e for e in range(n) if self.share[e] < threshold / n and e not in supers]

    def rarely_routed(self, supers: Collection[int]) -> dict[str, dict]:
        """The `supers` the gate-mass rule alone would call dead, with their figures (the manifest's
        and calibration.json's `super_rarely_routed`)."""
        n, rare = len(self.gate_mass), set(self.dead()) & set(supers)
        return {str(e): {"tokens": int(self.tokens[e]), "gate_share_of_uniform": round(float(self.share[e]) * n, 6),
                         "max_abs": round(float(self.max_abs[e]), 6)} for e in sorted(rare)}

    def load_imbalance(self) -> float:
        """Most-loaded expert's tokens over the mean (1.0 = perfectly balanced)."""
        mean = self.tokens.mean()
        return float(self.tokens.max() / mean) if mean > 0 else 0.0


def super_experts(layers: dict[str, LayerStats], moe_layers: int | None = None,
                  range_share: float = SUPER_RANGE_SHARE, outlier: float = SUPER_OUTLIER) -> dict[str, dict[int, str]]:
    """Per layer, its super experts and the rules that made each one: REAP's ("reap", the module
    docstring's), and in every layer the experts whose output comes within `range_share` of fp16's
    range ("fp16-range") or is `outlier` times its layer's median over live experts ("layer-outlier");
    any expert routed to a calibration token is judged, however rarely; never one routed to none.
    `moe_layers`: how many MoE layers the model has, where `layers` holds only the first
    ones (sequential statistics)."""
    if not layers:
        return {}
    values = torch.cat([s.max_abs.double() for s in layers.values()])
    threshold = max(float(torch.quantile(values, SUPER_PERCENTILE / 100)), SUPER_GLOBAL * float(values.max()))
    first = set(sorted(layers, key=lambda p: layers[p].layer)[:max(1, int(SUPER_LAYERS * (moe_layers or len(layers))))])
    out: dict[str, dict[int, str]] = {}
    for p, stats in layers.items():
        dead = set(stats.dead())
        live = [v for e, v in enumerate(stats.max_abs.tolist()) if e not in dead]
        median = float(torch.tensor(live, dtype=torch.float64).quantile(0.5)) if live else 0.0
        routed = [(e, v) for e, v in enumerate(stats.max_abs.tolist()) if stats.tokens[e] > 0]
        found: dict[int, str] = {}
        for e, v in routed:
            rules = [rule for rule, hit in (("reap", p in first and v > threshold),
                                            ("fp16-range", v >= range_share * FP16_MAX),
                                            ("layer-outlier", median > 0 and v >= outlier * median)) if hit]
            if rules:
                found[e] = "+".join(rules)  # every rule that holds, e.g. "reap+fp16-range"
        out[p] = found
    return out
