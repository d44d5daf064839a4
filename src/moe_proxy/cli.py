"""The `moe-proxy` command line. Each subcommand lives in its own module, which exposes
`add_parser(subparsers)` (declares its arguments and sets `func`) so this file stays a table."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from moe_proxy import __version__
from moe_proxy.errors import MoeProxyError
from moe_proxy.reports import EXIT_BAD_INPUT

# Subcommand modules, in the order `moe-proxy --help` lists them.
COMMANDS = [
    "moe_proxy.commands.calibrate",
    "moe_proxy.commands.build",
    "moe_proxy.commands.inspect",
    "moe_proxy.commands.checkpoints",
    "moe_proxy.commands.verify",
    "moe_proxy.commands.plan",
    "moe_proxy.commands.repro",
    "moe_proxy.commands.diagnose",
    "moe_proxy.commands.watch",
    "moe_proxy.commands.compare",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moe-proxy",
        description="Build proxy MoE checkpoints (fewer routed experts, same architecture) "
        "to reproduce RL post-training failures cheaply.",
    )
    parser.add_argument("--version", action="version", version=f"moe-proxy {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug details")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(message)s")
    try:
        return int(args.func(args) or 0)
    except MoeProxyError as exc:
        print(f"moe-proxy {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("interrupted: no manifest was written, so the destination is not a complete proxy; "
              "rerun the same command to finish", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
