"""What pyproject.toml, .ci/run and the README's install commands promise each other."""

from __future__ import annotations

import re

import pytest

from tests.kit.data import ROOT as REPO

tomllib = pytest.importorskip("tomllib")

DEV_TOOLS = {"pytest", "hypothesis", "httpx", "ruff", "mypy", "types-pyyaml", "schemathesis",
             "playwright"}


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_user_extras_hold_no_developer_tools_and_dev_holds_them_all() -> None:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert _names(extras["postgres"]) == {"psycopg"}
    for name, requirements in extras.items():
        if name not in ("test", "dev"):
            assert not _names(requirements) & DEV_TOOLS, name
    dev = _names(extras["dev"]) | (_names(extras["test"]) if "sweepmaster[test]" in extras["dev"]
                                   else set())
    assert DEV_TOOLS <= dev
    assert {"pytest", "schemathesis", "playwright"} <= _names(extras["test"])


def test_ci_installs_the_cpu_torch_first_then_everything_the_checks_need() -> None:
    installs = [line.strip() for line in (REPO / ".ci/run").read_text().splitlines()
                if "pip install" in line and not line.lstrip().startswith("#")]
    assert installs[0] == "python -m pip install --quiet torch==2.13.0"
    assert any('-e ".[dev]"' in line for line in installs[1:]), installs


def test_readme_installs_the_cpu_build_through_pytorch_s_index() -> None:
    readme = (REPO / "README.md").read_text()
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in readme
    assert "download.pytorch.org/whl/cu" in readme  # and says how to get a CUDA build
    assert not re.search(r"torch==[\d.]+\S*\s+#\s*CPU", readme)  # the index picks the build
    assert 'pip install -e ".[dev]"' in readme
