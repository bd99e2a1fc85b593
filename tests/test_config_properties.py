"""Configs drawn from the schema (hypothesis + hypothesis-jsonschema): any config is
either refused before any job, with every message naming a config key, or plans cells
that each pass their own checks and survive the trip through their launch command.
Bounded: a fixed number of examples per property, a few seconds in all."""

from __future__ import annotations

import copy
import math
import os
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema

from parabench.catalog import STRATEGIES
from parabench.checks import problems as spec_problems
from parabench.config import SCHEMA, ConfigError, cells, checked, problems
from parabench.spec import RunSpec

REPO = Path(__file__).resolve().parents[1]
FULL = yaml.safe_load(SCHEMA.read_text())
TOP_KEYS = set(FULL["properties"])
MODEL_KEYS = set(FULL["properties"]["models"]["additionalProperties"]["properties"])
BOUNDED = settings(
    max_examples=60,
    deadline=None,  # the first custom-factory import costs a second; the budget is below
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.large_base_example],
    derandomize=True,  # the same examples every run: a failure here is reproducible
)


def drawing_schema() -> dict:
    """The schema, narrowed for drawing only: strategy names from the catalog (plus one
    that does not exist), factories that are safe to import (never 'os:abort'), and
    sweeps small enough to plan in milliseconds. The bounds themselves are tested
    separately below, on the full schema."""
    s = copy.deepcopy(FULL)
    p = s["properties"]
    names = {"type": "string", "enum": [*STRATEGIES, "zero4"]}
    p["strategies"].update(items=names, maxItems=4)
    model = p["models"]["additionalProperties"]["properties"]
    model["strategies"].update(items=names, maxItems=3)
    model["factory"] = {
        "enum": ["examples.my_model:build", "examples.my_model:nothing", "no_such:f"]
    }
    model["args"] = {"type": "object", "maxProperties": 0}
    for key in ("dims",):
        model[key].update(maxItems=6, items={"type": "integer", "minimum": 1, "maximum": 64})
    for key in ("d_in", "width", "d_model", "seq_len", "vocab", "classes"):
        model[key]["maximum"] = 64
    for key in ("depth", "n_layer", "n_head"):
        model[key]["maximum"] = 8
    model["batch_size"]["maximum"] = 4096
    model["devices"].update(maxItems=3, items={"type": "integer", "minimum": 1, "maximum": 8})
    p["models"]["maxProperties"] = 2
    p["devices"].update(maxItems=3, items={"type": "integer", "minimum": 1, "maximum": 8})
    p["repeats"]["maximum"] = 2
    p["results"] = {"enum": ["results", "out/a", "../outside"]}
    # each strategy's options: real names and a wrong one, right and wrong values
    p["options"] = {
        "type": "object",
        "maxProperties": 2,
        "propertyNames": {"enum": [*STRATEGIES, "zero4"]},
        "additionalProperties": {
            "type": "object",
            "maxProperties": 2,
            "propertyNames": {
                "enum": ["microbatches", "schedule", "accum_steps", "reshard_after_forward", "x"]
            },
            "additionalProperties": {"enum": [1, 2, 3, "gpipe", "1f1b", True, "no"]},
        },
    }
    return s


@pytest.fixture(autouse=True, scope="module")
def in_repo():
    """The example factory is found on the working directory, as in a real run."""
    before = os.getcwd()
    os.chdir(REPO)
    yield
    os.chdir(before)


def names_a_key(message: str) -> bool:
    """A problem message starts with the key at fault: 'steps: ...', 'models.x.dims: ...',
    or a model's own key ('batch_size: ...'), followed by the models it concerns."""
    key = re.split(r"[:\s]", message, maxsplit=1)[0]
    key = re.sub(r"\[\d+\]", "", key)  # a list's item: also[0].model is also.model
    return key.split(".")[0] in TOP_KEYS or (key in MODEL_KEYS and "models." in message)


def plan(config: dict) -> list[str]:
    """What the workflow does before any job: schema, defaults, then problems()."""
    try:
        full = checked(config)
    except ConfigError as e:
        return [str(e)]
    found = problems(full, REPO)
    if found:
        return found
    for cell in cells(full):
        spec = cell.spec
        assert spec_problems(spec) == [], (spec, spec_problems(spec))
        if spec.repeat == 0:  # repeats differ only in their index
            assert RunSpec.from_argv(spec.to_argv()) == spec, "the launch loses a setting"
    return []


@BOUNDED
@given(config=from_schema(drawing_schema()))
@example({"models": {"m": {"arch": "gpt", "batch_size": 3, "n_head": 3, "d_model": 5}}})
@example({"models": {"m": {"arch": "mlp", "batch_size": 3}}, "devices": [2], "warmup": 50})
@example({"models": {"m": {"arch": "custom", "batch_size": 4, "factory": "no_such:f"}}})
def test_a_drawn_config_is_refused_by_key_or_plans_valid_cells(config):
    for message in plan(config):
        assert names_a_key(message) or message.split(":")[0] in ("(top level)",), message


def numeric_keys(schema: dict, path: tuple = ()) -> list[tuple]:
    """Every path in the schema whose value is a number (an item of a list of numbers
    is written path + ('[]',))."""
    out = []
    kinds = schema.get("type")
    kinds = set(kinds) if isinstance(kinds, list) else {kinds}
    if kinds & {"integer", "number"}:
        out.append(path)
    for key, sub in schema.get("properties", {}).items():
        out += numeric_keys(sub, (*path, key))
    if isinstance(schema.get("items"), dict):
        out += numeric_keys(schema["items"], (*path, "[]"))
    if isinstance(schema.get("additionalProperties"), dict) and path == ("models",):
        out += numeric_keys(schema["additionalProperties"], (*path, "m"))
    return out


NUMERIC = numeric_keys(FULL)
BASE = {"models": {"m": {"arch": "mlp", "batch_size": 8}}, "device": "cpu", "devices": [1, 2]}
YAML_NUMBERS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, -1, 2**31, 2**32, 2**63, float("nan"), float("inf"), 1e308]),
)


def put(config: dict, path: tuple, value) -> dict:
    """`config` with `value` at `path`; a list key gets a list holding it (dims, which
    needs two widths, gets [value, 1])."""
    out = copy.deepcopy(config)
    keys = [k for k in path if k != "[]"]
    node = out
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    if path[-1] == "[]":
        value = [value, 1] if keys[-1] == "dims" else [value]
    node[keys[-1]] = value
    return out


def test_every_numeric_key_is_found():
    """The property below must reach the keys that matter."""
    found = {".".join(p) for p in NUMERIC}
    for key in ("steps", "lr", "seed", "timeout_s", "devices.[]", "models.m.dims.[]"):
        assert key in found, found


@BOUNDED
@given(st.sampled_from(NUMERIC), YAML_NUMBERS)
@example(("lr",), float("nan"))
@example(("timeout_s",), float("inf"))
@example(("seed",), 2**63)
@example(("devices", "[]"), 10**6)
# Found by this test: JSON Schema counts 1.0 as an integer, and planning then crashed
# (range(1.0)) or a cell's launch lost its device count.
@example(("repeats",), 1.0)
@example(("models", "m", "devices", "[]"), 1.0)
def test_every_number_yaml_can_hold_is_meant_or_refused_naming_its_key(path, value):
    key = ".".join(k for k in path if k != "[]")
    config = put(BASE, path, value)
    found = plan(config)
    if found:
        # the key the value went into (or its last part, as a schema error names it)
        assert any(path[-1] in m or key in m or path[-2] in m for m in found), (key, found)
        return
    number = float(value)
    assert math.isfinite(number), f"{key}={value} was accepted"
    assert abs(number) < 2**63, f"{key}={value} was accepted"


@pytest.mark.parametrize(
    "config, key",
    [
        ({**BASE, "lr": float("nan")}, "lr"),
        ({**BASE, "peak_flops": float("inf")}, "peak_flops"),
        ({**BASE, "cell_timeout_s": float("nan")}, "cell_timeout_s"),
        ({**BASE, "devices": [65]}, "devices"),
        ({**BASE, "seed": 2**32}, "seed"),
        ({**BASE, "timeout_s": 10**9}, "timeout_s"),
        ({**BASE, "repeats": 10**6}, "repeats"),
        # the seed MLP's 50-wide layer cannot be split over 4 tensor-parallel ranks
        ({**BASE, "strategies": ["tp"], "devices": [4]}, "models.m.dims"),
    ],
)
def test_numbers_nobody_means_are_refused_naming_the_key(config, key):
    found = plan(config)
    assert found and any(m.startswith(key) for m in found), found
