"""Rewrite config.json for the proxy: every field that counts routed experts, and top-k.
Everything else (quantization_config, auto_map, rope settings, dtype keys, grouped-routing
fields, which stay valid by construction) is kept exactly as the source wrote it."""

from __future__ import annotations

import copy


def rewrite_config(config: dict, plan) -> dict:
    out = copy.deepcopy(config)
    for section in (out, out.get("text_config")):
        if not isinstance(section, dict):
            continue
        for key in plan.arch.expert_count_keys:
            if key in section:
                section[key] = plan.experts_after
        for key in plan.arch.top_k_keys:
            if key in section:
                section[key] = plan.top_k_after
    return out
