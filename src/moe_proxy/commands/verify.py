"""`moe-proxy verify DST`: check a proxy's manifest hashes, config against tensors, and a forward pass."""

from __future__ import annotations

import argparse

from moe_proxy.reports import EXIT_FAILED, EXIT_OK
from moe_proxy.commands._common import add_storage_args, store_options
from moe_proxy.options import OutputOptions, add_arguments


def add_parser(sub) -> None:
    p = sub.add_parser("verify", help="check a proxy: hashes, config vs tensors, transformers forward pass",
                       description=__doc__)
    p.add_argument("dst", help="proxy directory or s3://bucket/prefix")
    p.add_argument("--no-forward", action="store_true", help="skip loading the model with transformers")
    add_arguments(p, OutputOptions, only=("json", "no_progress"), helps={"json": "print the report as JSON"})
    add_storage_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moe_proxy.pruning.verify import as_json, text, verify  # torch and transformers load only when it runs

    report = verify(args.dst, forward=not args.no_forward, progress=not args.no_progress,
                    store_options=store_options(args))
    print(as_json(report) if args.json else text(report))
    return EXIT_OK if report.ok else EXIT_FAILED
