"""The project's own modules, parsed: what the house tests read instead of importing them."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = (REPO / "src", REPO / "operator")  # source roots: the importable packages live inside
PACKAGES = ("moe_proxy", "proxymodel_operator")


@dataclass(frozen=True)
class Module:
    name: str  # dotted: moe_proxy.pruning.heal
    path: Path
    tree: ast.Module

    @property
    def package(self) -> str:
        """The package relative imports start from."""
        return self.name if self.path.name == "__init__.py" else self.name.rpartition(".")[0]

    def where(self, node: ast.AST) -> str:
        return f"{self.path.relative_to(REPO)}:{node.lineno}"


@cache
def modules() -> dict[str, Module]:
    out = {}
    for root in ROOTS:
        for package in PACKAGES:
            for path in sorted((root / package).rglob("*.py")):
                parts = path.relative_to(root).with_suffix("").parts
                name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
                out[name] = Module(name, path, ast.parse(path.read_text(), str(path)))
    return out


@dataclass(frozen=True)
class Import:
    module: Module  # the importing module
    node: ast.Import | ast.ImportFrom
    target: str  # the module imported from (absolute), or imported
    names: tuple[str, ...]  # the names taken from it (`from target import a, b`); () for `import target`
    top: bool  # at module level (also under `if TYPE_CHECKING:` or `try:`), not inside a function


def imports(module: Module) -> list[Import]:
    """Every import statement of `module`, relative ones resolved."""
    out: list[Import] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                out.extend(Import(module, child, a.name, (), top) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                target = child.module or ""
                if child.level:
                    base = module.package.split(".")
                    base = base[: len(base) - child.level + 1]
                    target = ".".join(base + ([child.module] if child.module else []))
                out.append(Import(module, child, target, tuple(a.name for a in child.names), top))
            else:
                inner = not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                visit(child, top and inner)

    visit(module.tree, True)
    return out


def private(name: str) -> bool:
    """`_name`, not `__dunder__`."""
    return name.startswith("_") and not name.startswith("__")
