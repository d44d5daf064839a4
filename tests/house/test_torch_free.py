"""The torch-free line (moe_proxy.TORCH_FREE): each listed module imports with torch,
transformers, scikit-learn and scipy blocked, each in its own fresh interpreter."""

from __future__ import annotations

import pytest

from moe_proxy import TORCH_FREE
from moe_proxy.cli import COMMANDS

from .blocked import run_blocked


@pytest.mark.parametrize("module", TORCH_FREE)
def test_imports_without_torch(module):
    r = run_blocked("import importlib, sys; importlib.import_module(sys.argv[1])", module)
    assert r.returncode == 0, f"{module} needs a blocked package:\n{r.stderr[-2000:]}"


@pytest.mark.parametrize("module", ["moe_proxy.pruning.features", "moe_proxy.pruning.merge", "sklearn.cluster"])
def test_the_blocker_blocks(module):
    """A module that does need torch (features), scipy (merge) or scikit-learn fails to import,
    so a pass above means something. (selection loads scikit-learn only when it clusters.)"""
    r = run_blocked("import importlib, sys; importlib.import_module(sys.argv[1])", module)
    assert r.returncode != 0 and "is blocked" in r.stderr


def test_every_command_is_on_the_line():
    """The CLI imports every command module to build its parser: all of them must be listed."""
    assert set(COMMANDS) <= set(TORCH_FREE)
