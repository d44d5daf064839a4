"""Proxy-aware (sequential) calibration: `moe-proxy calibrate --experts N [--method M]` (the
default as soon as the proxy's count is given; `--sequential` is implied).

A one-pass calibration scores every MoE layer on the original's hidden states, but the proxy's
layer i sees hidden states that went through the proxy's pruned layers 0..i-1. Sequentially
(REAP's order; at 12.5% on a real-text model it moved held-out CE from 2.11 to 2.02), layer i is
scored on those: the original layer i (all experts) runs on the proxy's hidden states and
gives its statistics, its experts are selected right away (the build's own usage_select with
the build's options), and the hidden states are then carried through the pruned layer (the
model's own MoE class with the proxy config and the kept experts, layerwise/blocks.py). Still
one decoder layer resident.

The scoring is calibrate/statistics.py's pass; this module is the proxy it is made for
(statistics.SequentialTarget), here because it is the build's selection.

A layer's super experts are judged when it is selected, against the layers scored so far (the
later ones are not scored yet: the percentile is over the scored layers' experts, and the
first-75%-of-layers cut over all the model's MoE layers); the artifact records them with the
kept experts, and builds use them as recorded.
"""

from __future__ import annotations

import torch

from moe_proxy.pruning.config import rewrite_config
from moe_proxy.pruning.expert_plan import proxy_counts
from moe_proxy.pruning.usage import usage_select
from moe_proxy.calibrate.criteria import LayerStats, selection_key, super_experts
from moe_proxy.checkpoint.layout import Layout, MoeBlock
from moe_proxy.checkpoint.reader import Checkpoint
from moe_proxy.errors import MoeProxyError
from moe_proxy.layerwise.blocks import proxy_block
from moe_proxy.layerwise.load import transformers_config
from moe_proxy.options import PruningOptions


class SequentialProxy:
    """The proxy being calibrated for: selections made layer by layer, and its pruned blocks."""

    def __init__(self, ckpt: Checkpoint, layout: Layout, options: PruningOptions):
        if options.experts is None and options.keep_ratio is None:
            raise MoeProxyError("--sequential needs the proxy's size: --experts N")
        self.ckpt, self.options = ckpt, options
        self.plan = proxy_counts(layout.arch, ckpt.config, options)
        self.key = selection_key(self.plan, options)
        self.config = transformers_config(rewrite_config(ckpt.config, self.plan))
        self.supers: dict[str, dict[int, str]] = {}  # per MoE block selected so far: expert -> rule
        self.super_rule = dict(range_share=options.super_range_share, outlier=options.super_outlier)
        self.kept: dict[str, list[int]] = {}
        # MoE layers that get statistics (the MTP layer, index num_hidden_layers, does not):
        # the super-expert rule looks only at the first 75% of them
        layers = ckpt.config.get("num_hidden_layers")
        self.moe_layers = sum(1 for b in layout.blocks if layers is None or b.layer < int(layers))

    def select(self, block: MoeBlock, scored: dict[str, LayerStats]) -> list[int]:
        """Block's kept experts from its statistics (`scored`: every layer scored so far)."""
        self.supers[block.prefix] = super_experts(scored, self.moe_layers, **self.super_rule)[block.prefix]
        pins = sorted(set(self.options.pins.get(block.layer, [])))
        sel = usage_select(self.ckpt, block, scored[block.prefix], self.supers[block.prefix],
                           self.plan.experts_after, self.plan.n_group, self.options, pins)
        self.kept[block.prefix] = sel.kept
        return sel.kept

    def block(self, original: torch.nn.Module, kept: list[int], dtype: torch.dtype) -> torch.nn.Module:
        return proxy_block(original, self.config, kept, dtype, same_kernels=True)
