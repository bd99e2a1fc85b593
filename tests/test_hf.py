"""Hugging Face transformers models, built from small configs (no weights, no network),
unchanged, through the real pipeline: Llama and GPT-2 under every strategy that can
take a model with a forward of its own, with the same maths as single; what cannot
apply is skipped with its reason. And the default run never imports transformers."""

import json
import subprocess
import sys

import pandas as pd
import pytest
import torch

from conftest import REPO, snakemake

transformers = pytest.importorskip("transformers")

from parabench import models  # noqa: E402
from parabench.config import problems  # noqa: E402
from parabench.spec import ModelSpec  # noqa: E402

LLAMA = {
    "arch": "hf",
    "model_type": "llama",
    "seq_len": 32,
    "batch_size": 8,
    "config": {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    },
}
# GPT-2's dropout draws random masks, which no two strategies draw alike: off, as for
# any equivalence check (the report would name it otherwise).
GPT2 = {
    "arch": "hf",
    "model_type": "gpt2",
    "seq_len": 32,
    "batch_size": 8,
    "config": {
        "vocab_size": 256,
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 4,
        "n_positions": 64,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    },
}
STRATEGIES = ["single", "ddp", "zero1", "fsdp", "tp", "grad_accum", "pipeline"]


def spec_of(entry: dict) -> ModelSpec:
    return ModelSpec.of(**{k: v for k, v in entry.items() if k != "batch_size"})


def test_a_transformers_model_keeps_its_own_blocks_plan_and_loss():
    llama = models.build(spec_of(LLAMA), 0)
    assert llama.block_names == ("hf.model.layers.0", "hf.model.layers.1")
    assert not llama.sequential and llama.tokens_per_sample == 32
    # the config's plan, `layers.*` expanded over the blocks, colwise/rowwise only
    assert llama.tp_plan["hf.model.layers.1.self_attn.q_proj"] == "colwise"
    assert llama.tp_plan["hf.model.layers.0.mlp.down_proj"] == "rowwise"
    assert len(llama.tp_plan) == 2 * 7
    x, y = llama.batch(3, torch.Generator().manual_seed(0))
    assert x.shape == (3, 32) and (x == y).all() and int(x.max()) < 256
    loss = llama.loss_fn(llama.module(x), y)
    assert loss.dim() == 0 and 4.0 < float(loss.detach()) < 7.0  # about ln(256) = 5.5 at init

    gpt2 = models.facts(spec_of(GPT2))
    assert gpt2.n_blocks == 2 and not gpt2.cuttable
    assert "Conv1D" in gpt2.tp_skip
    assert models.build(spec_of(GPT2), 0).block_names == (
        "hf.transformer.h.0",
        "hf.transformer.h.1",
    )


def test_a_bad_hf_model_is_one_error_naming_the_key():
    bad = {**LLAMA, "model_type": "no_such_model"}
    cfg = {"models": {"mine": bad}, "strategies": ["single"], "devices": [1], "repeats": 1}
    found = problems(cfg)
    assert len(found) == 1 and found[0].startswith("models.mine.model_type: "), found
    heads = {**LLAMA, "config": {**LLAMA["config"], "num_key_value_heads": 3}}
    cfg = {"models": {"mine": heads}, "strategies": ["tp"], "devices": [2], "repeats": 1}
    assert any("do not divide by 2" in p for p in problems(cfg)), problems(cfg)


def test_the_default_run_never_imports_transformers():
    """What the default config's jobs import: planning, every strategy, the presets."""
    code = """
import sys, yaml
from parabench import cell, strategies, plan, models
from parabench.catalog import CATALOG
from parabench.config import problems, cells
config = yaml.safe_load(open("config/config.yaml"))
assert problems(config) == [], problems(config)
for c in cells(config):
    models.facts(c.spec.model)
for name in CATALOG:
    strategies.get(name)
for model in {c.spec.model for c in cells(config)}:
    models.build(model, 0)
print("transformers" in sys.modules)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


@pytest.mark.slow
def test_llama_and_gpt2_run_every_strategy_that_applies_with_the_same_maths(tmp_path):
    config = {
        "device": "cpu",
        "models": {"llama": LLAMA, "gpt2": GPT2},
        "strategies": STRATEGIES,
        "devices": [2],
        "repeats": 1,
        "steps": 6,
        "warmup": 1,
        "profile_steps": 3,
        "lr": 0.5,
        "timeout_s": 60,
        "cell_timeout_s": 240,
        "plan": {"enabled": False},
    }
    proc = snakemake(tmp_path, "--cores", "1", config=config)
    assert proc.returncode == 0, proc.stderr[-4000:]
    s = pd.read_csv(tmp_path / "results/summary.csv").set_index(["model", "strategy"])
    for model in ("llama", "gpt2"):
        ran = ["single", "ddp", "zero1", "fsdp", "grad_accum"] + (
            ["tp"] if model == "llama" else []
        )
        for strategy in ran:
            row = s.loc[(model, strategy)]
            assert row["status"] == "ok", (model, strategy, row["reason"])
            # fp32 + SGD: the same parameters as single within 1e-5
            assert str(row["equivalent"]) == "True", (model, strategy, row["rel_param_diff"])
            assert row["max_abs_param_diff"] <= 1e-5, (model, strategy)
            assert row["flops_per_step"] > 0 and row["tokens_per_s"] > 0
        # FSDP: one unit per decoder layer and the root (embeddings, final norm, head)
        fsdp = json.loads(s.loc[(model, "fsdp"), "comm_by_op"])
        assert fsdp["reduce_scatter"]["count"] == 2 + 1
        pipeline = s.loc[(model, "pipeline")]
        assert pipeline["status"] == "skipped"
        assert "no stage can be cut from it" in pipeline["reason"]
    tp = s.loc[("gpt2", "tp")]
    assert tp["status"] == "skipped" and "Conv1D" in tp["reason"]
    html = (tmp_path / "results/report.html").read_text()
    assert "Conv1D" in html
