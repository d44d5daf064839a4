"""Every package of the `test` extra is installed: a failed install fails the suite instead of
turning whole directories of tests into skips."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
TEST_EXTRA = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]["test"]


@pytest.mark.parametrize("requirement", TEST_EXTRA)
def test_promised_package_is_installed(requirement):
    name = re.match(r"[A-Za-z0-9_.\-]+", requirement).group(0)
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        pytest.fail(f"{name} (test extra: {requirement!r}) is not installed; pip install -e '.[test]'")
