"""Build a proxy checkpoint: read -> plan -> write.

1. Open the source (config, index, safetensors headers; no tensor data yet).
2. ExpertPlan (expert_plan.py): per MoE block, the experts to keep. Where a block's selection
   needs only its own router (no statistics, pins or fitted tensors), it is made on a thread
   while step 3 writes, each shard waiting only for its own blocks (plan_ahead.py).
3. Write, shard by shard in the source's sharding: backbone tensors byte for byte, router rows
   and expert tensors of kept experts only, in their source dtype. Dropped experts' bytes are
   never read. Reads run ahead across the worker's shards while earlier bytes are written
   (reads.py), as many requests in flight as the store needs and never more bytes than one
   budget shared with the uploads (storage/inflight.py).
4. Finalize: config.json, the index, tokenizer/other files, and `proxy-manifest.json` last:
   its presence marks the proxy complete.

Scale-out: `build_share(worker=i, workers=W)` writes only worker i's share of the shards (a
deterministic partition balanced by bytes, which the expert count fixes) and a journal of its
plan (selecting ahead: its own blocks' and the first MoE block's) and of what it wrote;
`finalize_build` (run once after all workers) joins the plan from the journals (refusing workers
that selected differently),
checks every worker's shards against them and does step 4. A single
build is worker 0 of 1 followed by finalize, so W workers give byte-identical output.
An interrupted worker reruns and keeps the files its journal shows complete (sha256 checked).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from itertools import chain, islice
from typing import Callable

from tqdm.auto import tqdm

from moe_proxy import __version__
from moe_proxy.architectures import detect
from moe_proxy.checkpoint.reader import (INDEX, JOURNAL, MANIFEST, Checkpoint, TensorInfo, check_finished,
                                         open_checkpoint, read_header, slice_ranges)
from moe_proxy.errors import CorruptCheckpoint, DestinationExists, MoeProxyError
from moe_proxy.checkpoint.layout import Layout, MoeBlock, find_layout, source_identity
from moe_proxy.pruning.config import rewrite_config
from moe_proxy.checkpoint.reads import Later, read_ahead, read_tasks
from moe_proxy.checkpoint.params import stored_params
from moe_proxy.options import PruningOptions
from moe_proxy.pruning.expert_plan import ExpertPlan, plan_experts, plan_from_record, plan_record
from moe_proxy.pruning import plan_ahead
from moe_proxy.pruning.plan_ahead import PlanAhead
from moe_proxy.pruning.writer import OutTensor, Written, header_bytes, shard_size, write_file
from moe_proxy.storage import Store, Writer, open_store, overlap, sha256_of, write_bytes
from moe_proxy.storage.inflight import Transfer

log = logging.getLogger(__name__)


@dataclass
class Prepared:
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
        which every worker selects so that finalize can compare their choices (workers_plan).
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


def output_tensors(ckpt: Checkpoint, layout: Layout, plan: ExpertPlan,
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


def assign_shards(shards: dict[str, list[OutTensor]], workers: int) -> list[list[str]]:
    """Deterministic partition of output shards over workers, balanced by bytes: largest first to
    the least loaded, then single moves and swaps off the most loaded worker while they lower it.
    (Largest-first alone can leave two workers a whole shard above the rest, e.g. the two shards
    that hold the embeddings among many equal layer shards: 1.15 x the mean at 4 workers for the
    8 GB benchmark checkpoint, 1.03 after the moves.)"""
    size = {f: shard_size(ts) for f, ts in shards.items()}
    loads, share = [0] * workers, [[] for _ in range(workers)]
    for f in sorted(shards, key=lambda f: (-size[f], f)):
        i = loads.index(min(loads))
        share[i].append(f)
        loads[i] += size[f]
    while (move := _best_move(share, loads, size)) is not None:
        top, i, a, b = move  # shard a from the most loaded worker to worker i (and b back, if any)
        share[top].remove(a)
        share[i].append(a)
        if b is not None:
            share[i].remove(b)
            share[top].append(b)
        d = size[a] - (size[b] if b is not None else 0)
        loads[top] -= d
        loads[i] += d
    order = {f: n for n, f in enumerate(shards)}
    return [sorted(s, key=order.get) for s in share]


def _best_move(share: list[list[str]], loads: list[int], size: dict[str, int]):
    """A move (or swap) of one shard off the most loaded worker that leaves both workers below
    its load; None when there is none. Each one lowers the sum of squared loads, so it ends."""
    top = loads.index(max(loads))
    for i in sorted(range(len(loads)), key=lambda i: (loads[i], i)):
        gap = loads[top] - loads[i]
        best = max(((a, b) for a in sorted(share[top]) for b in [None, *sorted(share[i])]
                    if 0 < size[a] - (size[b] if b is not None else 0) < gap),
                   key=lambda ab: min(size[ab[0]] - (size[ab[1]] if ab[1] is not None else 0),
                                      gap - size[ab[0]] + (size[ab[1]] if ab[1] is not None else 0)), default=None)
        if best is not None:
            return top, i, *best
    return None


def journal_name(worker: int, workers: int) -> str:
    return f"{JOURNAL}-{worker}-of-{workers}.json"


def _as_json(obj):
    return json.loads(json.dumps(obj))


def workers_plan(dst: Store, build_id: str, workers: int) -> dict:
    """The plan of this build, joined from the W workers' journals: refused unless all W are
    there, complete, of this very build, and agree: the same counts and notes, and each block
    that several workers selected (every one selects the first MoE block) selected alike
    (workers that selected differently, e.g. other library versions in their images, wrote
    shards that do not form one proxy)."""
    joined: dict | None = None
    by: dict[str, int] = {}  # block -> the first worker that selected it
    for worker in range(workers):
        name = journal_name(worker, workers)
        if not dst.exists(name):
            raise CorruptCheckpoint(f"worker {worker} of {workers} has not finished: no {name} in {dst.uri}")
        try:
            j = json.loads(dst.read_bytes(name))
        except ValueError:
            raise CorruptCheckpoint(f"worker {worker}'s journal {name} is not JSON; rerun worker {worker}") from None
        if j.get("build_id") != build_id:
            raise CorruptCheckpoint(f"worker {worker}'s journal {name} is of another build (source, options or "
                                    f"moe-proxy version differ); rerun worker {worker} with this build's options")
        if not j.get("complete"):
            raise CorruptCheckpoint(f"worker {worker} of {workers} has not finished: its journal {name} is of an "
                                    f"interrupted run; rerun worker {worker}")
        if not isinstance(j.get("plan"), dict):
            raise CorruptCheckpoint(f"worker {worker}'s journal {name} holds no plan; rerun worker {worker}")
        record = j["plan"]
        joined = joined or {**record, "selections": {}}
        shared = {b for b in record["selections"] if b in by}
        if (_without_selections(record) != _without_selections(joined)
                or any(record["selections"][b] != joined["selections"][b] for b in shared)):
            raise CorruptCheckpoint(f"worker {worker} selected other experts than worker "
                                    f"{min((by[b] for b in shared), default=0)} "
                                    f"({_plan_difference(joined, record, shared)}): their shards do not form one "
                                    f"proxy; rerun every worker with the same moe-proxy")
        for b, s in record["selections"].items():
            by.setdefault(b, worker)
            joined["selections"].setdefault(b, s)
    return joined


def _plan_difference(a: dict, b: dict, blocks: set[str] | None = None) -> str:
    """The first difference of two plan records (of `blocks` only, where given)."""
    for prefix in sorted(blocks if blocks is not None else set(a.get("selections", {})) | set(b.get("selections", {}))):
        sa, sb = a.get("selections", {}).get(prefix), b.get("selections", {}).get(prefix)
        if sa != sb:
            return f"{prefix}: kept {(sa or {}).get('kept')} vs {(sb or {}).get('kept')}"
    keys = (set(a) | set(b)) - {"selections"}
    return ", ".join(f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in sorted(keys) if a.get(k) != b.get(k))


def _journals(dst: Store) -> list[str]:
    return [n for n in dst.list() if n.startswith(JOURNAL)]


REPLACED = f"{JOURNAL}-replaced.json"  # the files of the proxy this build replaces (--overwrite)


def check_apart(src: str, dst: str) -> None:
    """Refuse a destination that is, contains or lies inside the source, however spelled
    (real paths, symlinks followed; normalised s3:// bucket and prefix): writing there could
    overwrite or delete the source's own files."""
    how = overlap(dst, src)
    if how == "same":
        raise DestinationExists(f"destination {dst} is the source checkpoint itself; choose another directory")
    if how is not None:
        where = "lies inside" if how == "inside" else "contains"
        raise DestinationExists(f"destination {dst} {where} the source checkpoint {src}; a proxy must never be "
                                f"written into or around its source: choose a directory apart from it")


def _owned(dst: Store) -> set[str]:
    """The files earlier moe-proxy builds wrote into dst, as their journals (and the record of a
    replaced proxy) list them: the only files a build may ever delete there."""
    owned = set()
    for name in _journals(dst):
        if name.endswith(".safetensors"):  # fitted tensors (fits_name), not a list of files
            continue
        try:
            j = json.loads(dst.read_bytes(name))
        except ValueError:
            continue
        owned |= set(j.get("files", {})) | set(j.get("replaces", []))
    return owned


def _proxy_manifest(dst: Store) -> Published | None:
    """dst's proxy-manifest.json when it is one moe-proxy wrote; None for anything else."""
    data = dst.read_bytes(MANIFEST)
    try:
        m = json.loads(data)
    except ValueError:
        return None
    if not isinstance(m, dict) or not str(m.get("format", "")).startswith("moe-proxy/"):
        return None
    published = Published(m)
    published.sha256 = hashlib.sha256(data).hexdigest()
    return published


def _check_destination(dst: Store, build_id: str, overwrite: bool) -> tuple[Published | None, list[str]]:
    """(the existing manifest when dst already holds this very proxy, else None; the files of
    the proxy this build replaces). dst must be empty, or a moe-proxy output: a finished proxy
    (replaced only with `overwrite`) or an interrupted build (resumed). Anything else is refused
    whatever the flags: --overwrite never deletes a file moe-proxy did not write."""
    names = dst.list()
    if not names:
        return None, []
    manifest = _proxy_manifest(dst) if MANIFEST in names else None
    if manifest is None and not _journals(dst):
        some = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise DestinationExists(f"{dst.uri} is not empty and is not a moe-proxy output (it holds {some}); "
                                f"choose a new or empty directory: nothing there is ever deleted, --overwrite "
                                f"replaces only an earlier proxy")
    if manifest is None:  # an interrupted build: resumed, or (another build's) replaced by this one
        return None, []
    if manifest.get("build_id") == build_id and all(dst.exists(f) for f in manifest.get("files", {})):
        return manifest, []
    if not overwrite:
        raise DestinationExists(
            f"{dst.uri} already holds a different proxy (of {manifest.get('source', {}).get('uri')}, "
            f"method {manifest.get('method')}); pass --overwrite to replace it"
        )
    return None, [MANIFEST, *manifest.get("files", {})]


def fits_name(build_id: str) -> str:
    """Where a build's fitted tensors live in its destination until it is published (a journal:
    hidden, marks the build unfinished, deleted with the journals)."""
    return f"{JOURNAL}-fits-{build_id[:16]}.safetensors"


def save_fits(dst: Store, build_id: str, plan: ExpertPlan) -> None:
    """The plan's fitted tensors as one safetensors file (each tensor's bytes as stored, U8), its
    plan record and build id in the metadata. Streamed: one fitted tensor in memory at a time."""
    tensors = [OutTensor(n, "U8", (len(read()),), read) for n, read in sorted(plan.fitted.items())]
    metadata = {"format": "moe-proxy-fits", "build_id": build_id, "plan": json.dumps(_as_json(plan_record(plan)))}
    write_file(dst, fits_name(build_id), chain([header_bytes(tensors, metadata)], (t.source() for t in tensors)))


def load_fits(dst: Store, build_id: str, layout: Layout) -> ExpertPlan | None:
    """The plan save_fits wrote for this very build, its fitted tensors read from dst when the
    shards are written; None when there is none (or another build's)."""
    name = fits_name(build_id)
    if not dst.exists(name):
        return None
    tensors, metadata = read_header(dst, name, dst.size(name))
    if metadata.get("format") != "moe-proxy-fits" or metadata.get("build_id") != build_id:
        return None
    plan = plan_from_record(json.loads(metadata["plan"]), layout)
    return replace(plan, fitted={tensor: partial(dst.read_range, name, t.start, t.nbytes)
                                 for tensor, t in tensors.items()})


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


def _import_planning() -> None:
    import moe_proxy.pruning.features  # noqa: F401  (torch)
    import moe_proxy.pruning.selection  # noqa: F401

    import sklearn.cluster  # noqa: F401


def prepare(src: str | Store | OpenedSource, dst: str | Store, options: PruningOptions, overwrite: bool,
            progress: bool, store_options: dict | None, finalize_workers: int | None = None,
            planned: ExpertPlan | None = None, share_fits: bool = False, sizing=None) -> Prepared | Published:
    """Open, check the destination, plan. Returns the published manifest if dst holds this
    very build already (nothing to do).
    `finalize_workers`: finalizing W workers' build, whose journals hold the plan: it is taken
    from them (checked against this checkpoint), not worked out again; with fitted tensors
    (--heal, --reconstruct), which the journals do not hold, it is re-planned and must match.
    `planned`: the plan --experts auto chose (and measured, and fitted), used as it is.
    Fitted tensors (heal, reconstruct, merge) are made once per build: `share_fits` (a step of a
    scale-out build) writes them beside the journals, and any later step of the same build reads
    them instead of fitting again (save_fits, load_fits). `sizing` (a sizing.SizingOptions): the
    device budget a keep ratio's count is judged against, as `moe-proxy plan` does."""
    check_apart(src if isinstance(src, str) else src.uri, dst if isinstance(dst, str) else dst.uri)
    store_options = with_transfer(store_options)
    transfer = store_options["transfer"]
    if planned is None and (not finalize_workers or options.fits):  # it may select:
        # load torch and scikit-learn (seconds of CPU) while the headers and routers come down.
        threading.Thread(target=_import_planning, name="import", daemon=True).start()
    source = src if isinstance(src, OpenedSource) else open_source(src, options, store_options)
    ckpt, layout, identity, calibration = source.ckpt, source.layout, source.identity, source.calibration
    transfer.sized(max(b.expert_bytes for b in layout.blocks))
    dst_store = open_store(dst, **(store_options or {})) if isinstance(dst, str) else dst
    build_id = hashlib.sha256(json.dumps([identity, asdict(options), __version__]
                                         + ([calibration.summary["tokens"]["sha256"]] if calibration else [])
                                         + ([calibration.summary["made_for"]] if calibration
                                            and calibration.mode != "one-pass" else [])
                                         # a keep ratio's count depends on the device budget
                                         + ([asdict(sizing)] if sizing and options.keep_ratio is not None else []),
                                         sort_keys=True).encode()).hexdigest()
    existing, replaced = _check_destination(dst_store, build_id, overwrite)
    if existing is not None:
        log.info("%s already holds this proxy (same source and options): nothing to do", dst_store.uri)
        existing.up_to_date = True
        return existing
    journaled = workers_plan(dst_store, build_id, finalize_workers) if finalize_workers else None
    fitted = options.fits
    if planned is not None:
        plan = planned
    elif fitted and (plan := load_fits(dst_store, build_id, layout)) is not None:  # fitted once, by another step
        log.info("fitted tensors of this build read from %s/%s: nothing fitted again", dst_store.uri,
                 fits_name(build_id))
    elif journaled is not None and not fitted:
        plan = plan_from_record(journaled, layout)
    elif plan_ahead.applies(options, calibration, layout):  # selected while the shards stream
        plan = None
    else:
        plan = plan_experts(ckpt, layout, options, progress, calibration=calibration, sizing=sizing)
        if fitted and share_fits:  # the other workers and finalize read these instead of fitting again
            save_fits(dst_store, build_id, plan)
    if journaled is not None and (mine := _as_json(plan_record(plan))) != journaled:
        raise CorruptCheckpoint(f"the workers selected other experts than finalize does "
                                f"({_plan_difference(journaled, mine)}); rerun every worker with the same moe-proxy")
    for note in plan.notes if plan is not None else []:  # (selected ahead: said once selected, write_share)
        log.warning(note)
    if replaced:  # recorded before the manifest goes, so that finalize (maybe another process) knows them
        write_bytes(dst_store, REPLACED, json.dumps({"build_id": build_id, "replaces": replaced}).encode())
    # Unpublish: from here until finalize writes the manifest, dst is visibly incomplete.
    dst_store.delete(MANIFEST)
    # The split over workers takes the shards' sizes, which the counts fix where selecting ahead applies:
    # the same for every worker, before it selects, and for finalize.
    split = plan_ahead.stand_in(ckpt, layout, options, sizing) if plan_ahead.applies(options, calibration, layout) \
        else plan
    return Prepared(ckpt, layout, dst_store, options, identity, build_id, plan, output_tensors(ckpt, layout, split),
                    calibration, transfer, progress, sizing, split if plan is None else None)


def write_share(p: Prepared, worker: int, workers: int, progress: bool = False) -> dict[str, Written]:
    """Write worker `worker`'s shards, resuming from its journal. Where experts are selected
    ahead (plan_ahead.py), this worker's blocks are selected while its shards stream, each
    shard waiting only for its own; its journal holds the selections of the shards written so
    far, and the whole share's once the last is (marked complete: what finalize takes)."""
    if not 0 <= worker < workers:
        raise MoeProxyError(f"--worker must be in 0..{workers - 1} for --workers {workers}, got {worker}")
    mine = assign_shards(p.layout_shards, workers)[worker]
    name = journal_name(worker, workers)
    p.select_ahead(mine)
    journal = _read_journal(p.dst, name, p.build_id, lambda: _as_json(plan_record(p.plan_of(mine))))
    if not p.dst.exists(name):  # before any shard: workers that start later see a build here, not strangers' files
        write_journal(p.dst, name, p.build_id, None, {})
    total = sum(shard_size(p.layout_shards[f]) for f in mine)
    written: dict[str, Written] = {}
    transfer = p.transfer or Transfer().sized(max(b.expert_bytes for b in p.layout.blocks))
    with tqdm(total=total, desc=f"writing proxy ({worker + 1}/{workers})" if workers > 1 else "writing proxy",
              unit="B", unit_scale=True, disable=not progress) as bar:
        todo = []
        for f in mine:
            done = journal.get(f)
            if done and _matches(p.dst, f, done):
                log.info("%s: already complete from an interrupted run (checksum matches), kept", f)
                written[f] = Written(f, done["size"], done["sha256"])
                bar.update(done["size"])
            else:
                todo.append(f)

        # One read-ahead over the whole share: the next shard's reads stay in flight while this
        # one's last parts, commit and journal go up, so downloading never drains between shards.
        # Uploads overlap by one shard: shard i's last parts, commit and journal entry go up on
        # the commit thread while shard i+1's first parts do. Commits stay in shard order and
        # shard i+1 is committed only after shard i is journaled, so a killed worker leaves at
        # most two unfinished uploads (invisible: a multipart upload or a temporary file until
        # its commit) and its journal names only shards that are complete.
        tasks: dict[str, list] = {}

        def tasks_of(f: str) -> list:  # (a shard's tasks once its blocks are selected)
            if f not in tasks:
                tasks[f] = read_tasks(p.ckpt.store, f, p.shard(f), transfer.read_part)
            return tasks[f]

        pending: list[Future] = []

        def commit_behind(w: Writer, done: Written) -> None:
            if pending:  # the shard before: committed and journaled before this one is
                try:
                    pending.pop().result()
                except BaseException:
                    w.abort()
                    raise
            pending.append(committer.submit(commit_and_journal, w, done))

        def commit_and_journal(w: Writer, done: Written) -> None:
            w.commit()
            journal[done.name] = {"size": done.size, "sha256": done.sha256, "checksum": p.dst.checksum(done.name)}
            # the selections of every shard written so far: all made, nothing waited for
            so_far = [f for f in mine if f in journal]
            write_journal(p.dst, name, p.build_id, _as_json(plan_record(p.plan_of(so_far, first=False))), journal)

        with (ThreadPoolExecutor(transfer.streams, thread_name_prefix="read") as pool,
              ThreadPoolExecutor(1, thread_name_prefix="commit") as committer):
            # (a shard whose blocks are still being selected: reads stop running ahead there)
            shards = (Later(partial(p.ready, f), partial(tasks_of, f)) for f in todo)
            data = read_ahead(shards, pool, transfer.streams, transfer.budget)
            try:
                for f in todo:
                    tensors = p.shard(f)
                    pieces = chain([header_bytes(tensors)], islice(data, len(tasks_of(f))))
                    written[f] = write_file(p.dst, f, pieces, bar.update, shard_size(tensors), commit_behind)
                if pending:
                    pending.pop().result()
            finally:
                data.close()  # frees what is read ahead if writing stopped
    plan = p.plan_of(mine)  # (an idle worker still selects the first block: finalize compares it)
    if p.planned is None:
        for note in plan.notes:
            log.warning(note)
    # Complete: the share's selections; an idle worker still leaves its journal, so finalize knows it ran.
    write_journal(p.dst, name, p.build_id, _as_json(plan_record(plan)), journal, complete=True)
    return written


def write_journal(dst: Store, name: str, build_id: str, plan: dict | None, files: dict, complete: bool = False) -> None:
    write_bytes(dst, name, json.dumps({"build_id": build_id, "plan": plan, "files": files}
                                      | ({"complete": True} if complete else {})).encode())


def _matches(dst: Store, name: str, rec: dict) -> bool:
    """Is dst's `name` the file a journal recorded? An object store's own checksum, recorded
    when the file was written, is compared without downloading it; local files are re-hashed."""
    if not dst.exists(name) or dst.size(name) != rec["size"]:
        return False
    if rec.get("checksum"):
        return dst.checksum(name) == rec["checksum"]
    return sha256_of(dst, name) == rec["sha256"]


def _read_journal(dst: Store, name: str, build_id: str, plan: Callable[[], dict] | None = None) -> dict:
    """Files already written by an interrupted attempt of this same build (and, given, of a
    plan that agrees with `plan()`, asked for only where there are such files)."""
    if not dst.exists(name):
        return {}
    try:
        j = json.loads(dst.read_bytes(name))
    except ValueError:
        return {}
    if j.get("build_id") != build_id or not j.get("files"):
        return {}
    return j["files"] if plan is None or _agrees(j.get("plan"), plan()) else {}


def _agrees(theirs: dict | None, mine: dict) -> bool:
    """Does a journal's plan (maybe of the shards written so far only) agree with `mine`: the
    same counts and notes, and each block it selected selected alike?"""
    if not isinstance(theirs, dict) or not isinstance(theirs.get("selections"), dict):
        return False
    return _without_selections(theirs) == _without_selections(mine) and all(
        mine["selections"].get(b) == s for b, s in theirs["selections"].items())


def _without_selections(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "selections"}


def finalize(p: Prepared, workers: int, overwrite: bool = False, fresh: dict[str, Written] | None = None,
             progress: bool = False) -> dict:
    """Check every worker's shards, then write config, index, other files and the manifest.
    `fresh`: shards this very process has just written (a single build), not checked again.
    `progress`: a bar over the fidelity figure's layers, when there is one to measure."""
    written: dict[str, Written] = dict(fresh or {})
    for worker, files in enumerate(assign_shards(p.layout_shards, workers) if fresh is None else []):
        name = journal_name(worker, workers)
        if not p.dst.exists(name):
            raise CorruptCheckpoint(f"worker {worker} of {workers} has not finished: no {name} in {p.dst.uri}")
        journal = _read_journal(p.dst, name, p.build_id)
        for f in files:
            rec = journal.get(f)
            if rec is None or not p.dst.exists(f):
                raise CorruptCheckpoint(f"worker {worker}'s shard {f} is missing from {p.dst.uri}; rerun worker {worker}")
            if rec["size"] != shard_size(p.shards[f]):
                raise CorruptCheckpoint(f"worker {worker}'s shard {f} has {rec['size']} bytes where the plan gives "
                                        f"{shard_size(p.shards[f])}; rerun worker {worker}")
            if not _matches(p.dst, f, rec):
                raise CorruptCheckpoint(f"worker {worker}'s shard {f} is corrupt (size or sha256 differs from "
                                        f"its journal); rerun worker {worker}")
            written[f] = Written(f, rec["size"], rec["sha256"])

    ckpt, plan = p.ckpt, p.plan
    if p.calibration is not None and plan.fidelity is None:  # the figure, before anything is published
        from moe_proxy.pruning.fidelity import measure

        plan.fidelity = measure(ckpt, p.layout, plan, p.calibration, p.shards, progress)
    written["config.json"] = write_file(p.dst, "config.json", [_json(rewrite_config(ckpt.config, plan))])
    if ckpt.store.exists(INDEX):
        weight_map = {t.name: f for f, ts in p.shards.items() for t in ts}
        metadata = {k: v for k, v in ckpt.index_metadata.items() if k != "total_parameters"}
        metadata["total_size"] = sum(t.nbytes for ts in p.shards.values() for t in ts)
        index = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
        written[INDEX] = write_file(p.dst, INDEX, [_json(index)])
    for name in ckpt.other_files():
        written[name] = write_file(p.dst, name, [ckpt.store.read_bytes(name)])
    if overwrite:  # leftovers of the proxy this one replaces: only files a moe-proxy build wrote
        for name in sorted(_owned(p.dst) - set(written) - {MANIFEST}):
            p.dst.delete(name)

    if n := p.dst.discard_incomplete():  # all workers are done: nothing is being written
        log.info("%s: discarded %d unfinished write(s) of interrupted attempts", p.dst.uri, n)
    manifest = Published(make_manifest(p, written))
    manifest.sha256 = write_file(p.dst, MANIFEST, [_json(manifest)]).sha256  # of exactly the bytes published
    for name in _journals(p.dst):
        p.dst.delete(name)
    return manifest


@dataclass(frozen=True)
class Share:
    """What one worker of a scale-out build wrote (build_share): its output shards, by name."""

    worker: int
    workers: int
    files: dict[str, Written]  # empty when dst already holds the published proxy
    up_to_date: bool = False


class Published(dict):
    """A manifest as published: the dict, `sha256`, that of the proxy-manifest.json bytes, and
    `up_to_date`, whether dst held this very proxy already (the build was a no-op)."""

    sha256: str = ""
    up_to_date: bool = False


# The four entry points. A single build is build_proxy. A scale-out build (a Kubernetes Indexed
# Job) is fit_for_workers once where it fits tensors, build_share per worker, then
# finalize_build once: they give the same bytes as the single build. `options` (or the same as
# keywords, `**pruning`: experts=8, calibration=...) is what to build, see options.PruningOptions;
# the other keywords are how (overwrite, progress bars, store options, the device budget
# `sizing`, a sizing.SizingOptions, that a keep ratio's count is judged against).


def build_proxy(src: str | Store, dst: str | Store, options: PruningOptions | None = None, *,
                overwrite: bool = False, progress: bool = False, store_options: dict | None = None,
                max_experts: int | None = None, sizing=None, **pruning) -> Published:
    """Build the proxy of checkpoint `src` into `dst` and return its manifest. Rerunning an
    identical build is a no-op that returns the existing manifest (`up_to_date`).
    `experts="auto"` with `max_kl`: the smallest count whose fidelity figure meets it, within
    `max_experts` and the device budget of `sizing`, see auto.py."""
    options = _resolved(src, dst, options, pruning)
    store_options, chosen = with_transfer(store_options), None
    if options.auto or options.max_kl is not None:  # counts measured without writing; the chosen one is built
        from moe_proxy.pruning.auto import resolve_auto

        src = open_source(src, options, store_options)  # once: the search and the build read the same
        options, chosen = resolve_auto(src, options, max_experts, sizing, progress)
    p = prepare(src, dst, options, overwrite, progress, store_options, None,
                chosen[2] if chosen is not None else None, sizing=sizing)
    if isinstance(p, Published):
        return p
    if chosen is not None:
        p.plan.fidelity = chosen[0]
        p.plan.notes.extend(n for n in chosen[1] if n not in p.plan.notes)
    try:
        return finalize(p, 1, overwrite, fresh=write_share(p, 0, 1, progress), progress=progress)
    finally:
        p.close()  # (selecting ahead: stops, where writing failed)


def fit_for_workers(src: str | Store, dst: str | Store, options: PruningOptions | None = None, *, workers: int,
                    overwrite: bool = False, progress: bool = False, store_options: dict | None = None,
                    sizing=None, **pruning) -> str | None:
    """The step before a scale-out's `workers` workers: select and fit once, for all of them
    and finalize, writing nothing but the fits (see prepare). Returns the name of the fits
    artifact in dst, None where the options fit nothing (or dst holds the proxy already)."""
    options = _resolved(src, dst, options, pruning, scale_out=True)
    p = prepare(src, dst, options, overwrite, progress, store_options, share_fits=True, sizing=sizing)
    if isinstance(p, Published):
        return None
    p.close()
    return fits_name(p.build_id) if options.fits else None


def build_share(src: str | Store, dst: str | Store, options: PruningOptions | None = None, *, worker: int,
                workers: int, overwrite: bool = False, progress: bool = False, store_options: dict | None = None,
                sizing=None, **pruning) -> Share:
    """Write worker `worker`'s shards of a `workers`-worker build (and its journal)."""
    options = _resolved(src, dst, options, pruning, scale_out=True)
    p = prepare(src, dst, options, overwrite, progress, store_options, share_fits=True, sizing=sizing)
    if isinstance(p, Published):
        return Share(worker, workers, {}, up_to_date=True)
    try:
        return Share(worker, workers, write_share(p, worker, workers, progress))
    finally:
        p.close()


def finalize_build(src: str | Store, dst: str | Store, options: PruningOptions | None = None, *, workers: int,
                   overwrite: bool = False, progress: bool = False, store_options: dict | None = None,
                   sizing=None, **pruning) -> Published:
    """After all `workers` workers: check their shards, write config, index and the manifest."""
    options = _resolved(src, dst, options, pruning, scale_out=True)
    p = prepare(src, dst, options, overwrite, progress, store_options, workers, share_fits=True, sizing=sizing)
    if isinstance(p, Published):
        return p
    try:
        return finalize(p, workers, overwrite, progress=progress)
    finally:
        p.close()


def _resolved(src: str | Store, dst: str | Store, options: PruningOptions | None, pruning: dict,
              scale_out: bool = False) -> PruningOptions:
    options = replace(options or PruningOptions(), **pruning).resolved()
    check_apart(src if isinstance(src, str) else src.uri, dst if isinstance(dst, str) else dst.uri)
    if options.auto or options.max_kl is not None:  # what auto cannot do, refused before anything is read
        from moe_proxy.pruning.auto import check_auto

        check_auto(options, scale_out)
    return options


def _json(obj) -> bytes:
    return (json.dumps(obj, indent=2) + "\n").encode()


def make_manifest(p: Prepared, written: dict[str, Written]) -> dict:
    ckpt, plan, options = p.ckpt, p.plan, p.options
    return {
        "format": "moe-proxy/v1",
        "tool_version": __version__,
        "build_id": p.build_id,
        "source": {"uri": ckpt.uri, "architecture": plan.arch.name,
                   "model_type": ckpt.config.get("model_type"), "identity": p.identity},
        "method": asdict(options) | {"pins": {str(k): v for k, v in options.pins.items()}},
        "experts": {"before": plan.experts_before, "after": plan.experts_after,
                    "top_k_before": plan.top_k_before, "top_k_after": plan.top_k_after,
                    "n_group": plan.n_group, "topk_group": plan.topk_group},
        "notes": plan.notes,
        **({"fidelity": plan.fidelity} if plan.fidelity else {}),
        **({"calibration": plan.calibration} if plan.calibration else {}),
        **({"reconstruct": plan.reconstruction} if plan.reconstruction else {}),
        **({"merge": plan.merge} if plan.merge else {}),
        "layers": {
            b.prefix: {"layer": b.layer, "kept": plan.selections[b.prefix].kept,
                       "cluster_sizes": plan.selections[b.prefix].cluster_sizes} | plan.selections[b.prefix].record
            for b in p.layout.blocks
        },
        "params": stored_params(ckpt, p.layout, plan.experts_after, plan.top_k_after),
        "bytes": {"before": sum(ckpt.file_sizes.values()),
                  "after": sum(w.size for f, w in written.items() if f in p.shards)},
        "files": {f: {"size": w.size, "sha256": w.sha256} for f, w in sorted(written.items())},
    }
