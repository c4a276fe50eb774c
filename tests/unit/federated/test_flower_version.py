"""The Flower release installed is the one pyproject.toml declares, and the declaration admits no untested release.

pyproject.toml pins ``flwr`` to one minor release (in the ``federated`` extra and in ``dev``): the library uses parts of
Flower that minor releases change (the legacy SecAgg+ workflow, the Grid and Message API, the deployment runtime), so
the range is the release the federated tests run on. Widening it means installing the new release and running them.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

try:
    import tomllib
except ImportError:  # Python 3.10: Flower installs tomli
    import tomli as tomllib  # type: ignore[no-redef]

pytest.importorskip("flwr")

PYPROJECT = Path(__file__).parents[3] / "pyproject.toml"


def _declared() -> list[Requirement]:
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    return [Requirement(line) for group in ("federated", "dev") for line in extras[group] if line.startswith("flwr")]


def test_the_installed_flower_is_in_the_declared_range_and_the_range_is_one_tested_release() -> None:
    declared = _declared()
    assert len(declared) == 2 and declared[0] == declared[1], [str(r) for r in declared]  # one range, in both extras
    specifier = declared[0].specifier
    installed = Version(importlib.metadata.version("flwr"))
    assert specifier.contains(installed), (
        f"flwr {installed} is installed, pyproject.toml declares flwr{specifier}. HINT: install a declared release "
        "(pip install -e '.[federated]'), or run the federated tests on this one before widening the range."
    )
    # Nothing past the installed minor release is admitted: the range is what the tests run on.
    major, minor = installed.release[:2]
    assert not specifier.contains(Version(f"{major}.{minor + 1}")) and not specifier.contains(Version(f"{major + 1}"))
