"""Cross-field rules of a cell and of a workflow config: each message names the key."""

import pytest

from conftest import TINY_MLP, tiny_spec
from parabench.config import cells, problems
from parabench.spec import RunSpec


def config(**over):
    base = {
        "models": {"tiny": {"arch": "mlp", "dims": [48, 32, 24, 16, 8, 4, 1], "batch_size": 64}},
        "strategies": ["single", "dp", "ddp", "model_parallel", "pipeline", "grad_accum"],
        "devices": [1, 2, 4],
        "repeats": 2,
        "steps": 6,
        "warmup": 1,
        "accum_steps": 2,
        "pipeline": {"microbatches": 4, "schedule": "gpipe"},
        "results": "results",
    }
    base.update(over)
    return base


def test_valid_default_has_no_problems_and_one_cell_per_strategy_device_repeat():
    assert problems(config()) == []
    got = {(c.spec.strategy, c.spec.devices, c.spec.repeat) for c in cells(config())}
    assert len(got) == (1 + 5 * 3) * 2  # single only at one device
    assert ("single", 2, 0) not in got


@pytest.mark.parametrize(
    "over, key",
    [
        ({"models": {"tiny": {"arch": "mlp", "dims": [48, 8, 1], "batch_size": 64}}}, "devices"),
        (
            {
                "models": {
                    "tiny": {"arch": "mlp", "dims": [48, 32, 24, 16, 8, 4, 1], "batch_size": 66}
                }
            },
            "batch_size",
        ),
        ({"accum_steps": 3}, "batch_size"),
        ({"pipeline": {"microbatches": 2, "schedule": "1f1b"}}, "pipeline.microbatches"),
        ({"warmup": 6}, "warmup"),
        ({"results": "../elsewhere"}, "results"),
        ({"models": {"tiny": {"arch": "mlp", "width": 3, "batch_size": 64}}}, "models.tiny"),
    ],
)
def test_broken_rules_name_the_key(tmp_path, over, key):
    found = problems(config(**over), workdir=tmp_path)
    assert found, f"{over} should be refused"
    assert any(key in p for p in found), found


def test_divisibility_is_per_strategy():
    # 64 is divisible by 4 devices but not by 4 devices x 32 accumulation steps.
    spec = tiny_spec("grad_accum", 4, accum_steps=32)
    assert spec.problems() == [
        "batch_size: global batch 64 is not divisible by devices x accum_steps (4x32)"
    ]
    assert tiny_spec("ddp", 4, accum_steps=32).problems() == []


def test_weak_scaling_multiplies_the_global_batch():
    spec = tiny_spec("ddp", 4, scaling="weak")
    assert spec.global_batch == 4 * spec.batch_size


def test_config_hash_ignores_repeat_but_not_maths():
    a = tiny_spec("ddp", 2)
    assert a.config_hash() == tiny_spec("ddp", 2, repeat=3).config_hash()
    assert a.config_hash() != tiny_spec("ddp", 2, lr=0.1).config_hash()


def test_unknown_strategy_is_named():
    spec = RunSpec(strategy="fsdp3", devices=1, model_name="t", model=TINY_MLP, batch_size=8)
    assert spec.problems()[0].startswith("strategies: unknown strategy 'fsdp3'")


def test_every_cell_round_trips_through_its_launch_command():
    # The workflow plans a cell from the config, the cell parses its command line: both
    # must be the same settings with the same hash, or records would not match the plan.
    from parabench.cli import spec_from_launch
    from parabench.launch import launch_argv

    cfg = config(precision=["fp32", "bf16"], optimizer="adamw", compile=[False, True])
    cfg["timeout_s"] = 300  # an int from YAML; the command line gives back a float
    planned = cells(cfg)
    assert len(planned) == (1 + 5 * 3) * 2 * 2 * 2
    for cell in planned:
        back = spec_from_launch(launch_argv(cell.spec, "out"))
        assert back == cell.spec, cell.path
        assert back.config_hash() == cell.spec.config_hash()
        assert RunSpec.from_dict(cell.spec.to_dict()) == cell.spec
