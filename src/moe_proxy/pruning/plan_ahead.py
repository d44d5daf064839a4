"""Selecting experts while the shards stream (issue 31, item 2).

Which tensors an output shard holds, their order and their sizes depend on how many experts
are kept, not on which (every expert of a block has the same tensors and shapes; kept experts
are renumbered 0..k-1), so the split over workers and the first shards' bytes need no
selection: a shard without routed experts (embeddings, dense layers) is written at once, and
a shard with MoE layers waits only for its own layers. `PlanAhead` selects on one thread, in
the order the worker's shards are written, while the writer streams; a scale-out worker
selects only the layers of its own shards, plus the first MoE layer, which every worker
selects so that finalize can compare the workers' choices (shares.workers_plan).

Only for plans made layer by layer from the checkpoint alone. Calibration statistics (notes
and records over all layers), --pin (checked against all layers before anything is written)
and fitted tensors (--heal, --merge, --reconstruct: fitted over the whole plan) plan first,
as before: see `applies`.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

from tqdm.auto import tqdm

from moe_proxy.pruning.expert_plan import ExpertPlan, plan_experts, proxy_counts
from moe_proxy.pruning.selection import Selection
from moe_proxy.checkpoint.layout import Layout, MoeBlock
from moe_proxy.checkpoint.reader import Checkpoint
from moe_proxy.options import PruningOptions


def applies(options: PruningOptions, calibration, layout: Layout) -> bool:
    """Can this build's experts be selected layer by layer while it writes? Also not where a
    source shard holds some of a block's experts but not all (DeepSeek-V3's own checkpoint
    splits a layer's experts over shards): there, which experts are kept decides how many
    bytes, or whether anything, each output shard gets."""
    return calibration is None and not options.pins and not options.fits and all(
        _whole_blocks_per_file(b) for b in layout.blocks)


def _whole_blocks_per_file(block: MoeBlock) -> bool:
    files: dict[str, set[int]] = {}
    for e, rests in block.per_expert.items():
        for t in rests.values():
            files.setdefault(t.file, set()).add(e)
    return all(len(experts) == len(block.per_expert) for experts in files.values())


def stand_in(ckpt: Checkpoint, layout: Layout, options: PruningOptions, sizing=None) -> ExpertPlan:
    """The proxy's counts (checked, as the real plan checks them) with a stand-in selection:
    the first experts of every routing group. Its shards have the names, order and sizes of
    any selection's, so the split over workers, the same for every worker and finalize, is
    taken from it."""
    plan = proxy_counts(layout.arch, ckpt.config, options, sizing)
    per_group, group = plan.experts_after // plan.n_group, plan.experts_before // plan.n_group
    kept = [g * group + i for g in range(plan.n_group) for i in range(per_group)]
    return replace(plan, selections={b.prefix: Selection(kept, [], []) for b in layout.blocks})


class PlanAhead:
    """Selects `order`'s blocks on a thread, one after the other; `selection` waits for one
    block (selecting one not in `order` on the same thread, after those), `plan` for several."""

    def __init__(self, ckpt: Checkpoint, layout: Layout, options: PruningOptions, order: list[MoeBlock],
                 sizing=None, progress: bool = False):
        self.ckpt, self.layout, self.options, self.sizing = ckpt, layout, options, sizing
        order = list({b.prefix: b for b in order}.values())
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="select")
        self._lock = threading.Lock()
        self._bar = tqdm(total=len(order), desc="selecting experts", unit="layer", disable=not progress)
        # Counts and the notes of the whole plan (no layer's selection adds any here, see applies).
        self._base = self._pool.submit(plan_experts, ckpt, replace(layout, blocks=[]), options, sizing=sizing)
        self._selected: dict[str, Future] = {}
        for block in order:
            self._submit(block)

    def _submit(self, block: MoeBlock) -> Future:
        with self._lock:
            if block.prefix not in self._selected:
                self._selected[block.prefix] = self._pool.submit(self._select, block)
            return self._selected[block.prefix]

    def _select(self, block: MoeBlock) -> tuple[Selection, list[str]]:
        one = plan_experts(self.ckpt, replace(self.layout, blocks=[block]), self.options, sizing=self.sizing)
        self._bar.update()
        return one.selections[block.prefix], one.notes

    def selection(self, block: MoeBlock) -> Selection:
        return self._submit(block).result()[0]

    def done(self, prefixes: list[str]) -> bool:
        """Are these blocks selected already (without waiting)?"""
        return all(p in self._selected and self._selected[p].done() for p in prefixes)

    def selections(self, blocks: list[MoeBlock]) -> dict[str, Selection]:
        """The selections of `blocks`, once they are made (not waiting for the plan's notes)."""
        return {b.prefix: self.selection(b) for b in blocks}

    def plan(self, blocks: list[MoeBlock]) -> ExpertPlan:
        """The plan with `blocks` selected (in layout order), once they are."""
        base = self._base.result()
        chosen = {b.prefix: self._submit(b).result() for b in blocks}
        notes = list(base.notes)
        notes += [n for _, more in chosen.values() for n in more if n not in notes]
        return replace(base, notes=notes, selections={b.prefix: chosen[b.prefix][0]
                                                      for b in self.layout.blocks if b.prefix in chosen})

    def close(self) -> None:
        """Stop selecting (what is queued is dropped; a selection running ends first)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._bar.close()
