"""`moe-proxy inspect SRC`: architecture, layers, experts, parameters and bytes of a checkpoint."""

from __future__ import annotations

import argparse
import json

from moe_proxy.commands._common import add_storage_args, store_options
from moe_proxy.options import OutputOptions, add_arguments


def add_parser(sub) -> None:
    p = sub.add_parser("inspect", help="describe a checkpoint (reads config and headers only)", description=__doc__)
    p.add_argument("src", help="checkpoint directory or s3://bucket/prefix")
    add_arguments(p, OutputOptions, only=("json",), helps={"json": "machine-readable output"})
    add_storage_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moe_proxy.checkpoint.reader import open_checkpoint
    from moe_proxy.checkpoint.summary import summarize, text

    d = summarize(open_checkpoint(args.src, **store_options(args)))
    print(json.dumps(d, indent=2) if args.json else text(d))
    return 0
