"""The proxy's tensors, laid out per output shard: the source's names and order, routers cut
to the kept experts' rows, fused expert tensors to their slices, per-expert tensors renamed to
the new expert ids (dropped experts' left out), fitted bytes where a pass fitted them, and every
other tensor whole. Each OutTensor says where its bytes come from; nothing is read here.

The build writes these shards; the fidelity figure and --experts auto measure them unwritten.
"""

from __future__ import annotations

from functools import partial
from itertools import chain
from typing import Callable, Protocol

from moe_proxy.checkpoint.layout import Layout
from moe_proxy.checkpoint.reader import Checkpoint, TensorInfo, slice_ranges
from moe_proxy.pruning.selection import Selection
from moe_proxy.pruning.writer import OutTensor


class KeptExperts(Protocol):
    """What output_tensors reads of a plan (an expert_plan.ExpertPlan, not imported: expert_plan
    lays its fitted plans out here to measure them)."""

    selections: dict[str, Selection]  # MoE block prefix -> its kept experts
    fitted: dict[str, Callable[[], bytes]]  # tensor -> its fitted bytes (--heal, --merge, --reconstruct)


def output_tensors(ckpt: Checkpoint, layout: Layout, plan: KeptExperts,
                   files: list[str] | None = None) -> dict[str, list[OutTensor]]:
    """The proxy's tensors, per output shard (same names and order as the source's); of `files`
    only, when given, where the plan may select only their blocks."""
    routers: dict[str, tuple[int, list[int]]] = {}  # router tensor -> (expert axis, kept)
    fused: dict[str, list[int]] = {}  # fused expert tensor -> kept (expert axis 0)
    renames: dict[str, str | None] = {}  # per-expert tensor -> new name, None = dropped
    unselected: set[str] = set()  # tensors of blocks the plan has not selected
    for b in layout.blocks:
        if b.prefix not in plan.selections:
            unselected.update(t.name for t in chain(b.expert_tensors(), (t for t, _ in b.router.values())))
            continue
        kept = plan.selections[b.prefix].kept
        for t, axis in b.router.values():
            routers[t.name] = (axis, kept)
        for t in b.fused.values():
            fused[t.name] = kept
        for e, rests in b.per_expert.items():
            for rest, t in rests.items():
                renames[t.name] = f"{b.prefix}.experts.{kept.index(e)}.{rest}" if e in kept else None

    def router_rows(t: TensorInfo, axis: int, kept: list[int]) -> Callable[[], bytes]:
        if (fitted := plan.fitted.get(t.name)) is not None:  # --heal, --reconstruct: re-fitted rows
            return fitted
        # Routers are small and fully read for planning anyway: one request, not one per kept row.
        return partial(ckpt.read_slices, t.name, axis, kept, gap=t.nbytes)

    def sliced(t: TensorInfo, axis: int, kept: list[int]) -> tuple[int, ...]:
        return t.shape[:axis] + (len(kept),) + t.shape[axis + 1 :]

    shards: dict[str, list[OutTensor]] = {}
    for f in ckpt.files if files is None else files:
        out = []
        for t in ckpt.in_file(f):
            if t.name in unselected:  # a bug, never a user error: it would be copied whole
                raise AssertionError(f"{t.name}: its MoE block has no selection in the plan")
            if t.name in routers:
                axis, kept = routers[t.name]
                out.append(OutTensor(t.name, t.dtype, sliced(t, axis, kept), router_rows(t, axis, kept)))
            elif t.name in fused:
                out.append(OutTensor(t.name, t.dtype, sliced(t, 0, fused[t.name]),
                                     plan.fitted.get(t.name) or slice_ranges(t, 0, fused[t.name])))
            elif t.name in renames:
                if renames[t.name] is not None:  # (--reconstruct: a kept expert's fitted tensor)
                    out.append(OutTensor(renames[t.name], t.dtype, t.shape,
                                         plan.fitted.get(t.name) or [(t.start, t.nbytes)]))
            else:
                out.append(OutTensor(t.name, t.dtype, t.shape, [(t.start, t.nbytes)]))
        if out:
            shards[f] = out
    return shards
