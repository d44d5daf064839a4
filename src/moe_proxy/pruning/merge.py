"""`build --merge`: each kept expert becomes the gate-mass-weighted average of its cluster.

A selection groups every expert of a MoE block under one kept expert (`Selection.assignment`:
its cluster with `--method cluster`, the nearest kept expert by the selection's features with
`frequency` / `saliency`). With --merge, kept expert j is written as

    W_j = W_rep + sum over members m != rep of  w_m (P_m(W_m) - W_rep),   w_m = mass_m / sum of its members' mass

for each of its gate, up and down projections, `mass` the gate mass each member received on
the calibration tokens (so a dead member weighs nothing, and a cluster whose members all
received nothing stays its representative). Written as the representative plus weighted
differences, identical members (sparse upcycling) give exactly the representative.

P_m permutes member m's intermediate neurons into correspondence with the representative's:
two experts trained apart compute the same function with their hidden units in any order, so
averaging them unaligned mixes unrelated units. A neuron is its gate row, up row and down
column; P_m is the permutation that maximises the summed inner products of matched neurons
(weight matching, as in Git Re-Basin), a linear assignment solved by scipy's
`linear_sum_assignment` (what scikit-learn itself uses; scikit-learn requires scipy).

One decoder layer at a time (a pass of layerwise.driver): its experts are read (block-FP8
dequantised), merged in float32, and rounded to the checkpoint's storage format through the
same writer as --reconstruct (fitted_tensors.py: dtype; block-FP8 re-quantised with its
`weight_scale_inv` layout), spilled to local disk until the shards are written. Router rows, shared experts and
the backbone are those of the plain proxy. With --reconstruct the merge happens inside its
layer loop instead (reconstruct.py): the merged experts are where the fit starts and what a
layer keeps when fitting does not help.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

from moe_proxy.pruning.config import rewrite_config
from moe_proxy.pruning.fitted_tensors import Spill, Targets
from moe_proxy.pruning.selection import Selection
from moe_proxy.checkpoint.layout import Layout, MoeBlock
from moe_proxy.checkpoint.reader import Checkpoint
from moe_proxy.errors import CannotMerge
from moe_proxy.layerwise.blocks import proxy_block
from moe_proxy.layerwise.driver import Layer, LayerPass
from moe_proxy.layerwise.load import transformers_config

log = logging.getLogger(__name__)


def neurons(gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """[I, 3H]: each intermediate neuron's gate row, up row and down column (transformers'
    experts layout: gate_up [2I, H] with the gate half first, down [H, I])."""
    gate, up = gate_up.chunk(2, dim=0)
    return torch.cat([gate, up, down.T], dim=1)


def align(reference: torch.Tensor, member: torch.Tensor) -> torch.Tensor:
    """The permutation `perm` ([I] indices) such that member neuron perm[i] matches reference
    neuron i: maximum total inner product of matched neurons (rows of `neurons`)."""
    score = (reference.double() @ member.double().T).numpy()
    rows, cols = linear_sum_assignment(score, maximize=True)
    perm = np.empty(len(rows), dtype=np.int64)
    perm[rows] = cols
    return torch.from_numpy(perm)


def permute(gate_up: torch.Tensor, down: torch.Tensor, perm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert with its intermediate neurons reordered: neuron i becomes old neuron perm[i]."""
    size = down.shape[1]
    return gate_up[torch.cat([perm, perm + size])], down[:, perm]


def expert_layout(experts: torch.nn.Module) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
    """The (gate_up_proj [E, 2I, H], down_proj [E, H, I]) parameters --merge knows how to merge."""
    params = dict(experts.named_parameters())
    gate_up, down = params.get("gate_up_proj"), params.get("down_proj")
    if (set(params) != {"gate_up_proj", "down_proj"} or gate_up.dim() != 3 or down.dim() != 3
            or gate_up.shape[1] != 2 * down.shape[2] or gate_up.shape[2] != down.shape[1]):
        raise CannotMerge(f"{type(experts).__name__} has parameters "
                          f"{ {n: list(p.shape) for n, p in params.items()} }: --merge knows transformers' "
                          f"gate_up_proj [E, 2I, H] (gate half first) and down_proj [E, H, I] without biases "
                          f"(e.g. GPT-OSS's interleaved experts with biases are not supported); build without --merge")
    return gate_up, down


def merge_weights(sel: Selection, gate_mass: torch.Tensor) -> list[tuple[list[int], list[float]]]:
    """Per kept expert: its members (representative first) and their weights (gate-mass shares)."""
    out = []
    for j, rep in enumerate(sel.kept):
        members = [rep] + [e for e, a in enumerate(sel.assignment) if a == j and e != rep]
        mass = gate_mass[members].double()
        total = float(mass.sum())
        weights = (mass / total).tolist() if total > 0 else [1.0] + [0.0] * (len(members) - 1)
        out.append((members, weights))
    return out


@torch.no_grad()
def merge_block(original: torch.nn.Module, proxy: torch.nn.Module, sel: Selection, gate_mass: torch.Tensor) -> list:
    """Set `proxy`'s kept experts (a proxy_block of `original`) to their clusters' merges;
    returns the manifest record: per kept expert its members and weights."""
    gate_up, down = expert_layout(original.experts)
    merged_gate_up, merged_down = expert_layout(proxy.experts)
    record = []
    for j, (members, weights) in enumerate(merge_weights(sel, gate_mass)):
        rep_gu, rep_down = gate_up[members[0]].float(), down[members[0]].float()
        ref = neurons(rep_gu, rep_down)
        acc_gu, acc_down = torch.zeros_like(rep_gu), torch.zeros_like(rep_down)
        for m, w in zip(members[1:], weights[1:]):
            if w == 0:
                continue
            m_gu, m_down = permute(gate_up[m].float(), down[m].float(), align(ref, neurons(gate_up[m].float(),
                                                                                            down[m].float())))
            acc_gu += w * (m_gu - rep_gu)
            acc_down += w * (m_down - rep_down)
        merged_gate_up[j] = rep_gu + acc_gu
        merged_down[j] = rep_down + acc_down
        record.append({"kept": members[0], "members": members, "weights": [round(w, 6) for w in weights]})
    return record


def merge_into(original: torch.nn.Module, proxy: torch.nn.Module, sel: Selection, gate_mass: torch.Tensor,
               targets: Targets) -> tuple[list, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """merge_block, then the merged experts rounded as they will be stored (dtype, FP8) and set
    back into `proxy`: (record, {checkpoint tensor: stored}, {parameter: value read back})."""
    record = merge_block(original, proxy, sel, gate_mass)
    stored, back = targets.store(experts_only=True)
    params = dict(proxy.named_parameters())
    with torch.no_grad():
        for name, value in back.items():
            params[name].copy_(value)
    return record, stored, back


@dataclass
class MergedExperts:
    """What merging wrote, per MoE block it merged (in layer order)."""

    tensors: dict[str, Callable[[], bytes]] = field(default_factory=dict)  # checkpoint tensor -> its bytes (spilled)
    records: dict[str, list] = field(default_factory=dict)  # block prefix -> its manifest record's `merge`


class MergePass(LayerPass[MergedExperts]):
    """Each MoE layer with statistics: its clusters merged into the kept experts, rounded as
    stored and spilled. No hidden states: only these layers are loaded."""

    desc = "merging experts"

    def __init__(self, proxy_config, arch, selections: dict[str, Selection], calibration):
        self.proxy_config, self.arch, self.selections, self.calibration = proxy_config, arch, selections, calibration
        self.spill = Spill()
        self.merged = MergedExperts()

    def visits(self, block: MoeBlock) -> bool:
        return block.prefix in self.calibration.layers

    def visit(self, layer: Layer) -> str:
        block, original = layer.block, layer.moe.block
        sel = self.selections[block.prefix]
        proxy = proxy_block(original, self.proxy_config, sel.kept)
        targets = Targets(proxy, block, self.arch, sel.kept, option="--merge")
        record, stored, _ = merge_into(original, proxy, sel, self.calibration.layers[block.prefix].gate_mass, targets)
        for name, value in stored.items():
            self.merged.tensors[name] = self.spill.put(value)
        self.merged.records[block.prefix] = record
        msg = (f"{block.prefix}: merged {sum(len(r['members']) for r in record)} experts into {len(record)}, "
               f"{time.monotonic() - layer.started:.1f} s")
        log.info(msg)
        return msg

    def result(self) -> MergedExperts:
        return self.merged


def merge_pass(ckpt: Checkpoint, layout: Layout, plan, calibration) -> MergePass:
    """The pass that merges `plan`'s calibrated MoE layers (it walks without tokens)."""
    proxy_config = transformers_config(rewrite_config(ckpt.config, plan))
    return MergePass(proxy_config, layout.arch, plan.selections, calibration)


def merge_record(plan, merged: list[str]) -> tuple[dict, list[str]]:
    """The manifest's `merge` (how kept experts were made, which blocks were not merged) and
    the plan's note naming the blocks not merged."""
    skipped = sorted(set(plan.selections) - set(merged))
    notes = [f"--merge: {', '.join(skipped)} have no calibration statistics (e.g. an MTP layer): "
             f"their kept experts are copied, not merged"] if skipped else []
    return {"weights": "each member's share of its cluster's gate mass on the calibration tokens",
            "alignment": "members' intermediate neurons permuted to the representative's by maximum total inner "
                         "product of (gate row, up row, down column) (linear assignment)",
            "formula": "representative + sum of weight x (aligned member - representative)",
            "layers": merged, "not_merged": skipped}, notes
