"""Every flag is declared once: an option shared by several commands comes from an options model
(moe_proxy.options and the models beside their stages), so no flag is spelled out in two
`add_argument` calls. Read from the source with `ast`."""

from __future__ import annotations

import ast
from collections import defaultdict

from .sources import modules

# A flag spelled by several commands that means a different thing in each.
PER_COMMAND = {
    "--out": "each command's own output (a run directory, statistics, a report directory)",
}


def test_no_flag_is_declared_twice():
    where: dict[str, list[str]] = defaultdict(list)
    for module in modules().values():
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                for arg in node.args:
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("--"):
                        where[arg.value].append(module.where(node))
    twice = {name: places for name, places in where.items() if len(places) > 1 and name not in PER_COMMAND}
    assert not twice, "flags declared in more than one place (declare them once, in an options model):\n" + \
        "\n".join(f"{name}: {', '.join(places)}" for name, places in sorted(twice.items()))
    assert all(len(where[name]) > 1 for name in PER_COMMAND), "PER_COMMAND outlives its reason"
