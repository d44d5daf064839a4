"""Usage-aware selection for one MoE block, from `moe-proxy calibrate` statistics.

- Dead experts (criteria.DEAD_SHARE) are never kept unless pinned, or, with `fill_dead`, where
  a layer has fewer alive experts than the count (a collapsed router): then its most-routed dead
  experts fill the count (`dead_kept` in the manifest). A user's build refuses such a count; the
  loop's probes fill it, since a collapsed checkpoint is what they are there to reproduce.
- Super experts (criteria.super_experts) are pinned, unless `keep_super` is off; a super
  expert is never dead, however rarely it is routed (`super_rarely_routed` in the manifest).
- `--method frequency` keeps the experts with the most gate mass, `--method saliency` the
  highest REAP saliency, both within routing groups.
- `--method cluster` clusters the alive experts on `--features` (`routing`: router logits
  on probe tokens; `output`: expert outputs on probe tokens; or the data-free `router` /
  `weights`), and each cluster's representative is its most salient member
  (`--representative saliency`, the default here) or its medoid.
"""

from __future__ import annotations

import numpy as np

from moe_proxy.calibrate.criteria import DEAD_SHARE, LayerStats
from moe_proxy.checkpoint.reader import Checkpoint
from moe_proxy.errors import InvalidExpertCount, MoeProxyError
from moe_proxy.pruning.features import expert_features
from moe_proxy.checkpoint.layout import MoeBlock
from moe_proxy.pruning.selection import Selection, select

# options.CALIBRATED_FEATURES -> the statistics that hold them
PROBES = {"routing": "routing_probe", "output": "output_probe"}


def usage_select(ckpt: Checkpoint, block: MoeBlock, stats: LayerStats, supers: dict[int, str], k: int,
                 n_group: int, options, pins: list[int]) -> Selection:
    """`supers`: this layer's super experts and the rule(s) that made each (criteria.super_experts).
    They are pinned (unless keep_super is off) as far as each routing group's share of the kept
    experts allows, the largest max |output| first; those that do not fit are recorded."""
    n = block.n_experts
    if len(stats.gate_mass) != n:
        raise MoeProxyError(f"{block.prefix}: statistics cover {len(stats.gate_mass)} experts, the checkpoint {n}")
    dead = set(stats.dead(DEAD_SHARE, supers))
    alive = np.array([e not in dead for e in range(n)])
    k_per = k // n_group
    peak = stats.max_abs.tolist()
    forced, left_out = _forced(block, supers, peak, k_per, n_group, options, pins)
    filled = _fill_dead(block, alive, forced, k_per, n_group, stats) if options.fill_dead else []
    _check_alive(block, alive, forced, k_per, n_group)
    if options.features in PROBES:
        feats = getattr(stats, PROBES[options.features]).double().numpy()
    else:
        feats = expert_features(ckpt, block, options.features if options.method == "cluster" else "router")
    scores = (stats.gate_mass if options.method == "frequency" else stats.saliency).double().numpy()
    sel = select(feats, k, n_group=n_group, method=options.method, clustering=options.clustering,
                 seed=options.seed, pins=forced, scores=scores, alive=alive,
                 representative=options.representative or "saliency", layer=block.layer)
    share = stats.share

    def figures(experts) -> dict:
        return {str(e): {"rule": supers[e], "max_abs": round(peak[e], 6)} for e in sorted(experts)}

    sel.record = {
        "gate_mass_kept": round(float(share[sel.kept].sum()), 6),
        "super": sorted(e for e in supers if e in sel.kept),
        "super_kept_by": figures(e for e in supers if e in sel.kept),
        "super_dropped": sorted(e for e in supers if e not in sel.kept),
        "dead": sorted(dead),
    }
    if filled:
        sel.record["dead_kept"] = filled
    if rare := stats.rarely_routed(supers):  # super although the gate-mass rule would call it dead
        sel.record["super_rarely_routed"] = rare
    if left_out:  # more super experts than the layer (or its routing group) keeps
        sel.record["super_not_kept"] = figures(left_out)
    return sel


def _forced(block: MoeBlock, supers: dict[int, str], peak: list[float], k_per: int, n_group: int, options,
            pins: list[int]) -> tuple[list[int], list[int]]:
    """(the experts kept whatever the scores: the pins and, with keep_super, the super experts that
    fit each routing group's share, the largest max |output| first; the super experts left out)."""
    per = block.n_experts // n_group
    forced, left_out = sorted(set(pins)), []
    for g in range(n_group):
        in_group = [e for e in forced if g * per <= e < (g + 1) * per]
        if len(in_group) > k_per:
            where = f" in routing group {g}" if n_group > 1 else ""
            raise InvalidExpertCount(
                f"layer {block.layer}: {len(in_group)} experts{where} are pinned ({sorted(set(pins))}) but only "
                f"{k_per} are kept there; raise --experts or pin fewer"
            )
        if options.keep_super:
            room = k_per - len(in_group)
            candidates = sorted((e for e in supers if g * per <= e < (g + 1) * per and e not in forced),
                                key=lambda e: -peak[e])
            forced += candidates[:room]
            left_out += candidates[room:]
    return sorted(forced), left_out


def _fill_dead(block: MoeBlock, alive: np.ndarray, forced: list[int], k_per: int, n_group: int,
               stats: LayerStats) -> list[int]:
    """Mark as alive (in place) the dead experts a routing group needs to keep k_per, the most
    routed first (gate mass, then saliency, then number); returns them, sorted."""
    per = block.n_experts // n_group
    mass, salience = stats.gate_mass.tolist(), stats.saliency.tolist()
    filled = []
    for g in range(n_group):
        group = range(g * per, (g + 1) * per)
        short = k_per - sum(1 for e in group if alive[e] or e in forced)
        dead = sorted((e for e in group if not alive[e] and e not in forced),
                      key=lambda e: (-mass[e], -salience[e], e))
        filled += dead[:max(short, 0)]
    alive[filled] = True
    return sorted(filled)


def _check_alive(block: MoeBlock, alive: np.ndarray, forced: list[int], k_per: int, n_group: int) -> None:
    """Refuse a count that would keep dead experts: each routing group needs k_per alive or forced."""
    per = block.n_experts // n_group
    for g in range(n_group):
        usable = [e for e in range(g * per, (g + 1) * per) if alive[e] or e in forced]
        if len(usable) < k_per:
            where = f" in routing group {g} (experts {g * per}..{(g + 1) * per - 1})" if n_group > 1 else ""
            raise InvalidExpertCount(
                f"layer {block.layer}: only {int(alive[g * per:(g + 1) * per].sum())} of {per} experts are alive"
                f"{where} on the calibration data (gate-mass share >= {DEAD_SHARE:g} x uniform), so {k_per} "
                f"cannot be kept there without keeping dead experts; use fewer --experts or --pin them"
            )
