"""A config is always checked against its schema (jsonschema is the package's own
dependency, not Snakemake's alone), and no cell directory leaves results/."""

from __future__ import annotations

import sys

import pytest

from conftest import REPO, tiny_config
from parabench import config as cfg


def test_jsonschema_is_a_dependency_of_the_package():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11's
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert any(
        d.split(">")[0].split("=")[0].strip() == "jsonschema" for d in project["dependencies"]
    )


def test_a_config_is_never_taken_unchecked(monkeypatch):
    """Where jsonschema cannot be imported (a broken install), checking fails loudly
    rather than passing a config the schema refuses: a model named ../../x."""
    bad = tiny_config(models={"../../x": tiny_config()["models"]["tiny"]})
    with pytest.raises(cfg.ConfigError, match="models"):
        cfg.checked(bad)
    monkeypatch.setitem(sys.modules, "jsonschema", None)  # `import jsonschema` fails
    with pytest.raises(cfg.ConfigError, match="jsonschema is not installed"):
        cfg.checked(bad)  # refused, never run unchecked


def test_a_cell_directory_outside_results_is_a_problem():
    """Belt and braces behind the schema's model-name pattern: however a model named
    ../../x reached problems(), its cells would be written outside results/."""
    config = cfg.checked(tiny_config())
    config["models"] = {"../../x": config["models"]["tiny"]}
    found = cfg.problems(config)
    assert any(p.startswith("models.../../x: ") and "results/" in p for p in found), found
    assert cfg.problems(cfg.checked(tiny_config())) == []
