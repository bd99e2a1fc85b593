"""Layouts and activation checkpointing in the config: degrees laid out and checked up
front (each message names its key), the axis and `also` cells, and every cell of the
configs that never name them keeping its path and settings hash. Torch-free, seconds."""

from __future__ import annotations

import pytest

from conftest import REPO, tiny_config
from parabench.catalog import CATALOG, default_strategies, device_counts
from parabench.checks import static_skip_reason
from parabench.config import ConfigError, cells, checked, load_config, problems
from parabench.layout import MESH_DIMS

GPT = {"arch": "gpt", "vocab": 128, "seq_len": 16, "n_layer": 2, "n_head": 4, "d_model": 32}


def config(**over) -> dict:
    return checked(tiny_config(**over))


def gpt_config(strategies, devices, **over) -> dict:
    entry = {**GPT, "batch_size": 8, "strategies": strategies, "devices": devices}
    return config(models={"gpt": entry}, **over)


def test_a_layouts_degrees_multiply_to_its_devices_outermost_first():
    for name in ("fsdp_tp", "hsdp", "ddp_pp", "fsdp_pp", "tp_pp"):
        rec = CATALOG[name]
        opts = {k: o.default for k, o in rec.options.items()}
        assert device_counts(name, [1, 2, 4, 8], opts) == [4, 8]
        deg = rec.layout.at(8, opts).degrees
        assert (
            list(deg) == list(MESH_DIMS)
            and deg["pp"] * deg["dp_replicate"] * deg["dp_shard"] * deg["tp"] == 8
        )
        assert sum(v > 1 for v in deg.values()) == 2
    assert CATALOG["fsdp_tp"].layout.at(8, {"tp": 4}).degrees == {
        "pp": 1,
        "dp_replicate": 1,
        "dp_shard": 2,
        "tp": 4,
    }


def test_the_default_sweep_is_the_one_dimensional_strategies():
    assert not set(default_strategies()) & {"fsdp_tp", "hsdp", "ddp_pp", "fsdp_pp", "tp_pp"}
    assert {c.spec.strategy for c in cells(config(strategies=[]))} == set(default_strategies())


def test_degrees_that_lay_out_no_device_count_are_refused_naming_the_option():
    bad = gpt_config(["single", "hsdp"], [4], options={"hsdp": {"dp_replicate": 3}})
    (why,) = problems(bad)
    assert why.startswith("strategies: hsdp lays out none of models.gpt's devices [4]")
    assert "options.hsdp.dp_replicate (3) does not divide 4 devices" in why
    (why,) = problems(gpt_config(["single", "fsdp_tp"], [2]))
    assert "options.fsdp_tp.tp (2) leaves dp_shard 1 at 2 devices" in why


def test_a_tp_width_is_split_by_the_tp_degree_not_the_devices():
    # 6 heads of d_model 48: tp 2 splits them, tp 4 cannot; at 8 devices fsdp_tp with tp 2
    # runs, while plain tp at 8 is a skipped cell, not a refusal
    entry = {**GPT, "n_head": 6, "d_model": 48, "batch_size": 8, "devices": [8]}
    c = config(models={"gpt": {**entry, "strategies": ["single", "fsdp_tp", "tp"]}})
    assert problems(c) == []
    specs = {s.spec.strategy: s.spec for s in cells(c)}
    assert static_skip_reason(specs["fsdp_tp"]) is None
    assert "over 8 ranks" in static_skip_reason(specs["tp"])


def test_a_layouts_batch_divides_by_its_data_parallel_ranks_and_micro_batches():
    c = gpt_config(["single", "ddp_pp"], [4])
    c["models"]["gpt"]["batch_size"] = 6
    (why,) = problems(c)
    assert why.startswith("models.gpt.batch_size: global batch 6 is not divisible by")
    assert "its data-parallel ranks (2) x options.ddp_pp.microbatches (4)" in why


def test_activation_checkpointing_is_an_axis_and_also_adds_single_cells():
    c = gpt_config(
        ["single", "ddp"],
        [2],
        also=[{"model": "gpt", "strategy": "ddp", "devices": 2, "ac": "full"}],
    )
    paths = sorted(cell.path for cell in cells(c))
    assert paths == [
        "runs/gpt/fp32-sgd-acfull/ddp/n2/r0",
        "runs/gpt/fp32-sgd/ddp/n2/r0",
        "runs/gpt/fp32-sgd/single/n1/r0",
    ]
    both = gpt_config(["single", "ddp"], [2], ac=["none", "selective"])
    assert len(cells(both)) == 4
    with pytest.raises(ConfigError, match=r"^ac"):
        gpt_config(["single"], [1], ac=["sometimes"])
    bad = gpt_config(["single"], [1], also=[{"model": "nope", "strategy": "ddp", "devices": 2}])
    assert problems(bad) == ["also[0].model: 'nope' is not a model of this config"]


def test_activation_checkpointing_of_dataparallel_is_a_skipped_cell():
    c = gpt_config(["single", "dp"], [1], ac=["full"])
    dp = next(cell.spec for cell in cells(c) if cell.spec.strategy == "dp")
    assert "activation checkpointing does not compose with DataParallel" in static_skip_reason(dp)


def test_configs_that_name_no_checkpointing_keep_every_cells_path_and_hash():
    # the hashes of config/config.yaml's cells before `ac` existed, from that config as it
    # was (commit aedc1b6, kept in tests/data: the shipped one has changed its steps since,
    # which rightly changes its hashes): a changed one would rerun every finished cell of
    # every user whose config names no checkpointing
    before = {
        "runs/mlp/fp32-sgd/single/n1/r0": "541ff7dfce7c",
        "runs/mlp/fp32-sgd/ddp/n2/r0": "fdb266061266",
        "runs/mlp/fp32-sgd/fsdp/n2/r0": "54d84b9092ac",
        "runs/mlp/fp32-sgd/pipeline/n2/r0": "3c89728b9ae1",
        "runs/gpt/fp32-sgd/single/n1/r0": "85abec89eb7d",
        "runs/gpt/fp32-sgd/ddp/n2/r0": "10da6a9da0f1",
        "runs/gpt/fp32-sgd/fsdp/n2/r0": "f9fca60da363",
    }
    now = {c.path: c.spec for c in cells(load_config(REPO / "tests/data/config-aedc1b6.yaml"))}
    assert {p: now[p].config_hash() for p in before} == before
    assert all("ac" not in now[p].to_dict() for p in before)


def test_a_degree_of_the_wrong_type_is_named_not_a_crash():
    for bad in (0, "two"):
        found = problems(gpt_config(["single", "fsdp_tp"], [4], options={"fsdp_tp": {"tp": bad}}))
        assert found and all(p.startswith("options.fsdp_tp.tp: must be") for p in found), found


def test_the_memory_model_splits_by_the_degrees_that_split_each_part():
    import pandas as pd

    from parabench.predict.scaling import memory_model

    def shares(strategy: str, devices: int) -> dict:
        row = pd.Series(
            {
                "strategy": strategy,
                "devices": devices,
                "options": "",
                "optimizer": "adamw",
                "global_batch": 8,
                "precision": "fp32",
            }
        )
        m = memory_model(row, params=1.0, act_per_sample=4.0)
        return {
            k: m[k] / b for k, b in (("model_params_bytes", 4), ("model_activations_bytes", 32))
        }

    # HSDP at 2 x 2 keeps half the parameters (its shard group's), not a quarter
    assert shares("hsdp", 4) == {"model_params_bytes": 0.5, "model_activations_bytes": 0.25}
    assert shares("fsdp_tp", 4) == {"model_params_bytes": 0.25, "model_activations_bytes": 0.25}
    assert shares("ddp", 4) == {"model_params_bytes": 1.0, "model_activations_bytes": 0.25}
    assert shares("fsdp", 4)["model_params_bytes"] == 0.25


def test_a_stage_checkpoints_the_models_repeated_blocks_it_holds():
    from parabench.models import build
    from parabench.spec import ModelSpec
    from parabench.strategies import checkpointing

    model = build(ModelSpec.of(**GPT), 0)
    blocks = model.blocks()  # embed, block, block, head: stage 0 of 2 is [embed, block]
    chosen = checkpointing.apply(blocks, "full", within=blocks[:2])
    assert [type(b).__name__ for b in chosen] == ["Block"] and chosen[0] is blocks[1]
    assert checkpointing.count(blocks) == 1
    # one layer between the embedding and the head: the layer, though the classes tie
    one = build(ModelSpec.of(**{**GPT, "n_layer": 1}), 0).blocks()
    assert [type(b).__name__ for b in checkpointing.repeated(one)] == ["Block"]
    # resmlp's embedding and head are both nn.Sequential: outnumbering one layer
    mlp = build(ModelSpec.of("resmlp", depth=1, width=16, d_in=8, classes=4), 0)
    assert [type(b).__name__ for b in checkpointing.repeated(mlp.blocks())] == ["Residual"]


def test_a_layout_labels_itself_and_says_what_is_wrong_naming_the_key():
    from parabench.layout import Layout

    lay = Layout(dp_shard=32, tp=8, ac="full")
    assert lay.label == "FSDP 32 × TP 8, SP, full AC" and lay.world == 256 and lay.dp == 32
    assert lay.declared() == ("dp_shard", "tp")  # torchtitan's order, degree 1 left out
    assert Layout(pp=8, dp_shard=8, tp=8, zero=2).label == "FSDP 8 × TP 8 × PP 8, SP, ZeRO-2, 1F1B"
    assert Layout(dp_replicate=4, dp_shard=8).label == "HSDP 4×8"
    assert Layout(dp_replicate=64).label == "DDP 64" and Layout().label == "one device"
    # what its degrees make moot is normalised: DDP has no ZeRO level, no pipeline no schedule
    assert Layout(dp_replicate=2, zero=3) == Layout(dp_replicate=2, zero=2)
    assert Layout(dp_shard=2, schedule="gpipe") == Layout(dp_shard=2)
    assert Layout(dp_shard=2, tp=2).stage == Layout(pp=2, dp_shard=2, tp=2, schedule="gpipe").stage
    assert not Layout(dp_shard=4, tp=2).problems()
    # a dimension or setting said twice, or a schedule without a pipeline: refused
    for text, said in [
        ("TP 8 x TP 2", "TP given twice"),
        ("DDP 2 x HSDP 2x4", "data parallelism given twice"),
        ("selective AC, full AC", "checkpointing given twice"),
        ("FSDP 64, 1F1B", "a schedule without a pipeline"),
    ]:
        with pytest.raises(ValueError, match=said):
            Layout.parse(text)
    assert Layout(tp=0, ac="most", pp=2, schedule="zb").problems("advise.layout") == [
        "advise.layout.tp: must be an integer >= 1, got 0",
        "advise.layout.ac: must match none|full|selective|every[2-9], got 'most'",
        "advise.layout.schedule: must be one of ['gpipe', '1f1b', 'interleaved'], got 'zb'",
    ]
    # a record's declaration names the option at fault
    rec = CATALOG["fsdp_tp"]
    assert rec.layout.problem("fsdp_tp", 6, {"tp": 4}) == (
        "options.fsdp_tp.tp (4) does not divide 6 devices"
    )


@pytest.mark.parametrize(
    "text",
    [
        "FSDP 32 × TP 8, SP, full AC",
        "FSDP 8 × TP 8 × PP 8, SP, ZeRO-2, 1F1B, full AC",
        "HSDP 4×8 × PP 2, ZeRO-2, GPipe",
        "FSDP 8 × TP 8 × PP 8, SP, ZeRO-2, Interleaved 1F1B, full AC",
        "DDP 64, selective AC",
        "TP 4, no SP",
        "one device",
    ],
)
def test_a_layout_reads_back_its_own_label(text):
    from parabench.layout import Layout

    assert Layout.parse(text).label == text
    assert Layout.parse(text.lower().replace("×", "x")) == Layout.parse(text)


def test_a_layout_people_write_wrong_is_refused_naming_the_key_and_the_part():
    from parabench.layout import Layout

    with pytest.raises(ValueError, match=r"--layout: cannot read 'FSDP 8 x QP 2'"):
        Layout.parse("FSDP 8 x QP 2, full AC", "--layout")
    with pytest.raises(ValueError, match=r"--layout.ac: must match"):
        Layout.parse("FSDP 8, most AC", "--layout")
    # a pipeline's FSDP is ZeRO-2, as the cells run it: said or not, never 3
    assert Layout.parse("FSDP 4 x PP 2").zero == 2
    with pytest.raises(ValueError, match=r"--layout.zero: a pipeline's FSDP"):
        Layout.parse("FSDP 4 x PP 2, ZeRO-3", "--layout")
