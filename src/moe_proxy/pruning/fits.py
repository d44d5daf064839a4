"""A build's saved fits: the tensors --heal, --merge and --reconstruct fitted, made once per
build. A scale-out's fit step (or its first step that fits) saves them beside the journals, with
the plan's record, and its workers and finalize load them instead of fitting again. Like the
journals, the file marks the build unfinished and goes when the proxy is published.
"""

from __future__ import annotations

import json
from dataclasses import replace
from functools import partial
from itertools import chain

from moe_proxy.checkpoint.layout import Layout
from moe_proxy.checkpoint.reader import JOURNAL, read_header
from moe_proxy.pruning.expert_plan import ExpertPlan, plan_from_record
from moe_proxy.pruning.shares import plan_json
from moe_proxy.pruning.writer import OutTensor, header_bytes, write_file
from moe_proxy.storage import Store


def fits_name(build_id: str) -> str:
    """Where a build's fitted tensors live in its destination until it is published (a journal:
    hidden, marks the build unfinished, deleted with the journals)."""
    return f"{JOURNAL}-fits-{build_id[:16]}.safetensors"


def save_fits(dst: Store, build_id: str, plan: ExpertPlan) -> None:
    """The plan's fitted tensors as one safetensors file (each tensor's bytes as stored, U8), its
    plan record and build id in the metadata. Streamed: one fitted tensor in memory at a time."""
    tensors = [OutTensor(n, "U8", (len(read()),), read) for n, read in sorted(plan.fitted.items())]
    metadata = {"format": "moe-proxy-fits", "build_id": build_id, "plan": json.dumps(plan_json(plan))}
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
