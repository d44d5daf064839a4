"""One meaning per name, read from the source with `ast`: no class name is defined in two
modules of moe_proxy and proxymodel_operator, and no public module constant (an UPPER_CASE
name assigned at module level) either, but for the pairs in KNOWN. A second definition is
either the same thing (import it from where it lives) or another thing (give it its own name)."""

from __future__ import annotations

import ast
from collections import defaultdict
from fnmatch import fnmatch

from .sources import REPO, modules

KNOWN = {  # constant -> why it is still defined twice (remove the entry when it is not)
    "SIGNATURES": "metrics/detect.py's detected signatures, and the operator spec's accepted ones (those and "
                  "`threshold`): both files are being reworked into the options model",
    "FAILED": "a workload's outcome (outcome.py) and a ProxyModel's phase (status.py, imported as PHASE_FAILED)",
}


def definitions(kind) -> dict[str, list[str]]:
    where: dict[str, list[str]] = defaultdict(list)
    for module in modules().values():
        for name, node in kind(module.tree):
            where[name].append(module.where(node))
    return where


def classes(tree: ast.Module):
    return [(node.name, node) for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]


def constants(tree: ast.Module):
    out = []
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        value = getattr(node, "value", None)
        if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "TypeVar":
            continue
        out += [(n.id, node) for t in targets for n in ast.walk(t)
                if isinstance(n, ast.Name) and n.id.isupper() and not n.id.startswith("_")]
    return out


def test_no_class_name_is_defined_twice():
    twice = {name: where for name, where in definitions(classes).items() if len(where) > 1}
    assert not twice, "classes defined in more than one module:\n" + \
        "\n".join(f"{name}: {', '.join(where)}" for name, where in sorted(twice.items()))


def test_no_module_constant_is_defined_twice():
    twice = {name: where for name, where in definitions(constants).items() if len(where) > 1 and name not in KNOWN}
    assert not twice, "module constants defined in more than one module:\n" + \
        "\n".join(f"{name}: {', '.join(where)}" for name, where in sorted(twice.items()))


def test_the_known_pairs_are_still_there():
    """KNOWN does not outlive its entries."""
    where = definitions(constants)
    assert all(len(where.get(name, [])) > 1 for name in KNOWN), {n: where.get(n) for n in KNOWN}


# Names that had two or three meanings (#25) and were renamed: the word -> what it means now.
RETIRED_MODULES = {
    "pipeline": "the operator's ProxyModel steps only (proxymodel_operator.pipeline); the build's "
                "streaming is moe_proxy.pruning.steps (run by moe_proxy.pruning.build)",
    "describe": "gone: checkpoint.summary (inspect), pruning.fidelity.figure_lines, pruning.merge.merge_record",
    "watch_plan": "proxymodel_operator.watch_decisions: `plan` is the sizing of devices and ExpertPlan",
}


def test_renamed_names_keep_one_meaning():
    stems = defaultdict(list)  # every module of each stem: a retired one beside the keeper is found
    for name in modules():
        stems[name.rpartition(".")[2]].append(name)
    assert stems["pipeline"] == ["proxymodel_operator.pipeline"], RETIRED_MODULES["pipeline"]
    assert not stems["describe"] and not stems["watch_plan"], RETIRED_MODULES
    functions = {node.name for m in modules().values() for node in m.tree.body
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    assert "describe" not in functions, RETIRED_MODULES["describe"]
    # "transformer" is the operator's build Job (spec.transformer, its image, its container),
    # not a source folder: the library lives in src/.
    from .sources import REPO

    assert not (REPO / "transformer").exists() and (REPO / "src" / "moe_proxy" / "__init__.py").is_file()


def test_every_test_folder_is_collected(pytestconfig):
    """pytest does not descend into folders matching its norecursedirs (by default build, dist,
    venv, ...): tests there would silently never run (tests/build did, for a while)."""
    skipped = pytestconfig.getini("norecursedirs")  # the patterns this run of pytest uses
    folders = {p.name for p in (REPO / "tests").iterdir() if p.is_dir() and any(p.rglob("test_*.py"))}
    never = sorted(f for f in folders if any(fnmatch(f, pattern) for pattern in skipped))
    assert not never, f"rename tests/{never[0]}: pytest never collects it (norecursedirs {skipped})"


def test_the_librarys_errors_live_in_errors_py():
    """Every error moe_proxy raises for bad input (a MoeProxyError, directly or not) is defined
    in moe_proxy/errors.py, where a caller finds them all; the operator keeps its own."""
    errors = modules()["moe_proxy.errors"]
    ours = {"MoeProxyError"} | {name for name, _ in classes(errors.tree)}
    elsewhere = [module.where(node) + f" {node.name}" for name, module in modules().items()
                 if name.startswith("moe_proxy.") and module is not errors
                 for _, node in classes(module.tree)
                 if any(getattr(base, "id", getattr(base, "attr", None)) in ours for base in node.bases)]
    assert not elsewhere, f"errors defined outside moe_proxy/errors.py: {elsewhere}"
