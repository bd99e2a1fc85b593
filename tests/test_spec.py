"""A cell's settings: their rules, each message naming the key; their one serialisation,
both ways (command line and meta.json); each strategy's own options, which only its
cells carry."""

import dataclasses
import subprocess
import sys

import pytest

from conftest import REPO, TINY_MLP, tiny_config, tiny_spec
from parabench import catalog
from parabench.checks import problems as spec_problems
from parabench.cli import _parser
from parabench.config import cells, checked, problems, skipped
from parabench.jobs.launch import cell_argv
from parabench.spec import RunSpec, from_namespace


def config(**over):
    return tiny_config(
        strategies=["single", "dp", "ddp", "model_parallel", "pipeline", "grad_accum"],
        devices=[1, 2, 4],
        repeats=2,
        steps=6,
        results="results",
        options={"grad_accum": {"accum_steps": 2}, "pipeline": {"microbatches": 4}},
        **over,
    )


def test_valid_default_has_no_problems_and_one_cell_per_strategy_device_repeat():
    assert problems(config()) == []
    got = {(c.spec.strategy, c.spec.devices, c.spec.repeat) for c in cells(config())}
    assert len(got) == (1 + 5 * 3) * 2  # single only at one device
    assert ("single", 2, 0) not in got


@pytest.mark.parametrize(
    "over, key",
    [
        (
            {
                "models": {
                    "tiny": {"arch": "mlp", "dims": [48, 32, 24, 16, 8, 4, 1], "batch_size": 66}
                }
            },
            "batch_size",
        ),
        ({"options": {"grad_accum": {"accum_steps": 3}}}, "batch_size"),
        (
            {"options": {"pipeline": {"microbatches": 2, "schedule": "1f1b"}}},
            "options.pipeline.microbatches",
        ),
        ({"options": {"pipeline": {"microbatchs": 2}}}, "pipeline.microbatchs"),
        ({"options": {"pipeline": {"schedule": "zb"}}}, "pipeline.schedule"),
        ({"options": {"grad_accum": {"accum_steps": "two"}}}, "grad_accum.accum_steps"),
        ({"options": {"pipelines": {"microbatches": 2}}}, "options.pipelines"),
        ({"warmup": 6}, "warmup"),
        ({"results": "../elsewhere"}, "results"),
        ({"models": {"tiny": {"arch": "mlp", "width": 3, "batch_size": 64}}}, "models.tiny"),
    ],
)
def test_broken_rules_name_the_key(tmp_path, over, key):
    found = problems({**config(), **over}, workdir=tmp_path)
    assert found, f"{over} should be refused"
    assert any(key in p for p in found), found


def test_fewer_blocks_than_stages_is_a_skipped_cell_not_a_refusal():
    two = {"models": {"tiny": {"arch": "mlp", "dims": [48, 8, 1], "batch_size": 64}}}
    assert problems(config(**two)) == []
    assert sorted(skipped(checked(config(**two)))) == [
        "DataParallel needs 2 CUDA devices; on CPU it silently runs a single copy, so no "
        "honest multi-device number exists",
        "DataParallel needs 4 CUDA devices; on CPU it silently runs a single copy, so no "
        "honest multi-device number exists",
        "model_parallel at 4 devices needs 4 stages, and models.tiny has only 2 blocks",
        "pipeline at 4 devices needs 4 stages, and models.tiny has only 2 blocks",
    ]


def test_divisibility_is_per_strategy():
    # 64 is divisible by 4 devices but not by 4 devices x 32 accumulation steps.
    spec = tiny_spec("grad_accum", 4, accum_steps=32)
    assert spec_problems(spec) == [
        "models.tiny.batch_size: global batch 64 is not divisible by devices x "
        "options.grad_accum.accum_steps (4x32)"
    ]
    assert spec_problems(tiny_spec("ddp", 4)) == []


def test_weak_scaling_multiplies_the_global_batch():
    spec = tiny_spec("ddp", 4, scaling="weak")
    assert spec.global_batch == 4 * spec.batch_size


def test_config_hash_ignores_repeat_but_not_maths():
    a = tiny_spec("ddp", 2)
    assert a.config_hash() == tiny_spec("ddp", 2, repeat=3).config_hash()
    assert a.config_hash() != tiny_spec("ddp", 2, lr=0.1).config_hash()


def test_unknown_strategy_is_named():
    spec = RunSpec(strategy="fsdp3", devices=1, model_name="t", model=TINY_MLP, batch_size=8)
    assert spec_problems(spec)[0].startswith("strategies: unknown strategy 'fsdp3'")


def rank_command(spec: RunSpec) -> RunSpec:
    """What a rank of the cell parses: the CLI's own parser on the launched command."""
    argv = cell_argv(spec, "out")
    return from_namespace(_parser().parse_args(argv[argv.index("parabench") + 1 :]))


def test_every_cell_round_trips_through_its_launch_command():
    # The workflow plans a cell from the config, the cell parses its command line: both
    # must be the same settings with the same hash, or records would not match the plan.
    cfg = config(precision=["fp32", "bf16"], optimizer="adamw", compile=[False, True])
    cfg["timeout_s"] = 300  # an int from YAML; the command line gives back a float
    planned = cells(cfg)
    assert len(planned) == (1 + 5 * 3) * 2 * 2 * 2
    for cell in planned:
        back = rank_command(cell.spec)
        assert back == cell.spec, cell.path
        assert back.config_hash() == cell.spec.config_hash()
        assert RunSpec.from_dict(cell.spec.to_dict()) == cell.spec
        assert RunSpec.from_argv(cell.spec.to_argv()) == cell.spec


def test_a_strategy_carries_only_its_own_options():
    planned = {c.spec.strategy: c.spec for c in cells(config()) if c.spec.devices == 2}
    assert dict(planned["pipeline"].options) == {"microbatches": 4, "schedule": "gpipe"}
    assert dict(planned["grad_accum"].options) == {"accum_steps": 2}
    assert planned["ddp"].options == ()


def test_a_new_setting_of_one_strategy_leaves_every_other_cells_hash(monkeypatch):
    before = {c.path: c.spec.config_hash() for c in cells(config())}
    pipeline = catalog.CATALOG["pipeline"]
    grown = dataclasses.replace(
        pipeline,
        options={**pipeline.options, "interleave": catalog.Option(False, "hypothetical")},
    )
    monkeypatch.setitem(catalog.CATALOG, "pipeline", grown)
    after = {c.path: c.spec.config_hash() for c in cells(config())}
    changed = {p for p in before if before[p] != after[p]}
    assert changed, "the new setting is part of the pipeline cells' maths"
    assert all("/pipeline/" in p for p in changed), changed


def test_planning_imports_no_torch():
    """The Snakefile plans at parse time: config, checks, launch and the model facts of
    every preset must not import torch (two seconds per `snakemake -n`)."""
    code = (
        "import sys\n"
        "from parabench import config\nfrom parabench.jobs import launch\n"
        "cfg = config.load_config('config/config.yaml')\n"
        "assert config.problems(cfg) == []\n"
        "for cell in config.cells(cfg):\n"
        "    launch.launch_command(cell.spec, 'out', 60)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert proc.stdout.strip() == "[]", proc.stdout


def test_config_readme_lists_every_strategy_option():
    readme = (REPO / "config" / "README.md").read_text()
    for name, rec in catalog.CATALOG.items():
        for key, option in rec.options.items():
            default = (
                str(option.default).lower() if isinstance(option.default, bool) else option.default
            )
            assert f"| `options.{name}.{key}` | `{default}` |" in readme, (name, key)
