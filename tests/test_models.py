"""Models: the gpt preset's shape, FLOPs and tensor-parallel plan, and a user's own
model through its factory, checked when the workflow plans, each problem naming
models.<name>.factory."""

import textwrap

import pytest
import torch

from parabench.config import checked, problems, skipped
from parabench.models import PRESETS, build, facts
from parabench.models.base import maths_notes
from parabench.models.custom import tp_widths
from parabench.process.flops import step_flops
from parabench.spec import ModelSpec

GPT = ModelSpec.of("gpt", vocab=256, seq_len=64, n_layer=4, n_head=4, d_model=64)


def test_gpt_flops_per_step_equal_the_analytic_count_with_attention():
    # Forward, per token: 2 x every Linear's weights (q, k, v, out, the MLP's 4d and d
    # layers, the LM head); per layer 2 x 2 x T x d for QK^T and attention x V (SDPA
    # counts the full T x T). Backward is twice the forward: every Linear needs its
    # weight and its input gradient (the embeddings' output requires grad), and so do
    # both attention products. Embedding lookups, norms and activations are not matmuls.
    b, v, t, layers, d = 8, 256, 64, 4, 64
    linear = layers * (4 * d * d + 2 * 4 * d * d) + d * v
    forward = 2 * b * t * linear + layers * 2 * 2 * b * t * t * d
    assert step_flops(build(GPT, 0), b) == 3 * forward


def test_gpt_shape_blocks_and_plan():
    model = build(GPT, 0)
    assert len(model.module) == facts(GPT).n_blocks == 4 + 2  # embedding, layers, head
    x, y = model.batch(3, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (3, 64) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1]), "targets are the next tokens"
    logits = model.module(x)
    assert logits.shape == (3, 64, 256)
    assert model.loss_fn(logits, y).dim() == 0
    assert model.tokens_per_sample == 64
    assert {model.tp_plan[f"1.attn.{p}"] for p in "qkv"} == {"colwise"}
    assert model.tp_plan["1.attn.out"] == model.tp_plan["1.mlp.proj"] == "rowwise"
    assert model.tp_plan["1.mlp.fc"] == "colwise"
    # GPT-2 small's shape (untied head, so 163M rather than 124M parameters)
    gpt2 = build(ModelSpec.of("gpt"), 0)
    assert sum(p.numel() for p in gpt2.module.parameters()) == 163_037_184


def test_gpt_heads_must_split_over_tensor_parallel_ranks():
    cfg = {
        "models": {
            "g": {
                "arch": "gpt",
                "n_head": 6,
                "d_model": 48,
                "seq_len": 8,
                "vocab": 32,
                "n_layer": 2,
                "batch_size": 8,
            }
        },
        "strategies": ["single", "tp"],
        "devices": [1, 4],
        "repeats": 1,
    }
    assert problems(cfg) == []  # tp at 4 is skipped, with the reason
    assert any(
        r.startswith("models.g.n_head: tensor parallel splits attention heads 6 over 4 ranks")
        for r in skipped(checked(cfg))
    ), skipped(checked(cfg))
    cfg["models"]["g"]["d_model"] = 50
    assert any("models.g.d_model: 50 is not divisible by n_head" in p for p in problems(cfg))


SIZES = {
    "mlp": [{}, {"dims": [30, 12, 8, 6, 1]}, {"dims": [16, 6, 1]}],
    "seqnet": [{}, {"dims": [20, 10, 4]}],
    "resmlp": [{"d_in": 8, "width": 6, "depth": 3, "classes": 4}],
    "gpt": [{"vocab": 32, "seq_len": 8, "n_layer": 3, "n_head": 6, "d_model": 12}],
}


@pytest.mark.parametrize(
    "arch, sizes", [(a, s) for a in PRESETS for s in SIZES[a]], ids=lambda v: str(v)[:20]
)
def test_a_presets_planning_facts_are_those_of_the_model_it_builds(arch, sizes):
    """facts.py answers planning without torch; the builder must agree with it: the
    blocks a stage cut falls between, and which device counts tensor parallelism can
    split the planned layers over (a gpt's heads: its q/k/v widths over head_dim)."""
    spec = ModelSpec.of(arch, **sizes)
    with torch.device("meta"):
        model = build(spec, 0)
    known = facts(spec)
    assert known.n_blocks == len(model.module)
    assert known.has_tp_plan == bool(model.tp_plan)
    assert known.n_params == sum(p.numel() for p in model.module.parameters())
    widths = tp_widths(model)
    if arch == "gpt":  # heads split whole: the q, k, v widths in units of one head;
        head_dim = spec.size_dict()["d_model"] // spec.size_dict()["n_head"]
        widths = tuple(dict.fromkeys(w // head_dim for w in widths))
        # and the sequence, which sequence parallelism splits between blocks
        assert model.sp_plan
        widths += (spec.size_dict()["seq_len"],)
    for devices in range(1, 9):
        splits = all(w % devices == 0 for w in widths)
        assert (known.tp_problem(devices) is None) == splits, (devices, widths)


FACTORIES = {
    "import_error": ("import numpy_that_does_not_exist\n", "cannot import 'broken_import_error'"),
    "wrong_return": ("def build():\n    return (1, 2)\n", "returned tuple, not dict(blocks="),
    "raises": ("def build():\n    raise RuntimeError('no GPU here')\n", "raised RuntimeError"),
    "no_chain": (
        """
        import torch
        from torch import nn
        def build():
            def batch(n, g):
                return torch.randn(n, 8, generator=g), torch.zeros(n, dtype=torch.long)
            blocks = nn.Sequential(nn.Linear(8, 16), nn.Linear(32, 4))
            return dict(blocks=blocks, loss=nn.CrossEntropyLoss(), batch=batch)
        """,
        "blocks do not chain on the batch: block 1 (Linear)",
    ),
    "not_deterministic": (
        """
        import torch
        from torch import nn
        def build():
            def batch(n, g):
                return torch.randn(n, 8), torch.zeros(n, dtype=torch.long)
            return dict(blocks=nn.Sequential(nn.Linear(8, 4)), loss=nn.CrossEntropyLoss(),
                        batch=batch)
        """,
        "batch is not deterministic",
    ),
    "not_scalar": (
        """
        import torch
        from torch import nn
        def build():
            def batch(n, g):
                return torch.randn(n, 8, generator=g), torch.zeros(n, dtype=torch.long)
            return dict(blocks=nn.Sequential(nn.Linear(8, 4)),
                        loss=nn.CrossEntropyLoss(reduction="none"), batch=batch)
        """,
        "loss must return a scalar",
    ),
    "bad_plan": (
        """
        import torch
        from torch import nn
        def build():
            def batch(n, g):
                return torch.randn(n, 8, generator=g), torch.zeros(n, dtype=torch.long)
            return dict(blocks=nn.Sequential(nn.Linear(8, 4)), loss=nn.CrossEntropyLoss(),
                        batch=batch, tp_plan={"3.fc": "colwise"})
        """,
        "tp_plan names '3.fc'",
    ),
}


@pytest.mark.parametrize("case", FACTORIES)
def test_a_broken_factory_is_refused_naming_it(tmp_path, monkeypatch, case):
    source, message = FACTORIES[case]
    module = f"broken_{case}"
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
    monkeypatch.chdir(tmp_path)  # found on the working directory, as a user's would be
    cfg = {
        "models": {"mine": {"arch": "custom", "factory": f"{module}:build", "batch_size": 8}},
        "strategies": ["single", "ddp"],
        "devices": [1, 2],
        "repeats": 1,
    }
    found = problems(cfg)
    assert len(found) == 1, found
    assert found[0].startswith("models.mine.factory: "), found
    assert message in found[0], found


MODULE_FACTORY = """
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        # the longest list, but of two classes: not blocks
        self.stem = nn.ModuleList([nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU()])
        self.heads = nn.ModuleList(nn.Identity() for _ in range(5))  # one class, no weights
        self.body = nn.Module()
        self.body.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        for m in [*self.stem, *self.heads, *self.body.layers]:
            x = m(x)
        return self.head(x)

def build():
    def batch(n, g):
        return torch.randn(n, 8, generator=g), torch.zeros(n, dtype=torch.long)
    return dict(module=Net(), loss=nn.CrossEntropyLoss(), batch=batch)
"""


@pytest.mark.parametrize(
    "blocks, found, problem",
    [
        (None, ("body.layers.0", "body.layers.1", "body.layers.2"), None),
        ("stem", ("stem.0", "stem.1", "stem.2", "stem.3"), None),  # named: as the user says
        ("body.nope", (), "models.mine.blocks: 'body.nope' is not a module of the model"),
        ("head", (), "models.mine.blocks: 'head' (Linear) holds no blocks"),
    ],
)
def test_a_modules_blocks_are_found_or_named(tmp_path, monkeypatch, blocks, found, problem):
    (tmp_path / "net.py").write_text(MODULE_FACTORY)
    monkeypatch.chdir(tmp_path)
    entry = {"arch": "custom", "factory": "net:build", "batch_size": 8}
    if blocks:
        entry["blocks"] = blocks
    cfg = {"models": {"mine": entry}, "strategies": ["single", "fsdp"], "devices": [1, 2]}
    got = problems({**cfg, "repeats": 1})
    if problem:
        assert got == [problem]
        return
    assert got == []
    model = build(ModelSpec.of(**entry_sizes(entry)), 0)
    assert model.block_names == found and not model.sequential


def entry_sizes(entry: dict) -> dict:
    return {k: v for k, v in entry.items() if k != "batch_size"}


def test_tp_is_skipped_for_a_model_without_a_plan(tmp_path, monkeypatch):
    """Not the config's mistake: a sweep of every strategy meets models without a plan,
    so their tp cells are skipped with the reason, and the rest of the sweep runs."""
    (tmp_path / "plain.py").write_text(
        textwrap.dedent(FACTORIES["not_scalar"][0]).replace('reduction="none"', "")
    )
    monkeypatch.chdir(tmp_path)
    cfg = {
        "models": {"mine": {"arch": "custom", "factory": "plain:build", "batch_size": 8}},
        "strategies": ["single", "tp"],
        "devices": [1, 2],
        "repeats": 1,
    }
    assert problems(checked(cfg)) == []
    (reason,) = skipped(checked(cfg))
    assert "tp needs a tensor-parallel plan, and models.mine declares none" in reason


def test_batch_dependent_and_random_layers_are_named():
    model = build(GPT, 0)
    assert maths_notes(model) == {"batch": [], "random": []}
    model.module.append(torch.nn.Sequential(torch.nn.BatchNorm1d(4), torch.nn.Dropout(0.1)))
    notes = maths_notes(model)
    (batch,), (random,) = notes["batch"], notes["random"]
    assert batch.startswith("BatchNorm1d at blocks.6.0 normalises over the samples")
    assert random.startswith("Dropout(p=0.1) at blocks.6.1 draws random masks")


STAGED_FACTORY = """
import torch
from torch import nn

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, h, keep):
        return torch.tanh(self.linear(h)) * keep

class Net(nn.Module):
    def __init__(self, residual_outside, tie, drop):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(Block() for _ in range(3))
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 16, bias=False)
        if tie:
            self.head.weight = self.embed.weight
        self.residual_outside, self.drop = residual_outside, drop

    def forward(self, x):
        keep = (x != 0).unsqueeze(-1)  # a mask from the input's values (padding)
        h = self.embed(x)
        for i, layer in enumerate(self.layers):
            if self.training and i == self.drop:
                continue  # as layerdrop may, in training only
            h = h + layer(h, keep) if self.residual_outside else layer(h, keep)
        return self.head(self.norm(h)).flatten(1)

def build(residual_outside=False, tie=False, drop=None):
    def batch(n, g):
        return torch.randint(0, 16, (n, 4), generator=g), torch.zeros(n, dtype=torch.long)
    return dict(module=Net(residual_outside, tie, drop), loss=nn.CrossEntropyLoss(), batch=batch)
"""


@pytest.mark.parametrize(
    "args, why",
    [
        ({}, None),
        (
            {"residual_outside": True},
            "its forward uses block layers.2's input again besides the block (as in h = h + "
            "block(h)): a stage beginning at layers.2 would not have it",
        ),
        ({"tie": True}, "embed and head share a parameter (tied weights)"),
    ],
)
def test_stages_are_cut_from_a_modules_own_forward_or_skipped_saying_why(
    tmp_path, monkeypatch, args, why
):
    """Stages of a module with a forward of its own: the embedding on the first, the
    norm and head on the last, chained they give the model's output and hold each
    parameter once; a forward that carries more across a cut, or weights tied across
    stages, is skipped before any process with the reason."""
    from parabench.checks import static_skip_reason
    from parabench.config import cells
    from parabench.models import stages

    (tmp_path / "staged.py").write_text(STAGED_FACTORY)
    monkeypatch.chdir(tmp_path)
    entry = {"arch": "custom", "factory": "staged:build", "args": args, "batch_size": 8}
    cfg = {"models": {"mine": entry}, "strategies": ["pipeline"], "devices": [2], "repeats": 1}
    found = problems(cfg)  # with nothing else to run, the skip refuses the config
    assert found == (
        []
        if why is None
        else [
            f"{static_skip_reason(cells(cfg)[0].spec)} "
            "(and nothing else this config asks for can run)"
        ]
    )
    (cell,) = cells(cfg)
    skip = static_skip_reason(cell.spec)
    if why:
        assert skip.startswith("pipeline cuts stages between the blocks of models.mine: ")
        assert why in skip, skip
        return
    assert skip is None
    model = build(ModelSpec.of(**entry_sizes(entry)), 0)
    how = stages.trace(model)
    assert (how.prefix, how.suffix) == (("embed",), ("norm", "head"))
    x, _ = model.batch(5, torch.Generator().manual_seed(1))
    first, second = stages.cut(model, how, 0, 1), stages.cut(model, how, 1, 3)
    # the second stage runs the forward on the input too: its mask is the real one
    assert (x == 0).any() and torch.equal(second.fed([x])(first(x)), model.module(x))
    held = [{n for n, _ in s.part.named_parameters()} for s in (first, second)]
    assert held[0] == {"embed.weight", "layers.0.linear.weight", "layers.0.linear.bias"}
    assert not held[0] & held[1]
    assert held[0] | held[1] == {n for n, _ in model.module.named_parameters()}


def test_a_stage_whose_block_a_training_forward_skips_says_so(tmp_path, monkeypatch):
    """What one forward in eval mode cannot show (a block dropped in training, as
    layerdrop drops them) stops the stage, naming the block, never trains wrongly."""
    from parabench.models import stages

    (tmp_path / "staged.py").write_text(STAGED_FACTORY)
    monkeypatch.chdir(tmp_path)
    spec = ModelSpec.of(arch="custom", factory="staged:build", args={"drop": 1})
    model = build(spec, 0)
    how = stages.trace(model)
    assert how.problem is None
    x, _ = model.batch(4, torch.Generator().manual_seed(1))
    with pytest.raises(RuntimeError, match=r"did not call block layers\.1, where this stage"):
        stages.cut(model, how, 0, 1)(x)  # sends at block 1, which never comes
    with pytest.raises(RuntimeError, match=r"did not call block layers\.1, where this stage"):
        stages.cut(model, how, 1, 3).fed([x])(torch.zeros(4, 4, 8))
