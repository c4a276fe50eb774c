"""docs/development.md's map of the rooms matches the code: every room of the package is on it, and every
module-level import goes to a room above the importer (or one the importer's row names as an exception).

The map is what a newcomer reads to know where code goes and what it may import; a room added without a row, or
an import that points down the list, makes it wrong without anyone noticing. Imports inside functions (lazy ones)
and under ``if TYPE_CHECKING`` are not dependencies of a room's logic, and are left out, as the page says.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lightning_dp"
PAGE = ROOT / "docs" / "development.md"


def _room_of(name: str) -> str:
    """`lightning_dp.x.y` → `x` (a folder) or `x.py` (a module at the top)."""
    first = name.split(".")[1]
    return first if (PACKAGE / first).is_dir() else f"{first}.py"


def _map() -> tuple[list[tuple[set[str], set[str]]], dict[str, str]]:
    """The page's table as rows of (rooms, names in the imports cell), top first; the old paths' aliases."""
    text = PAGE.read_text()
    section = text.split("## Rooms: what lives where", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("| `") or len(cells) != 3:
            continue
        rooms = {name.rstrip("/") for name in re.findall(r"`([^`]+)`", cells[0])}
        named = set(re.findall(r"[A-Za-z_]+(?:\.py)?", cells[2]))
        rows.append((rooms, named | {n.removesuffix(".py") for n in named}))
    aliases = dict(re.findall(r"`([a-z_]+)/` → `([a-z_]+)/`", section))
    return rows, aliases


def _module_level_imports(path: Path) -> set[str]:
    """The lightning_dp modules ``path`` imports at module level, outside ``if TYPE_CHECKING``."""
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("lightning_dp."):
            found.add(node.module)  # type: ignore[arg-type]
        elif isinstance(node, ast.ImportFrom) and node.module == "lightning_dp":
            found.update(f"lightning_dp.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("lightning_dp."))
    return found


def _edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE)
        if relative == Path("__init__.py"):
            continue  # the package's face re-exports from everywhere
        source = relative.parts[0] if len(relative.parts) > 1 else relative.name
        targets = {_room_of(name) for name in _module_level_imports(path)} - {source}
        edges.setdefault(source, set()).update(targets)
    return edges


def _key(room: str) -> str:
    return room.removesuffix(".py")


def test_every_room_of_the_package_has_a_row_or_is_a_named_alias() -> None:
    rows, aliases = _map()
    mapped = {_key(room) for rooms, _ in rows for room in rooms} | set(aliases)
    rooms = {_key(p.name) for p in PACKAGE.iterdir() if (p.is_dir() and (p / "__init__.py").is_file())}
    rooms |= {_key(p.name) for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    assert len(rows) >= 10, "the rooms table was not found on docs/development.md"
    assert rooms - mapped == set(), "rooms missing from docs/development.md's map: add a row that says what they hold"
    assert mapped - rooms == set(), "rows of docs/development.md's map name rooms that no longer exist"


def test_every_module_level_import_goes_up_the_map_or_is_named_on_its_row() -> None:
    rows, aliases = _map()
    rank = {_key(room): i for i, (rooms, _) in enumerate(rows) for room in rooms}
    wrong = []
    for source, targets in sorted(_edges().items()):
        if _key(source) in aliases:  # an old path re-exports its new room, and nothing else
            wrong += [f"{source} (alias of {aliases[_key(source)]}) → {t}" for t in targets if t != aliases[source]]
            continue
        i = rank[_key(source)]
        named = rows[i][1]
        for target in sorted(targets):
            if rank[_key(target)] > i and _key(target) not in named:
                wrong.append(f"{source} → {target}")
    assert wrong == [], f"imports that point down docs/development.md's map (move the code, or name it there): {wrong}"


def test_the_check_sees_a_downward_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The import scan finds an import at module level and ignores lazy and type-checking ones."""
    module = tmp_path / "m.py"
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "from lightning_dp.accounting import PrivacyLedger\n"
        "import lightning_dp.errors\n"
        "from lightning_dp import epsilon\n"
        "if TYPE_CHECKING:\n    from lightning_dp.callbacks import DPSGD\n"
        "def f():\n    from lightning_dp.tuning import tune\n"
    )
    found = _module_level_imports(module)
    assert found == {"lightning_dp.accounting", "lightning_dp.errors", "lightning_dp.epsilon"}
    assert {_room_of(name) for name in found} == {"accounting", "errors.py", "epsilon.py"}
