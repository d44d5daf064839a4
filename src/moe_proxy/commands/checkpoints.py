"""`moe-proxy checkpoints URI`: the checkpoints under a prefix (local or s3://), by step.

For each directory that holds a checkpoint (default: every directory with a config.json;
`--pattern 'global_step_*/actor/huggingface'` for verl's layout) it prints the training
step, whether the checkpoint is complete (and if not, which file is missing or short), its
architecture and size. Never tensor data: by default config.json, the start of the shard
index (its total_size) and each shard's 8-byte header length, a few KB per checkpoint (the
shard sizes must add up); `--deep` reads the whole index and every shard's header too, which
also catches an index that maps a tensor to the wrong shard (about 20 MB for DeepSeek-V3).

To reproduce a failure that showed at step K, build the proxy of the checkpoint just
before it: `moe-proxy checkpoints URI --before K` prints that checkpoint's URI.
"""

from __future__ import annotations

import argparse
import json
import sys

from typing import TYPE_CHECKING

from moe_proxy.reports import EXIT_FAILED, EXIT_OK
from moe_proxy.commands._common import add_listing_args, add_storage_args, store_options
from moe_proxy.options import OutputOptions, add_arguments

if TYPE_CHECKING:
    from moe_proxy.checkpoint.listing import ListedCheckpoint


def add_parser(sub) -> None:
    p = sub.add_parser("checkpoints", help="list the checkpoints under a prefix, by step (headers only)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("uri", help="directory or s3://bucket/prefix holding a training run's checkpoints")
    add_listing_args(p)
    p.add_argument("--before", type=int, metavar="STEP",
                   help="print only the newest complete source checkpoint before STEP (the one to reproduce "
                        "a failure at STEP from); exit 1 if there is none")
    add_arguments(p, OutputOptions, only=("json",), helps={"json": "a JSON array sorted by step ascending"})
    p.add_argument("--deep", action="store_true",
                   help="also read the whole index and every shard's header (checks each tensor is where the "
                        "index says; ~20 MB per DeepSeek-V3-sized checkpoint instead of a few KB)")
    add_storage_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moe_proxy.checkpoint.listing import latest_before, list_checkpoints

    found = list_checkpoints(args.uri, args.pattern, args.step_regex, args.deep, **store_options(args))
    if args.before is not None:
        pick = latest_before(found, args.before)
        if pick is None:
            print(f"no complete source checkpoint before step {args.before} under {args.uri}", file=sys.stderr)
            return EXIT_FAILED
        print(json.dumps(pick.to_json(), indent=2) if args.json else pick.uri)
        return EXIT_OK
    if args.json:
        print(json.dumps([c.to_json() for c in found], indent=2))
    else:
        print(table(found))
    return 0


def human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def table(found: list[ListedCheckpoint]) -> str:
    if not found:
        return "no checkpoints found"
    rows = [("STEP", "COMPLETE", "KIND", "ARCHITECTURE", "SIZE", "URI", "NOTE")]
    for c in found:
        rows.append(("-" if c.step is None else str(c.step), "yes" if c.complete else "no", c.kind,
                     c.architecture or c.model_type or "-", human(c.bytes), c.uri, c.reason or ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)) + "  " + r[-1] for r in rows).rstrip()
