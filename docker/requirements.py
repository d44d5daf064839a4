#!/usr/bin/env python3
"""Print the pip requirements of moe-proxy from pyproject.toml, one per line, for images.

    python docker/requirements.py --extra operator --without torch scikit-learn

The operator image installs moe-proxy itself with `--no-deps` and these requirements, so
it gets kopf and the small libraries the torch-free modules use (boto3, numpy)
without torch: pyproject.toml lists torch among the base dependencies, which the CLI needs.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]


def _name(requirement: str) -> str:
    """The normalised distribution name of a PEP 508 requirement."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if not match:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def requirements(pyproject: dict, extras: list[str], without: list[str]) -> list[str]:
    project = pyproject["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise SystemExit(f"no such extra(s) in pyproject.toml: {', '.join(unknown)}")
    excluded = {_name(w) for w in without}
    out: list[str] = []
    for requirement in [*project.get("dependencies", []), *(r for e in extras for r in optional[e])]:
        if _name(requirement) not in excluded and requirement not in out:
            out.append(requirement)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pyproject", default=str(Path(__file__).resolve().parents[1] / "pyproject.toml"))
    parser.add_argument("--extra", action="append", default=[], help="an extra to include (repeatable)")
    parser.add_argument("--without", nargs="*", default=[], help="distributions to leave out")
    args = parser.parse_args(argv)
    with open(args.pyproject, "rb") as f:
        pyproject = tomllib.load(f)
    print("\n".join(requirements(pyproject, args.extra, args.without)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
