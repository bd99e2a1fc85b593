"""A user's own model through the real pipeline: examples/my_model.py copied into the
working directory, as a user would, at single, ddp n=2 and pipeline n=2; the same model with
BatchNorm, whose maths really changes under data parallelism, reported as differing
with its cause; a plain nn.Module with a ModuleList of blocks (a forward of its own)
under every strategy that can take it unchanged; a factory that reads a value while
it builds, planned and run; a broken factory refused before any job; and, in the
same sweep, Hugging Face's Llama and GPT-2 under every strategy that applies."""

import json

import pytest
from test_plans_without_building import READS_VALUES

from conftest import OWN_MODELS, planned_outputs, run_cell, snakemake, tiny_spec
from parabench.checks import problems
from parabench.spec import ModelSpec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(own_models_sweep):
    return own_models_sweep


def test_the_example_model_runs_everywhere_with_the_same_maths(run):
    _, s = run
    for strategy, n in (("single", 1), ("ddp", 2), ("pipeline", 2)):
        row = s.loc[("mine", strategy, n)]
        assert row["status"] == "ok", row["reason"]
        assert str(row["equivalent"]) == "True", row
        assert row["max_abs_param_diff"] <= 1e-6
        assert row["flops_per_step"] > 0 and row["mfu"] > 0  # counted like a preset's


def test_a_module_with_a_forward_of_its_own_runs_unchanged_with_the_same_maths(run):
    """Found blocks (layers.0-2: FSDP's units, what stages are cut between), the same
    parameters as single under every strategy, the module's own forward run on each
    pipeline stage and across model parallel's."""
    work, s = run
    for strategy, n in [("single", 1)] + [
        (strategy, 2)
        for strategy in ("ddp", "zero1", "fsdp", "tp", "grad_accum", "pipeline", "model_parallel")
    ]:
        row = s.loc[("mine_module", strategy, n)]
        assert row["status"] == "ok", (strategy, n, row["reason"])
        assert str(row["equivalent"]) == "True", (strategy, n, row["rel_param_diff"])
        assert row["max_abs_param_diff"] <= 1e-5, (strategy, n)
    # one FSDP unit per found block (layers.0-2) and the root: a reduce-scatter each
    fsdp = json.loads(s.loc[("mine_module", "fsdp", 2), "comm_by_op"])
    assert fsdp["reduce_scatter"]["count"] == 3 + 1
    # the embedding and one block on stage 0, two blocks and the head on stage 1
    meta = json.loads(
        (work / "results/runs/mine_module/fp32-sgd/pipeline/n2/r0/meta.json").read_text()
    )
    assert meta["stage_cuts"] == [[0, 1], [1, 3]], meta["stage_cuts"]


def test_batchnorm_differs_under_ddp_and_the_report_says_why(run):
    work, s = run
    row = s.loc[("mine_bn", "ddp", 2)]
    assert row["status"] == "ok", row["reason"]
    assert str(row["equivalent"]) == "False"
    assert row["rel_param_diff"] > 10 * row["equivalence_tol"]
    assert "BatchNorm1d at blocks.1.1 normalises over the samples" in row["likely_cause"]
    # one rank of ddp is the same maths: nothing to blame
    assert str(s.loc[("mine_bn", "ddp", 1), "equivalent"]) == "True"
    html = (work / "results/report.html").read_text()
    equivalence = html.split('id="equivalence"')[1].split('id="strategies"')[0]
    assert "differs" in equivalence and "Likely cause: BatchNorm1d at blocks.1.1" in equivalence


def test_a_broken_factory_stops_the_plan_before_any_job(tmp_path):
    (tmp_path / "my_model.py").write_text("def build(**args):\n    return [1, 2, 3]\n")
    config = {**OWN_MODELS, "models": {"mine": OWN_MODELS["models"]["mine"]}}
    proc = snakemake(tmp_path, "-n", config=config)
    assert proc.returncode != 0
    assert "models.mine.factory: returned list, not dict(blocks=" in proc.stdout + proc.stderr
    assert not planned_outputs(proc)
    assert not (tmp_path / "results").exists()


def test_a_factory_that_reads_a_value_while_building_plans_and_runs(tmp_path):
    """`w /= w.std().item()` at init: fake tensors have no value to read, the real build
    has; planning takes it and the cell trains it."""
    (tmp_path / "reads.py").write_text(READS_VALUES)
    model = ModelSpec.of("custom", factory="reads:build", args={"how": "scale"}, path=str(tmp_path))
    spec = tiny_spec("single", 1, model=model, model_name="reads", batch_size=16)
    assert problems(spec) == []
    meta, proc = run_cell(spec, tmp_path / "cell")
    assert meta["status"] == "ok", (meta.get("reason"), proc.stderr[-3000:])
    assert meta["model_facts"]["params"] == 3 * (8 * 8 + 8) + (8 * 2 + 2)


# The Hugging Face models ride in the same sweep: one sweep of users' own models, on
# one test worker (a session fixture is per worker).
def test_llama_and_gpt2_run_every_strategy_that_applies_with_the_same_maths(run):
    """In the sweep of users' own models (conftest.OWN_MODELS), at 2 devices: Llama
    under every strategy; GPT-2 (Conv1D) under every strategy but tensor parallelism;
    GPT-2 with its head tied to its embeddings (as it comes) under no stage cut."""
    pytest.importorskip("transformers")
    work, s = run
    shared = ["single", "ddp", "zero1", "fsdp", "grad_accum", "pipeline"]
    ran = {"llama": [*shared, "tp", "model_parallel"], "gpt2": shared}
    for model, strategies in ran.items():
        for strategy in strategies:
            row = s.loc[(model, strategy, 1 if strategy == "single" else 2)]
            assert row["status"] == "ok", (model, strategy, row["reason"])
            # fp32 + SGD: the same parameters as single within 1e-5
            assert str(row["equivalent"]) == "True", (model, strategy, row["rel_param_diff"])
            assert row["max_abs_param_diff"] <= 1e-5, (model, strategy)
            assert row["flops_per_step"] > 0 and row["tokens_per_s"] > 0
        # FSDP: one unit per decoder layer and the root (embeddings, final norm, head)
        fsdp = json.loads(s.loc[(model, "fsdp", 2), "comm_by_op"])
        assert fsdp["reduce_scatter"]["count"] == 2 + 1
    for strategy in ("pipeline", "model_parallel"):
        tied = s.loc[("gpt2_tied", strategy, 2)]
        assert tied["status"] == "skipped" and "tie_word_embeddings" in tied["reason"]
    tp = s.loc[("gpt2", "tp", 2)]
    assert tp["status"] == "skipped" and "Conv1D" in tp["reason"]
    html = (work / "results/report.html").read_text()
    assert "Conv1D" in html
