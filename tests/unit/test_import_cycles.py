"""No module of the package imports a module that imports it back (issue 41, "Smaller": the privacy review found four
import circles: ``cli`` ↔ ``audit.cli``, the two datamodules ↔ the synthetic datamodules, ``tuning.search`` ↔
``tuning.trial``).

Counted as the review counts them: module A imports module B if any ``import`` statement of A names B, at module
level, inside a function or under ``if TYPE_CHECKING``; ``from package import name`` where ``name`` is a submodule
imports that submodule. A circle is a strongly connected set of two or more modules. The docs test
(``tests/docs/test_rooms_map.py``) holds the rooms to the map; this one holds the modules to having no circle.

Run as a script (``python tests/unit/test_import_cycles.py``) it prints the circles it finds.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lightning_dp"

#: Circles being broken elsewhere, by name (none: the tuning pair was broken by ``tuning/outcome.py``).
ALLOWED: set[frozenset[str]] = set()


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool, modules: set[str]) -> set[str]:
    """The package's modules one import statement of ``importer`` names."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in modules}
    if node.level:
        base = importer.split(".") if is_package else importer.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    found = set()
    for alias in node.names:
        submodule = f"{source}.{alias.name}"
        if submodule in modules:
            found.add(submodule)
        elif source in modules:
            found.add(source)
    return found


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module → the package's modules it imports anywhere in its source (itself left out)."""
    root = package.parent
    paths = {_module_name(path, root): path for path in package.rglob("*.py")}
    modules = set(paths)
    graph = {}
    for name, path in paths.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                targets |= _imported(node, name, path.name == "__init__.py", modules)
        graph[name] = targets - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected sets of two or more modules (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph.get(successor, ())))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(frozenset(component))
    return found


def test_the_package_has_no_import_circle() -> None:
    found = [sorted(circle) for circle in cycles(import_graph()) if circle not in ALLOWED]
    assert found == [], (
        f"import circles (move what both modules need into a module they both import, re-exporting it): {found}"
    )


def test_the_scan_sees_lazy_relative_and_submodule_imports(tmp_path: Path) -> None:
    """Each way of importing closes a circle: a lazy import, a relative one, ``from package import submodule``."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from pkg.b import g\n")
    (package / "b.py").write_text("from .a import f\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "c.py").write_text("from pkg import d\n")
    (package / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub.c import x\n")
    (package / "e.py").write_text("from pkg import a\n")
    graph = import_graph(package)
    assert graph["pkg.e"] == {"pkg.a"}
    assert sorted(map(sorted, cycles(graph))) == [["pkg.a", "pkg.b"], ["pkg.d", "pkg.sub.c"]]


if __name__ == "__main__":
    root = Path(sys.argv[1]).resolve() / "lightning_dp" if len(sys.argv) > 1 else PACKAGE
    for circle in cycles(import_graph(root)):
        print(" <-> ".join(sorted(circle)) + ("   (allowed: being fixed elsewhere)" if circle in ALLOWED else ""))
