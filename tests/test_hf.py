"""Hugging Face transformers models, built from small configs (no weights, no network),
unchanged, through the real pipeline: Llama and GPT-2 under every strategy that can
take a model with a forward of its own (their sweep is tests/test_custom_model.py's,
the one sweep of users' own models); what cannot apply is skipped with its reason.
And the default run never imports transformers."""

import subprocess
import sys

import pytest
import torch

from conftest import GPT2, LLAMA, REPO

transformers = pytest.importorskip("transformers")

from parabench import models  # noqa: E402
from parabench.config import problems  # noqa: E402
from parabench.spec import ModelSpec  # noqa: E402


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

    # FLOPs with attention: sdpa's CPU kernel has no formula in torch's counter, so
    # the count runs on eager attention and exceeds what counting the model itself sees
    from torch.utils.flop_counter import FlopCounterMode

    from parabench.process.flops import step_flops

    with FlopCounterMode(display=False) as seen:
        llama.module(x[:1]).sum().backward()
    llama.module.zero_grad(set_to_none=True)
    assert step_flops(llama, 1) > seen.get_total_flops()

    gpt2 = models.facts(spec_of(GPT2))
    assert gpt2.n_blocks == 2 and "tie_word_embeddings" in gpt2.cut_skip
    opt = {
        "arch": "hf",
        "model_type": "opt",
        "seq_len": 8,
        "config": {"layerdrop": 0.1, "tie_word_embeddings": False},
    }
    assert "layerdrop 0.1" in models.facts(spec_of(opt)).cut_skip
    assert "Conv1D" in gpt2.tp_skip
    assert models.facts(spec_of(LLAMA)).cut_skip is None
    assert models.build(spec_of(GPT2), 0).block_names == (
        "hf.transformer.h.0",
        "hf.transformer.h.1",
    )


def test_a_bad_hf_model_is_one_error_naming_the_key():
    bad = {**LLAMA, "model_type": "no_such_model"}
    cfg = {"models": {"mine": bad}, "strategies": ["single"], "devices": [1], "repeats": 1}
    found = problems(cfg)
    assert len(found) == 1 and found[0].startswith("models.mine.model_type: "), found
    typo = {**LLAMA, "config": {**LLAMA["config"], "num_hiden_layers": 1}}
    cfg = {"models": {"mine": typo}, "strategies": ["single"], "devices": [1], "repeats": 1}
    assert problems(cfg) == [
        "models.mine.model_type: model_type 'llama' has no config keys ['num_hiden_layers'] "
        "(a typo would give a default-size model)"
    ]
    heads = {**LLAMA, "config": {**LLAMA["config"], "num_key_value_heads": 3}}
    cfg = {"models": {"mine": heads}, "strategies": ["tp"], "devices": [2], "repeats": 1}
    assert any("do not divide by 2" in p for p in problems(cfg)), problems(cfg)


def test_the_default_run_never_imports_transformers():
    """What the default config's jobs import: planning, every strategy, the presets."""
    code = """
import sys, yaml
from parabench import strategies, models
from parabench.run import cell
from parabench.predict import plan
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
