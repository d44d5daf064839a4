"""Build a proxy checkpoint: read -> plan -> write.

1. Open the source (config, index, safetensors headers; no tensor data yet).
2. Plan: per MoE block, expert features -> clustering -> the kept experts (ascending, renumbered
   0..k-1 in that order), with the new top-k and grouped-routing fields checked.
3. Write, shard by shard in the source's sharding: backbone tensors byte for byte, router rows
   and expert tensors of kept experts only, in their source dtype; then config.json, the
   index, tokenizer/other files, and `proxy-manifest.json` last: its presence marks the
   proxy complete. Dropped experts' bytes are never read.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass, field
from typing import Iterable

from tqdm.auto import tqdm

from . import __version__
from .architectures import Arch, detect, expert_count, groups, top_k
from .checkpoint import INDEX, MANIFEST, Checkpoint, TensorInfo, open_checkpoint, read_json
from .errors import DestinationExists, InvalidExpertCount, MoeProxyError
from .features import expert_features, router_bytes
from .layout import Layout, MoeBlock, find_layout
from .proxy_config import rewrite_config
from .selection import Selection, select
from .shard_writer import OutTensor, Written, shard_pieces, write_file
from .storage import Store, open_store, write_bytes

log = logging.getLogger(__name__)
JOURNAL = ".moe-proxy-journal.json"
CHUNK = 64 << 20  # backbone tensors are copied in chunks of this many bytes


@dataclass
class Options:
    experts: int | None = None
    keep_ratio: float | None = None
    method: str = "cluster"
    features: str = "router"
    clustering: str = "kmeans"
    seed: int = 0
    top_k: int | None = None
    pins: dict[int, list[int]] = field(default_factory=dict)  # layer -> expert ids to keep


@dataclass
class Plan:
    arch: Arch
    experts_before: int
    experts_after: int
    top_k_before: int
    top_k_after: int
    n_group: int
    topk_group: int
    selections: dict[str, Selection]  # block prefix -> selection
    notes: list[str]


def target_experts(n: int, options: Options, arch: Arch, n_group: int, topk_group: int) -> int:
    """The experts per layer to keep, validated; errors suggest valid values."""
    if (options.experts is None) == (options.keep_ratio is None):
        raise InvalidExpertCount("give exactly one of --experts N or --keep-ratio R")
    if options.keep_ratio is not None:
        if not 0 < options.keep_ratio <= 1:
            raise InvalidExpertCount(f"--keep-ratio must be in (0, 1], got {options.keep_ratio}")
        k = max(n_group * arch.min_per_group, round(n * options.keep_ratio / n_group) * n_group)
    else:
        k = options.experts
    valid = [v for v in range(n_group * arch.min_per_group, n + 1, n_group)]
    if k is None or k < 1 or k > n or k % n_group or k // n_group < arch.min_per_group:
        why = (
            f"the model has {n} routed experts per layer" if k is None or k < 1 or k > n
            else f"grouped routing has {n_group} groups (each must keep the same number, at least "
                 f"{arch.min_per_group})"
        )
        shown = ", ".join(map(str, valid[:12])) + (" ..." if len(valid) > 12 else "")
        raise InvalidExpertCount(f"cannot keep {k} experts per layer: {why}; valid values: {shown}")
    return k


def make_plan(ckpt: Checkpoint, layout: Layout, options: Options, progress: bool = False) -> Plan:
    arch, config = layout.arch, ckpt.config
    n, k0 = expert_count(arch, config), top_k(arch, config)
    n_group, topk_group = groups(arch, config)
    if n % n_group:
        raise InvalidExpertCount(f"config has {n} experts in {n_group} groups: not an equal split")
    k = target_experts(n, options, arch, n_group, topk_group)
    notes = []
    limit = min(k, topk_group * (k // n_group)) if n_group > 1 else k
    if options.top_k is not None:
        if not 1 <= options.top_k <= limit:
            raise InvalidExpertCount(f"--top-k {options.top_k} must be between 1 and {limit} with {k} experts kept")
        new_top_k = options.top_k
    else:
        new_top_k = min(k0, limit)
        if new_top_k != k0:
            notes.append(f"top-k clamped from {k0} to {new_top_k}: only {k} experts kept"
                         + (f" ({k // n_group} in each of {topk_group} selected groups)" if n_group > 1 else ""))
    unknown = set(options.pins) - {b.layer for b in layout.blocks}
    if unknown:
        raise InvalidExpertCount(
            f"--pin names layer(s) {sorted(unknown)} which have no routed experts; MoE layers: "
            f"{[b.layer for b in layout.blocks]}"
        )
    selections = {}
    for block in tqdm(layout.blocks, desc="selecting experts", unit="layer", disable=not progress):
        pins = options.pins.get(block.layer, [])
        bad = [e for e in pins if not 0 <= e < n]
        if bad:
            raise InvalidExpertCount(f"--pin {block.layer}:{bad[0]}: experts are numbered 0..{n - 1}")
        if len(set(pins)) > k:
            raise InvalidExpertCount(f"{len(set(pins))} experts pinned in layer {block.layer} but only {k} kept")
        # Baselines ignore features but still report cluster sizes, from the cheap router rows.
        feats = expert_features(ckpt, block, options.features if options.method == "cluster" else "router")
        selections[block.prefix] = select(
            feats, k, n_group=n_group, method=options.method, clustering=options.clustering,
            seed=options.seed, pins=sorted(set(pins)),
        )
    return Plan(arch, n, k, k0, new_top_k, n_group, topk_group, selections, notes)


# ---------------------------------------------------------------- writing


def _copy(ckpt: Checkpoint, t: TensorInfo) -> Iterable[bytes]:
    for start in range(t.start, t.end, CHUNK):
        yield ckpt.store.read_range(t.file, start, min(CHUNK, t.end - start))


def output_tensors(ckpt: Checkpoint, layout: Layout, plan: Plan) -> dict[str, list[OutTensor]]:
    """The proxy's tensors, per output shard (same names and order as the source's)."""
    role: dict[str, tuple] = {}
    for b in layout.blocks:
        sel = plan.selections[b.prefix]
        for leaf, (t, axis) in b.router.items():
            role[t.name] = ("slice", t.name, axis, sel.kept)
        for e, rests in b.per_expert.items():
            if e in sel.kept:
                for rest, t in rests.items():
                    role[t.name] = ("rename", f"{b.prefix}.experts.{sel.kept.index(e)}.{rest}")
            else:
                for t in rests.values():
                    role[t.name] = ("drop",)
        for t in b.fused.values():
            role[t.name] = ("slice", t.name, 0, sel.kept)

    shards: dict[str, list[OutTensor]] = {}
    for f in ckpt.files:
        out = []
        for t in ckpt.in_file(f):
            r = role.get(t.name, ("copy",))
            if r[0] == "drop":
                continue
            if r[0] == "slice":
                _, name, axis, kept = r
                shape = t.shape[:axis] + (len(kept),) + t.shape[axis + 1 :]
                out.append(OutTensor(t.name, t.dtype, shape,
                                     lambda name=name, axis=axis, kept=kept: [ckpt.read_slices(name, axis, kept)]))
            else:
                new_name = r[1] if r[0] == "rename" else t.name
                out.append(OutTensor(new_name, t.dtype, t.shape, lambda t=t: _copy(ckpt, t)))
        if out:
            shards[f] = out
    return shards


def source_identity(ckpt: Checkpoint, layout: Layout) -> str:
    """Tells two checkpoints apart, even two steps of one run: config, tensor table, router bytes."""
    h = hashlib.sha256(json.dumps(ckpt.config, sort_keys=True).encode())
    for t in ckpt.tensors.values():
        h.update(f"{t.name}|{t.dtype}|{t.shape}|{t.file}|{t.start}|{t.end}\n".encode())
    for b in layout.blocks:
        h.update(router_bytes(ckpt, b))
    return h.hexdigest()


def count_params(ckpt: Checkpoint, layout: Layout, plan: Plan | None = None) -> dict[str, int]:
    """Stored elements, total and active per token (top-k of the routed experts)."""
    total = sum(t.numel for t in ckpt.tensors.values())
    n, k0 = expert_count(layout.arch, ckpt.config), top_k(layout.arch, ckpt.config)
    experts = sum(b.expert_numel for b in layout.blocks)
    router = sum(t.numel for b in layout.blocks for t, _ in b.router.values())
    out = {"total_before": total, "active_before": total - experts + experts * k0 // n}
    if plan:
        k, tk = plan.experts_after, plan.top_k_after
        after = total - experts - router + experts * k // n + router * k // n
        out |= {"total_after": after, "active_after": after - experts * k // n + experts * tk // n}
    return out


def _check_destination(dst: Store, src: Store, build_id: str, overwrite: bool) -> dict | None:
    """The existing manifest when dst already holds this very proxy; raise if it holds another."""
    if dst.uri.rstrip("/") == src.uri.rstrip("/"):
        raise DestinationExists("destination is the source checkpoint itself; choose another directory")
    if dst.exists(MANIFEST):
        m = read_json(dst, MANIFEST)
        if m.get("build_id") == build_id and all(dst.exists(f) for f in m.get("files", {})):
            return m
        if not overwrite:
            raise DestinationExists(
                f"{dst.uri} already holds a different proxy (of {m.get('source', {}).get('uri')}, "
                f"method {m.get('method')}); pass --overwrite to replace it"
            )
    elif dst.list() and not dst.exists(JOURNAL) and not overwrite:
        raise DestinationExists(f"{dst.uri} is not empty and is not a moe-proxy output; pass --overwrite to replace it")
    return None


def build_proxy(
    src: str | Store,
    dst: str | Store,
    experts: int | None = None,
    keep_ratio: float | None = None,
    method: str = "cluster",
    features: str = "router",
    clustering: str = "kmeans",
    seed: int = 0,
    top_k: int | None = None,
    pins: dict[int, list[int]] | None = None,
    overwrite: bool = False,
    progress: bool = False,
    store_options: dict | None = None,
) -> dict:
    """Build the proxy of checkpoint `src` into `dst` and return its manifest (a dict).
    Rerunning an identical build is a no-op that returns the existing manifest."""
    options = Options(experts, keep_ratio, method, features, clustering, seed, top_k, dict(pins or {}))
    ckpt = open_checkpoint(src, **(store_options or {}))
    layout = find_layout(ckpt, detect(ckpt.config))
    dst_store = open_store(dst, **(store_options or {})) if isinstance(dst, str) else dst

    identity = source_identity(ckpt, layout)
    params = asdict(options)
    build_id = hashlib.sha256(json.dumps([identity, params, __version__], sort_keys=True).encode()).hexdigest()
    existing = _check_destination(dst_store, ckpt.store, build_id, overwrite)
    if existing is not None:
        log.info("%s already holds this proxy (same source and options): nothing to do", dst_store.uri)
        return existing | {"up_to_date": True}

    plan = make_plan(ckpt, layout, options, progress)
    for note in plan.notes:
        log.warning(note)

    # Unpublish first: from here until the manifest is written, dst is visibly incomplete.
    dst_store.delete(MANIFEST)
    journal = _read_journal(dst_store, build_id)
    if overwrite:
        for name in dst_store.list():
            if name not in journal and name != JOURNAL:
                dst_store.delete(name)
    write_bytes(dst_store, JOURNAL, json.dumps({"build_id": build_id, "files": journal}).encode())

    shards = output_tensors(ckpt, layout, plan)
    written: dict[str, Written] = {}
    total = sum(t.nbytes for ts in shards.values() for t in ts)
    bar = tqdm(total=total, desc="writing proxy", unit="B", unit_scale=True, disable=not progress)
    for f, tensors in shards.items():
        pieces = shard_pieces(tensors)
        written[f] = _write_or_resume(dst_store, f, pieces, journal, build_id, bar.update)
    bar.close()

    config = rewrite_config(ckpt.config, plan)
    written["config.json"] = write_file(dst_store, "config.json", [_json(config)])
    if ckpt.store.exists(INDEX):
        weight_map = {t.name: f for f, ts in shards.items() for t in ts}
        index = {"metadata": {**ckpt.index_metadata, "total_size": sum(t.nbytes for ts in shards.values() for t in ts)},
                 "weight_map": dict(sorted(weight_map.items()))}
        index["metadata"].pop("total_parameters", None)
        written[INDEX] = write_file(dst_store, INDEX, [_json(index)])
    for name in ckpt.other_files():
        written[name] = write_file(dst_store, name, [ckpt.store.read_bytes(name)])

    manifest = make_manifest(ckpt, layout, plan, options, identity, build_id, written)
    write_bytes(dst_store, MANIFEST, _json(manifest))
    dst_store.delete(JOURNAL)
    return manifest


def _read_journal(dst: Store, build_id: str) -> dict:
    """Files already written by an interrupted attempt of this same build."""
    if not dst.exists(JOURNAL):
        return {}
    try:
        j = json.loads(dst.read_bytes(JOURNAL))
    except ValueError:
        return {}
    return j.get("files", {}) if j.get("build_id") == build_id else {}


def _write_or_resume(dst: Store, name: str, pieces, journal: dict, build_id: str, on_bytes) -> Written:
    from .storage import sha256_of

    done = journal.get(name)
    if done and dst.exists(name) and dst.size(name) == done["size"] and sha256_of(dst, name) == done["sha256"]:
        log.info("%s: already complete from an interrupted run (sha256 matches), kept", name)
        return Written(name, done["size"], done["sha256"])
    w = write_file(dst, name, pieces, on_bytes)
    journal[name] = {"size": w.size, "sha256": w.sha256}
    write_bytes(dst, JOURNAL, json.dumps({"build_id": build_id, "files": journal}).encode())
    return w


def _json(obj) -> bytes:
    return (json.dumps(obj, indent=2) + "\n").encode()


def make_manifest(ckpt, layout, plan, options, identity, build_id, written) -> dict:
    bytes_before = sum(ckpt.file_sizes.values())
    shard_bytes = sum(w.size for f, w in written.items() if f in ckpt.files)
    return {
        "format": "moe-proxy/v1",
        "tool_version": __version__,
        "build_id": build_id,
        "source": {"uri": ckpt.uri, "architecture": plan.arch.name,
                   "model_type": ckpt.config.get("model_type"), "identity": identity},
        "method": asdict(options) | {"pins": {str(k): v for k, v in options.pins.items()}},
        "experts": {"before": plan.experts_before, "after": plan.experts_after,
                    "top_k_before": plan.top_k_before, "top_k_after": plan.top_k_after,
                    "n_group": plan.n_group, "topk_group": plan.topk_group},
        "notes": plan.notes,
        "layers": {
            b.prefix: {"layer": b.layer, "kept": plan.selections[b.prefix].kept,
                       "cluster_sizes": plan.selections[b.prefix].cluster_sizes}
            for b in layout.blocks
        },
        "params": count_params(ckpt, layout, plan),
        "bytes": {"before": bytes_before, "after": shard_bytes},
        "files": {f: {"size": w.size, "sha256": w.sha256} for f, w in sorted(written.items())},
    }
