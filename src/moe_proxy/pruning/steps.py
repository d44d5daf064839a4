"""The build's three steps, which build.py's entry points run: prepare (open the source, check
the destination, plan), write_share (a worker's output shards, streamed, and its journal;
worker 0 of 1 in a single build) and finalize (check every worker's shards, then write config,
index, other files and, last, the manifest).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from functools import partial
from itertools import chain, islice

from tqdm.auto import tqdm

from moe_proxy import __version__
from moe_proxy.checkpoint.reader import INDEX, MANIFEST
from moe_proxy.checkpoint.reads import Later, read_ahead, read_tasks
from moe_proxy.errors import CorruptCheckpoint, MoeProxyError
from moe_proxy.options import PruningOptions
from moe_proxy.pruning import plan_ahead
from moe_proxy.pruning.config import rewrite_config
from moe_proxy.pruning.destination import (REPLACED, Published, check_apart, check_destination, journals,
                                           make_manifest, owned)
from moe_proxy.pruning.expert_plan import ExpertPlan, plan_experts, plan_from_record
from moe_proxy.pruning.fits import fits_name, load_fits, save_fits
from moe_proxy.pruning.output_shards import output_tensors
from moe_proxy.pruning.prepared import OpenedSource, Prepared, open_source, with_transfer
from moe_proxy.pruning.shares import (assign_shards, journal_matches, journal_name, plan_difference, plan_json,
                                      read_journal, workers_plan, write_journal)
from moe_proxy.pruning.writer import Written, header_bytes, shard_size, write_file
from moe_proxy.storage import Store, Writer, open_store, write_bytes
from moe_proxy.storage.inflight import Transfer

log = logging.getLogger(__name__)


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
    ckpt, layout, calibration = source.ckpt, source.layout, source.calibration
    transfer.sized(max(b.expert_bytes for b in layout.blocks))
    dst_store = open_store(dst, **(store_options or {})) if isinstance(dst, str) else dst
    build_id = build_id_of(source, options, sizing)
    existing, replaced = check_destination(dst_store, build_id, overwrite)
    if existing is not None:
        log.info("%s already holds this proxy (same source and options): nothing to do", dst_store.uri)
        existing.up_to_date = True
        return existing
    plan = _plan(source, dst_store, build_id, options, progress, finalize_workers, planned, share_fits, sizing)
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
    return Prepared(ckpt, layout, dst_store, options, source.identity, build_id, plan,
                    output_tensors(ckpt, layout, split), calibration, transfer, progress, sizing,
                    split if plan is None else None)


def build_id_of(source: OpenedSource, options: PruningOptions, sizing=None) -> str:
    """What makes a build this very build: the source, the options, the moe-proxy version, the
    calibration tokens (and, for sequential statistics, the proxy they were made for) and, for a
    keep ratio, the device budget its count depends on."""
    calibration = source.calibration
    return hashlib.sha256(json.dumps([source.identity, asdict(options), __version__]
                                     + ([calibration.summary["tokens"]["sha256"]] if calibration else [])
                                     + ([calibration.summary["made_for"]] if calibration
                                        and calibration.mode != "one-pass" else [])
                                     # a keep ratio's count depends on the device budget
                                     + ([asdict(sizing)] if sizing and options.keep_ratio is not None else []),
                                     sort_keys=True).encode()).hexdigest()


def _plan(source: OpenedSource, dst: Store, build_id: str, options: PruningOptions, progress: bool,
          finalize_workers: int | None, planned: ExpertPlan | None, share_fits: bool, sizing) -> ExpertPlan | None:
    """The build's plan (prepare's arguments say where it comes from); None where its experts
    are selected while the shards stream (plan_ahead.py)."""
    ckpt, layout, calibration = source.ckpt, source.layout, source.calibration
    journaled = workers_plan(dst, build_id, finalize_workers) if finalize_workers else None
    fitted = options.fits
    if planned is not None:
        plan = planned
    elif fitted and (plan := load_fits(dst, build_id, layout)) is not None:  # fitted once, by another step
        log.info("fitted tensors of this build read from %s/%s: nothing fitted again", dst.uri,
                 fits_name(build_id))
    elif journaled is not None and not fitted:
        plan = plan_from_record(journaled, layout)
    elif plan_ahead.applies(options, calibration, layout):  # selected while the shards stream
        plan = None
    else:
        plan = plan_experts(ckpt, layout, options, progress, calibration=calibration, sizing=sizing)
        if fitted and share_fits:  # the other workers and finalize read these instead of fitting again
            save_fits(dst, build_id, plan)
    if journaled is not None and (mine := plan_json(plan)) != journaled:
        raise CorruptCheckpoint(f"the workers selected other experts than finalize does "
                                f"({plan_difference(journaled, mine)}); rerun every worker with the same moe-proxy")
    return plan


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
    journal = read_journal(p.dst, name, p.build_id, lambda: plan_json(p.plan_of(mine)))
    if not p.dst.exists(name):  # before any shard: workers that start later see a build here, not strangers' files
        write_journal(p.dst, name, p.build_id, None, {})
    total = sum(shard_size(p.layout_shards[f]) for f in mine)
    with tqdm(total=total, desc=f"writing proxy ({worker + 1}/{workers})" if workers > 1 else "writing proxy",
              unit="B", unit_scale=True, disable=not progress) as bar:
        written = _kept(p, mine, journal, bar)
        written |= _stream(p, [f for f in mine if f not in written], mine, name, journal, bar)
    plan = p.plan_of(mine)  # (an idle worker still selects the first block: finalize compares it)
    if p.planned is None:
        for note in plan.notes:
            log.warning(note)
    # Complete: the share's selections; an idle worker still leaves its journal, so finalize knows it ran.
    write_journal(p.dst, name, p.build_id, plan_json(plan), journal, complete=True)
    return written


def _kept(p: Prepared, mine: list[str], journal: dict, bar: tqdm) -> dict[str, Written]:
    """The shards of `mine` an interrupted run of this worker wrote completely (as its journal
    says, checked): kept, not written again."""
    kept: dict[str, Written] = {}
    for f in mine:
        done = journal.get(f)
        if done and journal_matches(p.dst, f, done):
            log.info("%s: already complete from an interrupted run (checksum matches), kept", f)
            kept[f] = Written(f, done["size"], done["sha256"])
            bar.update(done["size"])
    return kept


def _stream(p: Prepared, todo: list[str], mine: list[str], name: str, journal: dict, bar: tqdm) -> dict[str, Written]:
    """Write the shards `todo` of this worker's share `mine`, each journaled in `name` once committed.

    One read-ahead over the whole share: the next shard's reads stay in flight while this
    one's last parts, commit and journal go up, so downloading never drains between shards.
    Uploads overlap by one shard: shard i's last parts, commit and journal entry go up on
    the commit thread while shard i+1's first parts do. Commits stay in shard order and
    shard i+1 is committed only after shard i is journaled, so a killed worker leaves at
    most two unfinished uploads (invisible: a multipart upload or a temporary file until
    its commit) and its journal names only shards that are complete."""
    transfer = p.transfer or Transfer().sized(max(b.expert_bytes for b in p.layout.blocks))
    tasks: dict[str, list] = {}
    written: dict[str, Written] = {}

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
        write_journal(p.dst, name, p.build_id, plan_json(p.plan_of(so_far, first=False)), journal)

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
    return written


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
        journal = read_journal(p.dst, name, p.build_id)
        for f in files:
            rec = journal.get(f)
            if rec is None or not p.dst.exists(f):
                raise CorruptCheckpoint(f"worker {worker}'s shard {f} is missing from {p.dst.uri}; rerun worker {worker}")
            if rec["size"] != shard_size(p.shards[f]):
                raise CorruptCheckpoint(f"worker {worker}'s shard {f} has {rec['size']} bytes where the plan gives "
                                        f"{shard_size(p.shards[f])}; rerun worker {worker}")
            if not journal_matches(p.dst, f, rec):
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
        for name in sorted(owned(p.dst) - set(written) - {MANIFEST}):
            p.dst.delete(name)

    if n := p.dst.discard_incomplete():  # all workers are done: nothing is being written
        log.info("%s: discarded %d unfinished write(s) of interrupted attempts", p.dst.uri, n)
    manifest = Published(make_manifest(p, written))
    manifest.sha256 = write_file(p.dst, MANIFEST, [_json(manifest)]).sha256  # of exactly the bytes published
    for name in journals(p.dst):
        p.dst.delete(name)
    return manifest


def _json(obj) -> bytes:
    return (json.dumps(obj, indent=2) + "\n").encode()
