"""What a build's steps share: the opened source (OpenedSource: headers and routers read, its
identity and calibration statistics; --experts auto's search reads the same one) and the
prepared build (Prepared: the source, the checked destination, the plan or, where experts are
selected while the shards stream, its selection ahead, and the output shards as they are planned).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import chain

from moe_proxy.architectures import detect
from moe_proxy.checkpoint.layout import Layout, MoeBlock, find_layout, source_identity
from moe_proxy.checkpoint.reader import Checkpoint, check_finished, open_checkpoint
from moe_proxy.options import PruningOptions
from moe_proxy.pruning.expert_plan import ExpertPlan
from moe_proxy.pruning.output_shards import output_tensors
from moe_proxy.pruning.plan_ahead import PlanAhead
from moe_proxy.pruning.writer import OutTensor
from moe_proxy.storage import Store
from moe_proxy.storage.inflight import Transfer


@dataclass
class OpenedSource:
    """An opened source checkpoint (headers and routers read), as a build and --experts auto's
    search share it."""

    ckpt: Checkpoint
    layout: Layout
    identity: str
    calibration: object  # calibrate.statistics.Calibration of this very checkpoint, or None

    @property
    def uri(self) -> str:
        return self.ckpt.uri


def open_source(src: str | Store, options: PruningOptions, store_options: dict | None) -> OpenedSource:
    """The source checkpoint, its layout and identity, and its calibration statistics (checked
    to be of this very checkpoint) when the options name them."""
    ckpt = open_checkpoint(src, **(store_options or {}))
    check_finished(ckpt.store)
    layout = find_layout(ckpt, detect(ckpt.config))
    # Routers are read once, here: the identity, the features and the output rows use these bytes.
    ckpt.preload([t.name for b in layout.blocks for t, _ in b.router.values()])
    identity = source_identity(ckpt, layout)
    calibration = None
    if options.calibration:  # usage statistics: must be of this very checkpoint
        from moe_proxy.calibrate.statistics import load as load_calibration

        calibration = load_calibration(options.calibration, **(store_options or {}))
        calibration.check_source(identity, ckpt.uri)
    return OpenedSource(ckpt, layout, identity, calibration)


def with_transfer(store_options: dict | None) -> dict:
    """`store_options` with one transfer (streams, read part, in-flight byte budget) for the
    source's reads and the destination's uploads."""
    store_options = dict(store_options or {})
    store_options.setdefault("transfer", Transfer.from_options(store_options))
    return store_options


@dataclass
class Prepared:
    """A build once prepared (steps.prepare): what write_share and finalize work on."""

    ckpt: Checkpoint
    layout: Layout
    dst: Store
    options: PruningOptions
    identity: str
    build_id: str
    planned: ExpertPlan | None  # the whole plan, when made before writing; else selected ahead (plan_ahead.py)
    layout_shards: dict[str, list[OutTensor]]  # output shard -> tensors whose sizes give the split over workers
    calibration: object = None  # the loaded statistics (calibrate.statistics.Calibration), for the fidelity figure
    transfer: Transfer | None = None  # requests in flight and the byte budget of the write (storage/inflight.py)
    progress: bool = False
    sizing: object = None  # the device budget a keep ratio's count is judged against (sizing.SizingOptions)
    counts: ExpertPlan | None = None  # selecting ahead: the counts, with a stand-in selection (plan_ahead.stand_in)
    ahead: PlanAhead | None = None
    _shards: dict[str, list[OutTensor]] = field(default_factory=dict)
    _blocks_in: dict[str, dict[str, MoeBlock]] = field(default_factory=dict)  # source shard -> its MoE blocks

    def blocks_of(self, files: list[str]) -> list[MoeBlock]:
        """The MoE blocks with tensors in these source shards, in layout order."""
        if not self._blocks_in:
            for block in self.layout.blocks:
                for t in chain(block.expert_tensors(), (t for t, _ in block.router.values())):
                    self._blocks_in.setdefault(t.file, {})[block.prefix] = block
        chosen = {prefix for f in files for prefix in self._blocks_in.get(f, {})}
        return [b for b in self.layout.blocks if b.prefix in chosen]

    def select_ahead(self, files: list[str]) -> None:
        """Start selecting the blocks of `files` (in their order), then the first MoE block,
        which every worker selects so that finalize can compare their choices (shares.workers_plan).
        Nothing to do where the plan was made before writing."""
        if self.planned is None and self.ahead is None:
            blocks = {b.prefix: b for f in files for b in self.blocks_of([f])}
            self.ahead = PlanAhead(self.ckpt, self.layout, self.options, list(blocks.values()) + self.layout.blocks[:1],
                                   self.sizing, self.progress)

    def plan_of(self, files: list[str], first: bool = True) -> ExpertPlan:
        """The plan with (at least) the blocks of `files` selected, and the first MoE block
        with `first`; its notes are the whole plan's."""
        if self.planned is not None:
            return self.planned
        self.select_ahead(files)
        return self.ahead.plan(self.blocks_of(files) + (self.layout.blocks[:1] if first else []))

    def ready(self, f: str) -> bool:
        """Are shard f's blocks selected (without waiting)?"""
        return self.planned is not None or self.ahead is not None and self.ahead.done(
            [b.prefix for b in self.blocks_of([f])])

    @property
    def plan(self) -> ExpertPlan:
        """The whole plan (selecting every block first, where selection runs ahead)."""
        if self.planned is None:
            self.planned = self.plan_of(list(self.layout_shards))
            self.close()
        return self.planned

    def shard(self, f: str) -> list[OutTensor]:
        """Output shard f's tensors, once its blocks are selected (only theirs: a shard without
        routed experts waits for nothing)."""
        if self.counts is None:  # planned before writing
            if not self._shards:
                self._shards = output_tensors(self.ckpt, self.layout, self.planned)
            return self._shards[f]
        if f not in self._shards:
            self.select_ahead([f])
            blocks = self.blocks_of([f])
            plan = replace(self.counts, selections=self.ahead.selections(blocks))
            self._shards[f] = output_tensors(self.ckpt, replace(self.layout, blocks=blocks), plan, [f])[f]
        return self._shards[f]

    @property
    def shards(self) -> dict[str, list[OutTensor]]:
        return {f: self.shard(f) for f in self.layout_shards}

    def close(self) -> None:
        if self.ahead is not None:
            self.ahead.close()
