"""A scale-out build's shares and journals. Each of W workers writes the output shards
assign_shards gives it (a deterministic partition balanced by bytes) and a journal of its plan
and of the shards it wrote: a rerun keeps the files its journal shows complete, and finalize
joins the workers' plans from their journals (workers_plan), refusing workers that selected
differently.
"""

from __future__ import annotations

import json
from typing import Callable

from moe_proxy.checkpoint.reader import JOURNAL
from moe_proxy.errors import CorruptCheckpoint
from moe_proxy.pruning.expert_plan import ExpertPlan, plan_record
from moe_proxy.pruning.writer import OutTensor, shard_size
from moe_proxy.storage import Store, sha256_of, write_bytes


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


def plan_json(plan: ExpertPlan) -> dict:
    """The plan's record as a journal holds it (through JSON, so that it compares equal to one read back)."""
    return json.loads(json.dumps(plan_record(plan)))


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
                                    f"({plan_difference(joined, record, shared)}): their shards do not form one "
                                    f"proxy; rerun every worker with the same moe-proxy")
        for b, s in record["selections"].items():
            by.setdefault(b, worker)
            joined["selections"].setdefault(b, s)
    return joined


def plan_difference(a: dict, b: dict, blocks: set[str] | None = None) -> str:
    """The first difference of two plan records (of `blocks` only, where given)."""
    for prefix in sorted(blocks if blocks is not None else set(a.get("selections", {})) | set(b.get("selections", {}))):
        sa, sb = a.get("selections", {}).get(prefix), b.get("selections", {}).get(prefix)
        if sa != sb:
            return f"{prefix}: kept {(sa or {}).get('kept')} vs {(sb or {}).get('kept')}"
    keys = (set(a) | set(b)) - {"selections"}
    return ", ".join(f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in sorted(keys) if a.get(k) != b.get(k))


def write_journal(dst: Store, name: str, build_id: str, plan: dict | None, files: dict, complete: bool = False) -> None:
    write_bytes(dst, name, json.dumps({"build_id": build_id, "plan": plan, "files": files}
                                      | ({"complete": True} if complete else {})).encode())


def journal_matches(dst: Store, name: str, rec: dict) -> bool:
    """Is dst's `name` the file a journal recorded? An object store's own checksum, recorded
    when the file was written, is compared without downloading it; local files are re-hashed."""
    if not dst.exists(name) or dst.size(name) != rec["size"]:
        return False
    if rec.get("checksum"):
        return dst.checksum(name) == rec["checksum"]
    return sha256_of(dst, name) == rec["sha256"]


def read_journal(dst: Store, name: str, build_id: str, plan: Callable[[], dict] | None = None) -> dict:
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
