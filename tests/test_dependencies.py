"""The declared dependencies cover every import: what a fresh ``pip install`` brings is enough.

- the encoders (``rope_lie/encodings/``, the package's ``__init__`` and ``rope_lie/demo.py``,
  and every first-party module they import) need only the core install, ``pip install rope_lie``
  (jax, numpy, chex);
- the rest of ``rope_lie/`` and ``configs/`` (the main job) need only
  ``pip install -e ".[train]"``;
- ``tests/``, and the first-party modules they import (``experiments/...``), need only
  ``pip install -e ".[test]"`` (which includes ``train``).

An import counts as covered when the distribution that provides it is *declared directly* in
``pyproject.toml`` (core ``dependencies``, plus the extras of that install; an extra may name
another, as ``rope_lie[train]``), not merely pulled in by another package: a transitive
dependency can disappear with any upstream release.
Imports inside functions (run only when called) may also come from any declared extra, e.g.
PyTorch for the benchmarks; imports at module level (what runs at import time, class bodies,
``try`` blocks included) may not.

This guard exists because ``rope_lie/metrics.py`` once imported ``tensorboardX`` at the top while
only the ``experiments`` extra declared it: the main job failed on every fresh machine, and CI
stayed green on a machine that had it installed by hand.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import tomllib
from importlib import metadata

import pytest
from packaging.requirements import Requirement

from rope_lie import _extras

REPO = pathlib.Path(__file__).resolve().parent.parent
FIRST_PARTY = {"rope_lie", "configs", "experiments", "tests"}


def _norm(name: str) -> str:
    """PEP 503 normalised distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(pyproject: dict, extras: tuple[str, ...] = ()) -> set[str]:
    """Normalised names of the distributions declared directly for the core install plus
    `extras`, keeping only those whose environment marker holds on this machine."""
    project = pyproject["project"]
    lines, todo, seen = list(project.get("dependencies", [])), list(extras), set()
    names = set()
    while lines or todo:
        if not lines:
            extra = todo.pop()
            if extra not in seen:
                seen.add(extra)
                lines += project.get("optional-dependencies", {})[extra]
            continue
        req = Requirement(lines.pop())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if _norm(req.name) == _norm(project["name"]):  # an extra naming others: rope_lie[train]
            todo += sorted(req.extras)
        else:
            names.add(_norm(req.name))
    return names


@functools.cache
def _parse(source: str, filename: str) -> ast.Module:
    """``ast.parse``, once per source text: the guards below read the same files again."""
    return ast.parse(source, filename=filename)


@functools.cache
def _providers() -> dict[str, list[str]]:
    """``metadata.packages_distributions()``, read once: it lists every installed
    distribution's files (~0.2 s a call), and nothing installs a package during the tests."""
    return metadata.packages_distributions()


def import_sites(path: pathlib.Path) -> list[tuple[str, int, bool]]:
    """(top-level module, line, at_import_time) for every absolute import in a file.

    ``at_import_time`` is False inside function bodies and ``if TYPE_CHECKING:`` blocks.
    """
    tree = _parse(path.read_text(), str(path))
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


def imported_modules(path: pathlib.Path, eager_only: bool = False) -> list[str]:
    """Dotted names of the absolute imports of a file (``from a import b`` gives a and a.b);
    with ``eager_only``, only those run at import time (not inside functions or ``if
    TYPE_CHECKING:``, as ``import_sites`` tells them apart)."""
    names = []

    def visit(node: ast.AST, eager: bool) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            eager = False
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            eager = False
        if eager or not eager_only:
            if isinstance(node, ast.Import):
                names.extend(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.extend([node.module] + [f"{node.module}.{a.name}" for a in node.names])
        for child in ast.iter_child_nodes(node):
            visit(child, eager)

    visit(_parse(path.read_text(), str(path)), True)
    return names


def with_first_party_imports(
    files: list[pathlib.Path], outside: set[str], eager_only: bool = False
) -> list[pathlib.Path]:
    """`files` plus the first-party files of the top-level packages `outside` that they import,
    transitively (e.g. the benchmark helpers that tests import from experiments/); with
    ``eager_only``, following only the imports that run when a module is imported."""
    seen, todo = set(files), list(files)
    while todo:
        for name in imported_modules(todo.pop(), eager_only):
            if name.split(".")[0] in outside:
                found = first_party_file(name)
                if found is not None and found not in seen:
                    seen.add(found)
                    todo.append(found)
    return sorted(seen)


def undeclared(files: list[pathlib.Path], allowed: set[str], allowed_lazily: set[str]) -> list[str]:
    """Third-party imports not provided by a distribution in `allowed` (`allowed_lazily` for
    imports inside functions), as 'module (file:line): why' strings."""
    providers = _providers()
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


CORE = ("rope_lie/__init__.py", "rope_lie/_extras.py", "rope_lie/demo.py", "rope_lie/encodings")


def _core_files() -> list[pathlib.Path]:
    return sorted(
        p for c in CORE for p in ([REPO / c] if c.endswith(".py") else (REPO / c).rglob("*.py"))
    )


def test_encoders_need_only_the_core_install(pyproject):
    every_extra = declared(pyproject, tuple(pyproject["project"]["optional-dependencies"]))
    core = _core_files()
    assert REPO / "rope_lie/encodings/liere.py" in core
    problems = undeclared(core, declared(pyproject), every_extra)
    assert not problems, "\n".join(problems)


def test_encoders_import_no_first_party_module_outside_the_core():
    """Importing the core imports nothing of the training stack (``rope_lie.load`` imports it
    when called: a lazy import, as the subprocess test below checks for real)."""
    core = _core_files()
    eager = with_first_party_imports(core, {"rope_lie"}, eager_only=True)
    outside = [p for p in eager if p not in core]
    assert not outside, f"the core imports {[str(p.relative_to(REPO)) for p in outside]}"


def test_package_and_recipes_need_only_the_train_extra(pyproject):
    every_extra = declared(pyproject, tuple(pyproject["project"]["optional-dependencies"]))
    allowed = declared(pyproject, ("train",))
    assert "flax" in allowed and "flax" not in declared(pyproject)
    problems = undeclared(_py("rope_lie", "configs"), allowed, every_extra)
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
            "optional-dependencies": {"train": ["flax"], "test": ["rope_lie[train]", "pytest>=8"]},
            "name": "rope_lie",
        }
    }
    assert declared(pyproject) == {"numpy"}
    assert declared(pyproject, ("train",)) == {"numpy", "flax"}
    assert declared(pyproject, ("test",)) == {"numpy", "flax", "pytest"}


# Run in a fresh interpreter whose import system refuses every module of the train extra: what a
# user with only the core install (`pip install rope_lie`) gets. Every rotary family and ALiBi
# is initialised and applied once, and the demo's per-family check runs.
_CORE_ONLY = """
import functools, importlib.abc, sys
BLOCKED = set(sys.argv[1].split(","))
assert not BLOCKED & set(sys.modules), sorted(BLOCKED & set(sys.modules))

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"{name}: not part of the core install", name=name)
        return None

sys.meta_path.insert(0, Refuse())
import jax, jax.numpy as jnp, numpy as np
import rope_lie
from rope_lie import demo, encodings
from rope_lie.encodings import positions

pos_TA = positions.grid_positions((2, 3), "integer", num_prefix=1)
x_BTNH = jax.random.normal(jax.random.key(0), (1, pos_TA.shape[0], 2, 8))

def norms(module, x_BTNH, pos_TA):  # one program per family, not dozens of single ops
    params = module.init(jax.random.key(1), num_heads=2, head_dim=8, num_axes=pos_TA.shape[1])
    return jnp.linalg.norm(module.apply(params, x_BTNH, pos_TA), axis=-1)

for name, module in encodings.ROTARY.items():
    pos = pos_TA[:, :1] if name == "rope" else pos_TA  # rope is 1D only
    got = jax.jit(functools.partial(norms, module))(x_BTNH, pos)
    np.testing.assert_allclose(got, jnp.linalg.norm(x_BTNH, axis=-1), rtol=1e-5, err_msg=name)
alibi = encodings.BIAS["alibi"]
params = alibi.init(jax.random.key(2), num_heads=2, head_dim=8, num_axes=2)
assert alibi.bias(params, pos_TA, pos_TA, num_heads=2, num_prefix=1).shape == (2, 7, 7)
assert demo.check_rotary("rope_axial", {})["shift_err"] < 1e-5
print("loaded:", sorted(BLOCKED & set(sys.modules)))
"""


def _train_only_modules(pyproject: dict) -> set[str]:
    """Top-level modules installed here by the distributions of the train extra that the core
    does not declare (flax, optax, orbax, tensorflow, ...)."""
    train_only = declared(pyproject, ("train",)) - declared(pyproject)
    providers = _providers()
    return {m for m, dists in providers.items() if {_norm(d) for d in dists} & train_only}


def test_encoders_import_and_run_without_the_train_extra(pyproject):
    blocked = _train_only_modules(pyproject)
    assert {"flax", "optax", "orbax", "tensorflow", "tensorflow_datasets", "sklearn"} <= blocked
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, "-c", _CORE_ONLY, ",".join(sorted(blocked))],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("loaded: []"), result.stdout


_CORE_MODULES = ("jax", "jaxlib", "numpy", "chex")


def test_the_extras_modules_are_the_train_extras():
    """``rope_lie._extras.TRAIN_MODULES`` (what the one-line "install rope_lie[train]" errors
    recognise) holds every module of the train extra that the package and recipes import, and
    only modules that the train extra's distributions provide."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    train_only = _train_only_modules(pyproject)
    imported = {m for p in _py("rope_lie", "configs") for m, _, _ in import_sites(p)}
    assert {"flax", "ml_collections", "tensorflow"} <= imported & train_only
    assert imported & train_only <= _extras.TRAIN_MODULES, imported & train_only
    installed = {m for m in _extras.TRAIN_MODULES if importlib.util.find_spec(m) is not None}
    assert installed <= train_only, installed - train_only
    assert not _extras.TRAIN_MODULES & set(_CORE_MODULES)


# What a core install lacks (the train extra's main modules), refused by the import system of a
# fresh interpreter (`_RUN_CORE_ONLY`) that then runs `-m MODULE ARGS...` or `-c CODE`.
BLOCKED = ("flax", "ml_collections", "tensorflow", "tensorflow_datasets", "optax", "orbax")
_RUN_CORE_ONLY = """
import importlib.abc, runpy, sys
BLOCKED = set(sys.argv[1].split(","))

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Refuse())
how, target, *args = sys.argv[2:]
sys.argv = [target, *args]
if how == "-m":
    runpy.run_module(target, run_name="__main__", alter_sys=True)
else:
    exec(compile(target, "<core-only>", "exec"))
"""
_TRAIN_HINT = r'pip install "rope_lie\[train\]" \(pip install -e "\.\[train\]" in a clone\)'


def _core_only(how: str, target: str, *args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    command = [sys.executable, "-c", _RUN_CORE_ONLY, ",".join(BLOCKED), how, target]
    return subprocess.run(
        command + list(args), env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("args", [("--help",), ("--config=quickstart:smoke", "--workdir=x")])
def test_core_only_main_says_in_one_line_to_install_the_train_extra(args):
    result = _core_only("-m", "rope_lie.main", *args)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stdout == ""
    assert re.fullmatch(
        r"error: python -m rope_lie\.main needs the train extra, which is not installed "
        rf"\(no module named '({'|'.join(BLOCKED)})'\): {_TRAIN_HINT}\n",
        result.stderr,
    ), result.stderr[-3000:]


def test_core_only_convert_says_in_one_line_to_install_the_interop_extra():
    result = _core_only("-m", "rope_lie.convert", "--help")
    assert result.returncode == 2, result.stderr[-3000:]
    assert re.fullmatch(
        r"error: python -m rope_lie\.convert needs the interop extra, which is not installed "
        rf"\(no module named '({'|'.join(BLOCKED)})'\): "
        r'pip install "rope_lie\[interop\]" \(pip install -e "\.\[interop\]" in a clone\)\n',
        result.stderr,
    ), result.stderr[-3000:]


def test_core_only_load_ends_in_one_line_saying_to_install_the_train_extra():
    """``rope_lie.load`` raises ModuleNotFoundError (an ImportError, for callers that catch
    it) whose message says what to install, without the chained import traceback."""
    result = _core_only("-c", "import rope_lie; rope_lie.load('some_workdir')")
    assert result.returncode == 1
    assert "During handling" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        r"ModuleNotFoundError: rope_lie\.load needs the train extra, which is not installed "
        rf"\(no module named '\w+'\): {_TRAIN_HINT}",
        last,
    ), result.stderr[-3000:]


def test_core_only_demo_and_encoders_run():
    """The demo (two cases on a small grid: tests/test_demo.py checks its numbers) and the
    encoders import and run with the train extra refused."""
    code = (
        "from rope_lie import demo\n"
        "demo.CASES, demo.GRID, demo.NUM_HEADS, demo.HEAD_DIM = demo.CASES[:2], (3, 3), 2, 8\n"
        "demo.main()\n"
        "import rope_lie.encodings\n"
        "print(sorted(rope_lie.encodings.ROTARY)[:1])\n"
    )
    result = _core_only("-c", code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "alibi (bias)" in result.stdout and "['" in result.stdout.splitlines()[-1]


def test_importing_the_package_and_encoders_loads_no_train_module():
    """In this full install: ``import rope_lie``, ``rope_lie.encodings`` and ``rope_lie.demo``
    leave flax, ml_collections, TensorFlow, optax and orbax unimported (what keeps them
    working in a core install, and quick to import)."""
    code = (
        "import sys, rope_lie, rope_lie.encodings, rope_lie.demo\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in sys.argv[1].split(',')))\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, "-c", code, ",".join(_extras.TRAIN_MODULES)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]", result.stdout


def _room(name: str) -> str | None:
    """The part of ``rope_lie`` a dotted name lies in (``rope_lie.models.vit`` -> ``models``,
    ``rope_lie.train`` -> ``train``); None for the package itself and for other packages."""
    parts = name.split(".")
    return parts[1] if parts[0] == "rope_lie" and len(parts) > 1 else None


def circles(arrows: dict[str, set[str]]) -> list[list[str]]:
    """Every loop of a directed graph, once each, as the list of its nodes (depth-first)."""
    found, state = set(), {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for after in sorted(arrows.get(node, ())):
            if state.get(after) == "open":
                loop = path[path.index(after) :]
                found.add(tuple(loop[loop.index(min(loop)) :] + loop[: loop.index(min(loop))]))
            elif after not in state:
                visit(after, [*path, after])
        state[node] = "done"

    for node in sorted(arrows):
        if node not in state:
            visit(node, [node])
    return sorted(list(c) for c in found)


def test_the_circle_finder_finds_a_loop_and_passes_a_tree():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_the_package_s_modules_import_each_other_without_a_circle():
    """Counted at the package's top level (a module, or a subpackage as one), with every import:
    inside functions and under ``TYPE_CHECKING`` too, as a reader follows them. A circle came
    back once through a lazy import (in_memory <-> run_inputs)."""
    arrows: dict[str, set[str]] = {}
    for path in _py("rope_lie"):
        rel = path.relative_to(REPO / "rope_lie")
        if rel == pathlib.Path("__init__.py"):
            continue  # the package's face: it hands names on
        room = rel.parts[0].removesuffix(".py")
        targets = {_room(n) for n in imported_modules(path)} - {None, room}
        arrows.setdefault(room, set()).update(targets)
    assert "run_inputs" in arrows["train"] or "in_memory" in arrows["train"]
    assert not circles(arrows), circles(arrows)


@pytest.mark.parametrize(
    ("jaxlib", "has_fusion_emitter_flag"), [((0, 7), True), ((0, 10), True), ((0, 11), False)]
)
def test_the_suite_asks_xla_only_for_flags_its_jaxlib_knows(jaxlib, has_fusion_emitter_flag):
    """An unknown XLA flag aborts every test process at start-up (as jaxlib 0.11.2 did)."""
    from tests.conftest import fast_compile_flags, installed_jaxlib_version

    flags = fast_compile_flags(jaxlib)
    assert ("--xla_cpu_use_fusion_emitters=false" in flags) == has_fusion_emitter_flag
    assert "--xla_backend_optimization_level=0" in flags
    assert fast_compile_flags(installed_jaxlib_version()) in os.environ["XLA_FLAGS"]
