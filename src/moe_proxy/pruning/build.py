"""Build a proxy checkpoint: read -> plan -> write. The library's entry points, each running
the steps of steps.py (prepare, write_share, finalize):

1. Open the source (config, index, safetensors headers; no tensor data yet: prepared.py) and
   check the destination (destination.py).
2. ExpertPlan (expert_plan.py): per MoE block, the experts to keep. Where a block's selection
   needs only its own router (no statistics, pins or fitted tensors), it is made on a thread
   while step 3 writes, each shard waiting only for its own blocks (plan_ahead.py).
3. Write, shard by shard in the source's sharding (output_shards.py): backbone tensors byte for
   byte, router rows and expert tensors of kept experts only, in their source dtype. Dropped
   experts' bytes are never read. Reads run ahead across the worker's shards while earlier bytes
   are written (reads.py), as many requests in flight as the store needs and never more bytes
   than one budget shared with the uploads (storage/inflight.py).
4. Finalize: config.json, the index, tokenizer/other files, and `proxy-manifest.json` last:
   its presence marks the proxy complete.

Scale-out (shares.py): `build_share(worker=i, workers=W)` writes only worker i's share of the
shards (a deterministic partition balanced by bytes, which the expert count fixes) and a journal
of its plan (selecting ahead: its own blocks' and the first MoE block's) and of what it wrote;
`finalize_build` (run once after all workers) joins the plan from the journals (refusing workers
that selected differently), checks every worker's shards against them and does step 4. A single
build is worker 0 of 1 followed by finalize, so W workers give byte-identical output. An
interrupted worker reruns and keeps the files its journal shows complete (sha256 checked).
Tensors that --heal, --merge or --reconstruct fit are fitted once per build, by fit_for_workers
(or the first step that needs them), and saved for the others (fits.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from moe_proxy.options import PruningOptions
from moe_proxy.pruning.destination import Published, check_apart
from moe_proxy.pruning.fits import fits_name
from moe_proxy.pruning.prepared import open_source, with_transfer
from moe_proxy.pruning.steps import finalize, prepare, write_share
from moe_proxy.pruning.writer import Written
from moe_proxy.storage import Store


@dataclass(frozen=True)
class Share:
    """What one worker of a scale-out build wrote (build_share): its output shards, by name."""

    worker: int
    workers: int
    files: dict[str, Written]  # empty when dst already holds the published proxy
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
