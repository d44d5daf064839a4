"""Run Python code in a fresh interpreter where torch, transformers, scikit-learn and scipy
cannot be imported: a meta-path finder refuses them (and their submodules) with ImportError."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "transformers", "sklearn", "scipy")

BLOCKER = f"""
import sys

class _Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {HEAVY!r}:
            raise ImportError(f"{{name}} is blocked: this must not need torch, transformers, sklearn or scipy")
        return None

sys.meta_path.insert(0, _Refuse())
"""


def run_blocked(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`code` after the blocker, in a new interpreter; `args` become sys.argv[1:]."""
    return subprocess.run([sys.executable, "-c", BLOCKER + code, *args], capture_output=True, text=True,
                          timeout=timeout)
