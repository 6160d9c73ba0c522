"""The declared dependencies cover every import: what a fresh ``pip install`` brings is enough.

- ``rope_lie/`` and ``configs/`` (the main job) need only the core install, ``pip install -e .``;
- ``tests/``, and the first-party modules they import (``experiments/...``), need only
  ``pip install -e ".[test]"``.

An import counts as covered when the distribution that provides it is *declared directly* in
``pyproject.toml`` (core ``dependencies``, plus the ``test`` extra for the tests), not merely
pulled in by another package: a transitive dependency can disappear with any upstream release.
Imports inside functions (run only when called) may also come from any declared extra, e.g.
PyTorch for the benchmarks; imports at module level (what runs at import time, class bodies,
``try`` blocks included) may not.

This guard exists because ``rope_lie/metrics.py`` once imported ``tensorboardX`` at the top while
only the ``experiments`` extra declared it: the main job failed on every fresh machine, and CI
stayed green on a machine that had it installed by hand.
"""

from __future__ import annotations

import ast
import pathlib
import re
import sys
import tomllib
from importlib import metadata

import pytest
from packaging.requirements import Requirement

REPO = pathlib.Path(__file__).resolve().parent.parent
FIRST_PARTY = {"rope_lie", "configs", "experiments", "tests"}


def _norm(name: str) -> str:
    """PEP 503 normalised distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(pyproject: dict, extras: tuple[str, ...] = ()) -> set[str]:
    """Normalised names of the distributions declared directly for the core install plus
    `extras`, keeping only those whose environment marker holds on this machine."""
    project = pyproject["project"]
    lines = list(project.get("dependencies", []))
    for extra in extras:
        lines += project.get("optional-dependencies", {})[extra]
    names = set()
    for line in lines:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            names.add(_norm(req.name))
    return names


def import_sites(path: pathlib.Path) -> list[tuple[str, int, bool]]:
    """(top-level module, line, at_import_time) for every absolute import in a file.

    ``at_import_time`` is False inside function bodies and ``if TYPE_CHECKING:`` blocks.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    sites = []

    def visit(node: ast.AST, eager: bool) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            eager = False
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            eager = False
        if isinstance(node, ast.Import):
            sites.extend((a.name.split(".")[0], node.lineno, eager) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            sites.append((node.module.split(".")[0], node.lineno, eager))
        for child in ast.iter_child_nodes(node):
            visit(child, eager)

    visit(tree, True)
    return sites


def first_party_file(module: str) -> pathlib.Path | None:
    """The repository file of a dotted first-party module name, if there is one."""
    base = REPO.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_modules(path: pathlib.Path) -> list[str]:
    """Dotted names of the absolute imports of a file (``from a import b`` gives a and a.b)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return names


def with_first_party_imports(files: list[pathlib.Path], outside: set[str]) -> list[pathlib.Path]:
    """`files` plus the first-party files of the top-level packages `outside` that they import,
    transitively (e.g. the benchmark helpers that tests import from experiments/)."""
    seen, todo = set(files), list(files)
    while todo:
        for name in imported_modules(todo.pop()):
            if name.split(".")[0] in outside:
                found = first_party_file(name)
                if found is not None and found not in seen:
                    seen.add(found)
                    todo.append(found)
    return sorted(seen)


def undeclared(files: list[pathlib.Path], allowed: set[str], allowed_lazily: set[str]) -> list[str]:
    """Third-party imports not provided by a distribution in `allowed` (`allowed_lazily` for
    imports inside functions), as 'module (file:line): why' strings."""
    providers = metadata.packages_distributions()
    problems = []
    for path in files:
        for module, line, eager in import_sites(path):
            if module in sys.stdlib_module_names or module in FIRST_PARTY or module == "__future__":
                continue
            ok = allowed if eager else allowed | allowed_lazily
            owners = {_norm(d) for d in providers.get(module, [])}
            if not owners and not eager and _norm(module) in allowed_lazily:
                continue  # an extra that is not installed here, named like its module (torch)
            where = f"{module} ({path.relative_to(REPO)}:{line})"
            if not owners:
                problems.append(f"{where}: no installed distribution provides it")
            elif not owners & ok:
                when = "at import time" if eager else "when called"
                problems.append(
                    f"{where}: provided by {sorted(owners)}, which the install that runs this "
                    f"{when} does not declare"
                )
    return problems


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _py(*folders: str) -> list[pathlib.Path]:
    return sorted(p for f in folders for p in (REPO / f).rglob("*.py"))


def test_package_and_recipes_need_only_the_core_install(pyproject):
    every_extra = declared(pyproject, tuple(pyproject["project"]["optional-dependencies"]))
    problems = undeclared(_py("rope_lie", "configs"), declared(pyproject), every_extra)
    assert not problems, "\n".join(problems)


def test_tests_need_only_the_test_extra(pyproject):
    every_extra = declared(pyproject, tuple(pyproject["project"]["optional-dependencies"]))
    files = with_first_party_imports(_py("tests"), outside={"experiments"})
    assert any("experiments" in p.parts for p in files)  # the benchmark helpers are followed
    problems = undeclared(files, declared(pyproject, ("test",)), every_extra)
    assert not problems, "\n".join(problems)


def test_the_guard_names_an_undeclared_import_and_its_file(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    source = tmp_path / "mod.py"
    source.write_text(
        "import numpy\n"
        "import pytest\n"  # installed, but only by the test extra
        "import surely_not_installed_xyz\n"
        "def later():\n"
        "    import pytest\n"  # lazily: allowed from another install
        "    import torch\n"  # lazily, from an extra that is not installed here
    )
    problems = undeclared([source], allowed={"numpy"}, allowed_lazily={"pytest", "torch"})
    assert len(problems) == 2, problems
    assert problems[0].startswith("pytest (mod.py:2): provided by ['pytest']")
    assert problems[1].startswith("surely_not_installed_xyz (mod.py:3): no installed")


def test_markers_and_extras_are_read_from_pyproject():
    pyproject = {
        "project": {
            "dependencies": ["numpy>=1", "pywin32; sys_platform == 'nonexistent'"],
            "optional-dependencies": {"test": ["pytest>=8"]},
        }
    }
    assert declared(pyproject) == {"numpy"}
    assert declared(pyproject, ("test",)) == {"numpy", "pytest"}
