"""Test dependencies the README promises: `make test` installs the `test` extra of
pyproject.toml, and a test that needs one of them fails when it is missing, naming the
package to install. Never a skip: a broken install must not pass as a green suite.
Only what is genuinely optional skips (a real Kubernetes cluster in tests/e2e)."""

from __future__ import annotations

import importlib
import os
import shutil
import sys

import pytest

INSTALL = "pip install -e '.[test]' (or `make test`, which does)"


def require(module: str, package: str):
    """`import module`, or fail (at collection, too) saying which promised package is missing."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        error = exc  # failed outside the except block: the report is this one line, not a chain
    pytest.fail(f"{module} cannot be imported ({error}): the test extra promises {package}; {INSTALL}",
                pytrace=False)


def require_binary(name: str, package: str) -> str:
    """The path of a command-line tool a promised package installs (next to this Python, or on PATH)."""
    found = shutil.which(name, path=os.path.dirname(sys.executable)) or shutil.which(name)
    if not found:
        pytest.fail(f"`{name}` was not found: the test extra promises {package}; {INSTALL}", pytrace=False)
    return found
