"""What planning must know of a preset model, from its sizes alone, torch-free.

The Snakefile plans before any torch is imported: how many blocks a stage cut can fall
between, which widths tensor parallelism splits, which sizes cannot build a model. Each
preset's facts are a function of its sizes, and its builder (presets.py) builds from
the same functions (`gpt_layout` names the blocks the builder stacks), so the two
cannot drift; tests/test_models.py checks every preset's facts against the model it
builds.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

# Default sizes: the seeds' MLP and the DDP tutorial's SeqNet; gpt's are GPT-2 small's
# shape. A custom model names its factory, the factory's arguments and, where its file
# is not in the working directory, the directory that holds it (custom.py).
DEFAULTS: dict[str, dict] = {
    "mlp": {"dims": [1000, 400, 300, 200, 100, 50, 1]},
    "seqnet": {"dims": [784, 200, 200, 10]},
    "resmlp": {"d_in": 256, "width": 256, "depth": 8, "classes": 10},
    "gpt": {"vocab": 50257, "seq_len": 1024, "n_layer": 12, "n_head": 12, "d_model": 768},
    "custom": {"factory": None, "args": {}, "blocks": None, "path": None},
    "hf": {"model_type": None, "config": {}, "seq_len": 128, "blocks": None},
}
PRESETS: tuple[str, ...] = ("mlp", "seqnet", "resmlp", "gpt")


# What sequence parallelism splits (strategies/tp.py), checked whether or not a cell
# asks for it: the option is per strategy, the facts per model.
SEQUENCE = "the sequence between blocks (sequence parallel; sequence_parallel: false keeps it)"


@dataclass(frozen=True)
class TPSplit:
    """Widths that tensor parallelism cuts into one slice per rank, and the size key
    they come from (the key a message names)."""

    key: str
    what: str  # "the widths", "attention heads", ...
    widths: tuple[int, ...]

    def problem(self, devices: int) -> str | None:
        bad = [w for w in self.widths if w % devices]
        if not bad:
            return None
        shown = self.widths[0] if len(self.widths) == 1 else list(self.widths)
        return (
            f"{self.key}: tensor parallel splits {self.what} {shown} over {devices} ranks, "
            f"and {bad[0] if len(bad) == 1 else bad} do not divide by {devices}"
        )


# Blocks of a model planning could not build: no stage cell is skipped for having
# too few (checks.shape_skip_reason); the rank cuts the real model, or says why not.
UNKNOWN_BLOCKS = sys.maxsize


@dataclass(frozen=True)
class ModelFacts:
    n_blocks: int  # blocks a stage cut can fall between (pipeline, model parallel)
    has_tp_plan: bool  # the model declares layers for tensor parallelism
    tp_splits: tuple[TPSplit, ...] = ()
    problems: tuple[str, ...] = field(default=())  # "key: message", key under models.<name>
    # Why no stage can be cut from this model (models/stages.py), so pipeline and
    # model parallel skip it: tied weights across stages, a forward that carries more
    # than one activation from block to block.
    cut_skip: str | None = None
    # Why tensor parallelism cannot apply to this model at all (its cells are skipped
    # with it), where a model without a plan is not a mistake in the config.
    tp_skip: str | None = None
    # Parameters of the whole model (what each cell's params.pt holds, in fp32); None
    # where planning does not build the model (arch: hf).
    n_params: int | None = None

    def tp_problem(self, devices: int) -> str | None:
        """Why tensor parallelism cannot split this model over `devices`, or None."""
        for split in self.tp_splits:
            if why := split.problem(devices):
                return why
        return None


def linear_pairs(n_linear: int) -> list[tuple[int, int]]:
    """The pairs of a stack of Linear layers that tensor parallelism splits: (0, 1),
    (2, 3), ..., the first column-wise, the second row-wise; an odd last layer stays
    replicated. The mlp presets' plan (presets.py) and their widths here both use it."""
    return [(i, i + 1) for i in range(0, n_linear - 1, 2)]


def gpt_layout(n_layer: int) -> list[str]:
    """The gpt preset's blocks, in order: what a stage cut falls between."""
    return ["embed", *(["block"] * n_layer), "head"]


def _linear(a: int, b: int, bias: bool = True) -> int:
    """Parameters of nn.Linear(a, b)."""
    return a * b + (b if bias else 0)


def _mlp(sizes: Mapping) -> ModelFacts:
    dims = list(sizes["dims"])
    # layer i maps dims[i] to dims[i + 1]: a pair (i, i + 1) splits its inner width
    inner = tuple(dims[i + 1] for i, _ in linear_pairs(len(dims) - 1))
    split = TPSplit("dims", "the widths", inner)
    n = sum(_linear(a, b) for a, b in itertools.pairwise(dims))
    return ModelFacts(len(dims) - 1, True, (split,), n_params=n)


def _resmlp(sizes: Mapping) -> ModelFacts:
    w, hidden = sizes["width"], 4 * sizes["width"]
    split = TPSplit("width", "the MLP's 4 x width", (hidden,))
    # input layer; per block LayerNorm + fc1 + fc2; LayerNorm + the classifier
    block = 2 * w + _linear(w, hidden) + _linear(hidden, w)
    n = _linear(sizes["d_in"], w) + sizes["depth"] * block + 2 * w + _linear(w, sizes["classes"])
    return ModelFacts(sizes["depth"] + 2, True, (split,), n_params=n)


def _gpt(sizes: Mapping) -> ModelFacts:
    d, heads = sizes["d_model"], sizes["n_head"]
    problems = () if d % heads == 0 else (f"d_model: {d} is not divisible by n_head ({heads})",)
    split = TPSplit("n_head", "attention heads", (heads,))
    sequence = TPSplit("seq_len", SEQUENCE, (sizes["seq_len"],))
    # embeddings; per block two LayerNorms, q, k, v, out, the 4x MLP; LayerNorm + head
    block = 4 * d + 4 * _linear(d, d) + _linear(d, 4 * d) + _linear(4 * d, d)
    vocab = sizes["vocab"]
    n = (vocab + sizes["seq_len"]) * d + sizes["n_layer"] * block + 2 * d + vocab * d
    splits = (split, sequence)
    return ModelFacts(len(gpt_layout(sizes["n_layer"])), True, splits, problems, n_params=n)


PRESET_FACTS = {"mlp": _mlp, "seqnet": _mlp, "resmlp": _resmlp, "gpt": _gpt}


def preset_facts(arch: str, sizes: Mapping) -> ModelFacts:
    """Facts of a preset at these sizes (the defaults under them)."""
    return PRESET_FACTS[arch]({**DEFAULTS[arch], **sizes})
