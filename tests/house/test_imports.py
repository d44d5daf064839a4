"""Imports between the project's modules, read from the source with `ast` (nothing is imported).

- No module imports a private name (`_name`) of another module, nor reaches one through a
  module it imported (`heal._router_params`), nor imports a private module (`_common`) from
  outside its package: where two modules need the same thing, it has a public name in the
  module that owns it. Every import counts, inside functions too.
- The stage packages (moe_proxy.storage, checkpoint, layerwise, calibrate, pruning, metrics,
  rl, investigate) depend one way: the module-level imports between them form no cycle, and
  every import between them (inside functions too) follows DEPENDS, but for the lazy imports
  listed in AGAINST_THE_GRAIN with the reason each is there.
- No two of the project's modules import each other, directly or round a longer circle, with
  every import counted (inside functions and under TYPE_CHECKING too): a function-level import
  hides a circle from Python, not from the reader. CLOSES_A_CIRCLE lists the imports that still
  close one, each with its reason; an entry goes when its import does.
"""

from __future__ import annotations

import ast

from .sources import PACKAGES, imports, modules, private

STAGES = ("storage", "checkpoint", "layerwise", "calibrate", "pruning", "metrics", "rl", "investigate")
DEPENDS = {  # stage -> the stages it may import
    "storage": set(),
    "checkpoint": {"storage"},
    "layerwise": {"checkpoint", "storage"},  # the layer-by-layer runner and its driver
    "calibrate": {"layerwise", "checkpoint", "storage"},  # the statistics pass and its artifact
    "pruning": {"calibrate", "layerwise", "checkpoint", "storage"},  # selection, fits, the writer
    # read, detect, judge, follow, compare, plot: any framework's run, not only ours; on a
    # volume or in a bucket (metrics/sources.py reads s3:// through storage's S3Store)
    "metrics": {"storage"},
    "rl": {"metrics", "layerwise", "checkpoint", "storage"},  # the run writes and judges through metrics
    "investigate": {"rl", "metrics", "checkpoint", "storage"},  # diagnose and bisect: runs as child processes
}
AGAINST_THE_GRAIN = {  # (importing module, imported module): why, imported when it runs
    ("moe_proxy.calibrate.statistics", "moe_proxy.pruning.sequential"):
        "sequential statistics interleave the build's own expert selection with the scoring",
}


CLOSES_A_CIRCLE = {  # (importing module, imported module): why it is still there
    # (none left: issue 42 took the last ones apart)
}


def ours(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


def stage(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "moe_proxy" and parts[1] in STAGES else None


def test_no_private_name_is_imported_from_another_module():
    found = modules()
    bad = []
    for module in found.values():
        aliases: dict[str, str] = {}  # local name -> one of our modules
        for imp in imports(module):
            if not ours(imp.target):
                continue
            package = imp.target.rpartition(".")[0]
            if any(private(part) for part in imp.target.split(".")) and not module.name.startswith(package + "."):
                bad.append(f"{module.where(imp.node)}: imports the private module {imp.target}")
            bad += [f"{module.where(imp.node)}: imports {name} from {imp.target}" for name in imp.names if private(name)]
            for a in imp.node.names:
                if isinstance(imp.node, ast.Import):  # `import a.b` binds a, `import a.b as c` binds a.b
                    local = a.asname or a.name.split(".")[0]
                    aliases[local] = a.name if a.asname else local
                elif f"{imp.target}.{a.name}" in found:  # `from a import b`, b a module
                    aliases[a.asname or a.name] = f"{imp.target}.{a.name}"
        for node in ast.walk(module.tree):
            if (isinstance(node, ast.Attribute) and private(node.attr) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases):
                bad.append(f"{module.where(node)}: uses {aliases[node.value.id]}.{node.attr}")
    assert not bad, "private names used across modules (give them a public name where they belong):\n" + \
        "\n".join(bad)


def stage_imports():
    """(importing stage, imported stage, Import) for every import between two stage packages."""
    for module in modules().values():
        here = stage(module.name)
        if here is None:
            continue
        for imp in imports(module):
            targets = [imp.target] if imp.target and stage(imp.target) else []
            # `from moe_proxy import build`: the stage is the name taken
            targets += [f"{imp.target}.{n}" for n in imp.names if imp.target == "moe_proxy" and stage(f"moe_proxy.{n}")]
            for target in targets:
                if stage(target) != here:
                    yield here, stage(target), imp


def test_no_import_cycle_between_stage_packages():
    graph: dict[str, set[str]] = {s: set() for s in STAGES}
    seen: dict[tuple[str, str], str] = {}
    for a, b, imp in stage_imports():
        if imp.top:
            graph[a].add(b)
            seen.setdefault((a, b), f"{imp.module.where(imp.node)} imports {imp.target}")

    def cycle_from(start: str, path: list[str]) -> list[str] | None:
        for nxt in sorted(graph[path[-1]]):
            if nxt == start:
                return path + [start]
            if nxt not in path and (found := cycle_from(start, path + [nxt])):
                return found
        return None

    for s in STAGES:
        if cycle := cycle_from(s, [s]):
            steps = [seen[(a, b)] for a, b in zip(cycle, cycle[1:])]
            raise AssertionError(f"module-level import cycle {' -> '.join(cycle)}:\n" + "\n".join(steps))


def test_stage_packages_depend_one_way():
    bad = []
    for a, b, imp in stage_imports():
        if b in DEPENDS[a]:
            continue
        why = AGAINST_THE_GRAIN.get((imp.module.name, imp.target))
        if why is None or imp.top:
            bad.append(f"{imp.module.where(imp.node)}: {a} imports {imp.target}"
                       + (" at module level" if why else ""))
    assert not bad, f"imports against the stages' direction ({DEPENDS}):\n" + "\n".join(bad)


def test_the_exceptions_are_still_needed():
    """Each listed lazy import still exists: the list does not outlive its reasons."""
    present = {(imp.module.name, imp.target) for _, _, imp in stage_imports()}
    assert set(AGAINST_THE_GRAIN) <= present


def module_imports() -> dict[str, dict[str, str]]:
    """importing module -> {imported module: where}, every import of one of our modules by another
    (`from a import b` is an import of a.b where b is a module, of a otherwise; the packages above
    a module are Python's, not an edge)."""
    found = modules()
    graph: dict[str, dict[str, str]] = {name: {} for name in found}
    for module in found.values():
        for imp in imports(module):
            if not ours(imp.target):
                continue
            targets = [f"{imp.target}.{n}" for n in imp.names if f"{imp.target}.{n}" in found]
            if len(targets) < len(imp.names) or not imp.names:
                target = imp.target
                while target and target not in found:
                    target = target.rpartition(".")[0]
                targets.append(target)
            for target in targets:
                if target and target != module.name:
                    graph[module.name].setdefault(target, module.where(imp.node))
    return graph


def test_no_import_circle_between_modules():
    graph = module_imports()
    for a, b in CLOSES_A_CIRCLE:
        graph[a].pop(b, None)
    state: dict[str, int] = {}  # 1: on the path, 2: done
    circles = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for nxt in sorted(graph[name]):
            if state.get(nxt) == 1:
                circle = path[path.index(nxt):] + [nxt]
                circles.append(" -> ".join(circle) + "\n  " + "\n  ".join(
                    f"{graph[x][y]} imports {y}" for x, y in zip(circle, circle[1:])))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not circles, "import circles (lazy imports count; move what closes one to where it belongs):\n" + \
        "\n".join(circles)


def test_the_circles_listed_are_still_there():
    """Each listed import still exists: the list does not outlive its reasons."""
    graph = module_imports()
    gone = [f"{a} -> {b}" for a, b in CLOSES_A_CIRCLE if b not in graph[a]]
    assert not gone, "no longer imported (remove from CLOSES_A_CIRCLE):\n" + "\n".join(gone)


# The layers: the CLI on top (argparse's commands, and the programs beside them), the operator
# beside the CLI, the library below both. A flag list becomes settings through the options
# models (moe_proxy.options.parse_flags, rl.run_options.repro_settings), never through a command.
CLI = ("moe_proxy.cli", "moe_proxy.__main__", "moe_proxy.commands", "moe_proxy.demo")


def layer(name: str) -> str:
    if any(name == top or name.startswith(top + ".") for top in CLI):
        return "cli"
    return "operator" if name.split(".")[0] == "proxymodel_operator" else "library"


def test_the_library_imports_no_command_and_the_operator_none_either():
    """No library module imports the CLI or the operator, and the operator no CLI module: every
    import counts, lazy ones included (`importlib.import_module` of a command too)."""
    bad = []
    for module in modules().values():
        here = layer(module.name)
        if here == "cli":
            continue
        for imp in imports(module):
            targets = [imp.target, *(f"{imp.target}.{n}" for n in imp.names)]
            if any(layer(t) == "cli" or (here == "library" and layer(t) == "operator") for t in targets if ours(t)):
                bad.append(f"{module.where(imp.node)}: {here} imports {imp.target}")
        for node in ast.walk(module.tree):  # importlib.import_module(f"moe_proxy.commands.{name}")
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    node.value.startswith("moe_proxy.commands.") and module.name != "moe_proxy":
                bad.append(f"{module.where(node)}: {here} names the command module {node.value!r}")
            if isinstance(node, ast.JoinedStr) and any(isinstance(v, ast.Constant) and "moe_proxy.commands" in v.value
                                                      for v in node.values):
                bad.append(f"{module.where(node)}: {here} builds a command module's name")
    assert not bad, "imports up the layers (the library below the CLI and the operator):\n" + "\n".join(bad)
