"""moe-proxy commands run as child processes, their outcome recorded beside their output: a
rerun with the same arguments reuses a run that finished (what lets an interrupted `diagnose`
or `bisect` resume). A record is written last, so a run cut short has none and runs again."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from moe_proxy.errors import MoeProxyError


@dataclass(frozen=True)
class Ran:
    returncode: int
    error: str | None  # the last error line of its output, when it failed
    wall_s: float
    reused: bool = False


def run_recorded(argv: list[str], directory: Path, record: str, log: str, env: dict[str, str] | None = None,
                 done: str | None = None) -> Ran:
    """`moe-proxy <argv>` with its output in `directory/log`, unless `directory/record` says the
    same arguments already ran to exit 0 (and `done`, a file it writes, is there)."""
    path = directory / record
    try:
        old = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        old = None  # unreadable: run again
    if old and old.get("argv") == argv and old.get("returncode") == 0 and (done is None or (directory / done).exists()):
        return Ran(0, None, old.get("wall_s", 0.0), reused=True)
    directory.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    started = time.monotonic()
    with open(directory / log, "w") as out:
        code = subprocess.run([sys.executable, "-m", "moe_proxy", *argv], stdout=out, stderr=subprocess.STDOUT,
                              env={**os.environ, **(env or {})}, check=False).returncode
    wall = time.monotonic() - started
    error = last_error(directory / log) if code != 0 else None
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"argv": argv, "returncode": code, "error": error, "wall_s": wall}))
    tmp.replace(path)
    return Ran(code, error, wall)


def last_error(path: Path) -> str:
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or ["no output"])[-1][:500]


class _Refusing(argparse.ArgumentParser):
    """A command's parser that raises instead of exiting: a bad flag is one line naming its run."""

    def error(self, message: str):
        raise MoeProxyError(message)


def parse_as(command: str, argv: list[str]) -> argparse.Namespace:
    """`moe-proxy <command> <argv>` parsed by that command's own parser, before anything runs."""
    parser = _Refusing(prog="moe-proxy")
    importlib.import_module(f"moe_proxy.commands.{command}").add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args([command, *argv])
