"""The dependency direction of the repository (docs/architecture.md): stages -> orchestration ->
posttrain, and data_recipes (the shipped data) -> posttrain. posttrain imports data_recipes in one
place, the plain import of its built-ins in posttrain.registry.load_plugins, and orchestration
only for its command-line front; orchestration reaches the shipped data through that loader;
data_recipes never imports orchestration. The `posttrain.plugins` entry points are for third-party
packages only: posttrain lists none of its own (tests/test_plugins.py runs a third party's).

Imports are read from the source with `ast` (function-level imports and `importlib.import_module`
/ `__import__` calls with a literal name included), so a lazy import cannot slip past.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PLUGINS = ("data_recipes",)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module name) of every absolute import in a Python file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif (
            isinstance(node, ast.Call)
            and _called_name(node.func) in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value))
    return found


def _called_name(func: ast.expr) -> str:
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


# `posttrain run` is the user's entry into orchestration: the CLI sits above it, whatever its folder.
CLI = REPO / "posttrain" / "cli.py"
# The one place posttrain imports its shipped data package.
REGISTRY = REPO / "posttrain" / "registry.py"


def imports_of(package: str, forbidden: tuple[str, ...], skip: tuple[Path, ...] = ()) -> list[str]:
    """'file:line imports module' for every import in `package` of a top-level package in `forbidden`."""
    offences = []
    for path in sorted(p for p in (REPO / package).rglob("*.py") if p not in skip):
        for line, module in imported_modules(path):
            if module.split(".")[0] in forbidden:
                offences.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    return offences


def test_the_import_reader_sees_eager_lazy_and_importlib_imports(tmp_path):
    source = tmp_path / "probe.py"
    source.write_text(
        "import os.path\nfrom rewards.budget import x\n"
        "def f():\n    import teachers\n    importlib.import_module('data_recipes.recipes')\n"
        "from . import sibling\n"
    )
    assert imported_modules(source) == [
        (1, "os.path"),
        (2, "rewards.budget"),
        (4, "teachers"),
        (5, "data_recipes.recipes"),
    ]
    # and it finds the real edges of this repository, so an empty result below means something
    assert imports_of("orchestration", ("posttrain",))
    assert imports_of("data_recipes", ("posttrain",))


def test_posttrain_imports_the_shipped_data_only_in_its_plugin_loader_and_not_orchestration():
    assert imports_of("posttrain", PLUGINS, skip=(REGISTRY,)) == []
    assert [line.split(" imports ")[1] for line in imports_of("posttrain", PLUGINS)] == ["data_recipes"]
    assert imports_of("posttrain", ("orchestration",), skip=(CLI,)) == []


def test_orchestration_reaches_plugins_only_through_posttrain():
    assert imports_of("orchestration", PLUGINS) == []


def test_plugins_never_import_orchestration():
    for package in PLUGINS:
        assert imports_of(package, ("orchestration",)) == [], package


def test_posttrain_lists_none_of_its_own_packages_as_entry_points():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "posttrain.plugins" not in pyproject["project"].get("entry-points", {})
