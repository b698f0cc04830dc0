"""The package layout: one declaration of each package's exports, no import circles."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from sweepmaster.config.search_space import parameter_sets
from sweepmaster.lazy_exports import declared_exports

ROOT = Path(__file__).parents[1] / "sweepmaster"


def _declaring_packages() -> dict[str, Path]:
    """Each package whose ``__init__.py`` declares exports (an ``if TYPE_CHECKING:`` block)."""
    packages = {}
    for path in ROOT.rglob("__init__.py"):
        name = ".".join(path.parent.relative_to(ROOT.parent).parts)
        if declared_exports(path.read_text(encoding="utf-8"), name):
            packages[name] = path
    return packages


PACKAGES = sorted(_declaring_packages())

PUBLIC_API = [
    "ConfigError", "DataError", "DeviceError", "EvalEvent", "Executor", "LoraSpec", "MetricPoint",
    "OptimizerSpec", "PlannedJob", "ReplanEvent", "StartEvent", "StepEvent", "StorageError",
    "SweepConfig", "SweepObserver", "SweepOutcome", "SweepPlan", "SweepResults",
    "SweepmasterError", "TrainCallbacks", "TrainResult", "TrainSpec", "TrialRow", "find_splits",
    "load_results", "load_sweep_config", "make_blocks", "parse_sweep_config", "plan_sweep",
    "prepare_data", "run_sweep", "tokenize_files",
]


def test_declared_exports_reads_the_type_checking_imports() -> None:
    text = ("from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n"
            "    from pkg.a import x\n"
            "    from .b import y as z\n"
            "    from . import c\n")
    assert declared_exports(text, "pkg") == {
        "x": ("pkg.a", "x"), "z": ("pkg.b", "y"), "c": ("pkg", "c")}
    with pytest.raises(ValueError, match="from <module> import <name>"):
        declared_exports("if TYPE_CHECKING:\n    import os\n", "pkg")


def _check_exports(package: str, init: Path) -> None:
    """Fail unless ``package`` exports exactly what its ``TYPE_CHECKING`` block declares."""
    module = importlib.import_module(package)
    declared = declared_exports(init.read_text(encoding="utf-8"), package)
    assert getattr(module, "__all__", None) == sorted(declared), package
    for name in module.__all__:
        assert getattr(module, name) is not None, f"{package}.{name}"
    with pytest.raises(AttributeError):
        module.not_an_export  # noqa: B018


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_exports_what_it_declares(package: str) -> None:
    _check_exports(package, _declaring_packages()[package])


def test_a_wrong_declaration_fails_the_check(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    head = ("from typing import TYPE_CHECKING\n\n"
            "from sweepmaster.lazy_exports import lazy_exports\n")
    block = "if TYPE_CHECKING:\n    from sweepmaster.errors import {}\n"
    wire = "__getattr__, __dir__, __all__ = lazy_exports(globals())\n"
    packages = {"named_wrong": head + block.format("NotAnError") + wire,
                "not_wired": head + block.format("ConfigError"),
                "declared_right": head + block.format("ConfigError") + wire}
    for name, text in packages.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(text, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(AttributeError, match="NotAnError"):
        _check_exports("named_wrong", tmp_path / "named_wrong" / "__init__.py")
    with pytest.raises(AssertionError, match="not_wired"):
        _check_exports("not_wired", tmp_path / "not_wired" / "__init__.py")
    _check_exports("declared_right", tmp_path / "declared_right" / "__init__.py")


def test_the_public_api_is_unchanged() -> None:
    import sweepmaster

    assert sweepmaster.__all__ == sorted(PUBLIC_API)


def test_parameter_sets_are_every_combination_or_one_parameter_at_a_time() -> None:
    assert parameter_sets({}, 4) == ([{}], True)
    sets, every = parameter_sets({"a": [1, 2], "b": [3, 4]}, 4)
    assert every and len(sets) == 4 and {"a": 2, "b": 3} in sets
    assert parameter_sets({"a": [1, 2], "b": [3, 4]}, 3) == (
        [{"a": 1}, {"a": 2}, {"b": 3}, {"b": 4}], False)


def _module_imports() -> dict[str, set[str]]:
    """Each sweepmaster module -> the sweepmaster modules it imports when it is imported.

    Imports inside functions and ``if TYPE_CHECKING:`` blocks are left out.
    """
    names = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        names[name.removesuffix(".__init__")] = path

    def known(target: str) -> str:
        while target and target not in names:
            target = target.rpartition(".")[0]
        return target

    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        edges: set[str] = set()
        stack = list(ast.parse(path.read_text(encoding="utf-8")).body)
        while stack:
            node = stack.pop()
            if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
                continue
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                stack += [c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt)]
                continue
            edges |= {known(t) for t in targets if t.startswith("sweepmaster.")} - {name, ""}
        graph[name] = edges
    return graph


def test_no_module_imports_itself_through_others() -> None:
    graph = _module_imports()
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            raise AssertionError(f"import circle: {' -> '.join(path[path.index(name):])}")
        if name in done:
            return
        for other in graph[name]:
            visit(other, [*path, name])
        done.add(name)

    for name in graph:
        visit(name, [])


def test_the_dry_run_does_not_import_the_launch() -> None:
    code = ("import sys, sweepmaster.sweep.plan, sweepmaster.cli.plan\n"
            "print(sorted(m for m in ('sweepmaster.sweep.run', 'sweepmaster.sweep.launch', "
            "'sweepmaster.cli.launch') if m in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[]"
