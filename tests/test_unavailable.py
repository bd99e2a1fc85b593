"""A test this machine cannot run (a tool missing, no root) is skipped locally and
fails in CI (CI=true), where the set-up gives it all: the one home of that rule is
conftest.unavailable, which require_tool and require_root call."""

from __future__ import annotations

import ast
import sys
import types

import pytest

import conftest
from conftest import REPO, pyproject, require_root, require_tool

NOT_ROOT = 1000


@pytest.mark.parametrize(
    ("ci", "outcome"), [(None, pytest.skip.Exception), ("true", pytest.fail.Exception)]
)
def test_without_root_a_test_skips_locally_and_fails_in_ci(monkeypatch, ci, outcome):
    monkeypatch.setattr(conftest.os, "geteuid", lambda: NOT_ROOT)
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    with pytest.raises(outcome, match="needs root"):
        require_root("starting slurmd needs root")
    with pytest.raises(outcome, match="no-such-tool-pb is not installed"):
        require_tool("no-such-tool-pb")
    monkeypatch.setattr(conftest.os, "geteuid", lambda: 0)
    require_root("starting slurmd needs root")  # root: runs


def test_no_test_asks_for_root_but_through_require_root():
    """A skip of its own (`if os.geteuid() != 0: pytest.skip(...)`) would stay a skip in CI."""
    asking = [
        f"{path.name}:{node.lineno}"
        for path in sorted((REPO / "tests").glob("*.py"))
        if path.name != "conftest.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr == "geteuid"
    ]
    assert not asking, asking


def test_pyproject_is_read_without_tomllib(monkeypatch):
    """Python 3.10 (requires-python >=3.10) has no tomllib: tomli, pytest's dependency
    there, reads pyproject, so the tests of it run rather than skip."""
    monkeypatch.setitem(sys.modules, "tomllib", None)  # `import tomllib` fails, as on 3.10
    tomli = types.SimpleNamespace(loads=lambda text: {"read by tomli": "[project]" in text})
    monkeypatch.setitem(sys.modules, "tomli", tomli)
    assert pyproject() == {"read by tomli": True}
    monkeypatch.setitem(sys.modules, "tomli", None)
    with pytest.raises(ImportError, match="tomli"):  # an error, never a skip
        pyproject()
