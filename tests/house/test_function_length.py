"""No function is longer than a screen: a function over LIMIT lines (signature and docstring
included) is split into named steps. Read from the source with `ast`."""

from __future__ import annotations

import ast

from .sources import modules

LIMIT = 60


def test_no_function_is_over_the_limit():
    long = [f"{module.where(node)}: {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for module in modules().values() for node in ast.walk(module.tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > LIMIT]
    assert not long, f"functions over {LIMIT} lines (split them into named steps):\n" + "\n".join(long)
