"""A config is always checked against its schema (jsonschema is the package's own
dependency, not Snakemake's alone), and no cell directory leaves results/."""

from __future__ import annotations

import sys

import pytest

from conftest import planned_outputs, pyproject, snakemake, tiny_config
from parabench import config as cfg


def test_jsonschema_is_a_dependency_of_the_package():
    project = pyproject()["project"]
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


def test_the_command_line_means_what_a_config_file_means(tmp_path):
    """`--config 'devices=[1,2]'` was refused (devices.1: '2' is not of type 'integer'):
    Snakemake reads what a list or mapping holds as strings. A real dry run plans the
    cells the same text in a config file plans; a value the schema wants a string
    (a strategy's name) stays one, and a wrong one is still refused naming its key."""
    args = ["-n", "--cores", "1", "--config", "devices=[1,2]", 'plan={"enabled": false}']
    proc = snakemake(tmp_path, *args, config=tiny_config(devices=[4]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {p.split("/runs/")[1].split("/r0/")[0] for p in planned_outputs(proc) if "/runs/" in p}
    assert runs == {"tiny/fp32-sgd/single/n1", "tiny/fp32-sgd/ddp/n1", "tiny/fp32-sgd/ddp/n2"}
    assert not any("plan.csv" in p for p in planned_outputs(proc))
    proc = snakemake(tmp_path, "-n", "--config", "devices=[1,two]", config=tiny_config())
    said = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "devices.1: 'two' is not of type 'integer'" in said, said


def test_the_cells_refuse_the_schedule_only_advise_prices():
    """Interleaved 1F1B (virtual stages) is a layout advise prices, not one the cells
    run (one stage a rank: pipeline.SCHEDULES): refused naming the option, before
    any job."""
    config = cfg.checked(
        tiny_config(
            strategies=["pipeline"],
            devices=[2],
            options={"pipeline": {"schedule": "interleaved", "microbatches": 4}},
        )
    )
    assert cfg.problems(config) == [
        "options.pipeline.schedule: must be one of ['gpipe', '1f1b'], got 'interleaved'"
    ]
