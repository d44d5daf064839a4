"""The `moe-proxy` command line. Each subcommand lives in its own module, which exposes
`add_parser(subparsers)` (declares its arguments and sets `func`) so this file stays a table."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import select
import sys

from moe_proxy import __version__
from moe_proxy.errors import MoeProxyError
from moe_proxy.investigate.processes import Interrupted
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
    "moe_proxy.commands.bisect",
    "moe_proxy.commands.triage",
    "moe_proxy.commands.watch",
    "moe_proxy.commands.compare",
]

VERBOSE = ("-v", "--verbose")


class OneLineParser(argparse.ArgumentParser):
    """Bad usage is one line, `moe-proxy CMD: error: ...` and where the options are listed, not
    argparse's usage block (40 lines for diagnose); exit 2 as argparse does. Subcommands' parsers
    are of their parent's class, so every command gets it."""

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} -h)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="moe-proxy",
        description="Build proxy MoE checkpoints (fewer routed experts, same architecture) "
        "to reproduce RL post-training failures cheaply.",
    )
    parser.add_argument("--version", action="version", version=f"moe-proxy {__version__}")
    parser.add_argument(*VERBOSE, action="store_true", help="log debug details (before or after the command)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(name).add_parser(sub)
    for command in subcommands(parser).values():
        command.formatter_class = type(f"Defaults{command.formatter_class.__name__}",
                                       (ShowDefaults, command.formatter_class), {})
    return parser


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Each command's name and its parser, in the order `--help` lists them."""
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


class ShowDefaults(argparse.HelpFormatter):
    """`--help` appends an option's default unless its help already says it, or it has none to
    show (unset, a flag's on/off, empty)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or "default" in text.lower() or default in (None, "", [])
                or default is argparse.SUPPRESS or isinstance(default, bool)):
            return action.help
        return f"{text} (default %(default)s)"  # as options.add_arguments writes it


def _reader_gone(stream) -> bool:
    """Whether `stream` is a pipe whose reading end is closed (`moe-proxy ... | head -1`): poll
    reports an error on it. False for anything else, so a BrokenPipeError of another pipe or
    socket is not taken for it."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed command line. -v/--verbose may also follow the command (`moe-proxy inspect X
    -v`): its parser leaves it over, as any argument it does not know, and the command's parser
    refuses the others."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    args.verbose = args.verbose or any(a in VERBOSE for a in rest)
    if unknown := [a for a in rest if a not in VERBOSE]:
        subcommands(parser)[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(message)s")
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # here, where a closed pipe is handled, not at interpreter exit
        return code
    except BrokenPipeError:
        if not _reader_gone(sys.stdout):
            raise
        # The reader of stdout has gone; as https://docs.python.org/3/library/signal.html#note-on-sigpipe
        # says: point stdout at devnull, so that the flush at exit does not fail again, and exit 1.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except MoeProxyError as exc:
        print(f"moe-proxy {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Interrupted as exc:  # a command that stopped its runs and says what it kept
        print(f"moe-proxy {args.command}: {exc}", file=sys.stderr)
        return 128 + exc.signum
    except KeyboardInterrupt:
        if args.command in ("build", "calibrate"):
            print("interrupted: no manifest was written, so the destination is not a complete proxy; "
                  "rerun the same command to finish", file=sys.stderr)
        else:
            print(f"moe-proxy {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
