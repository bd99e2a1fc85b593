"""The preset models, built from their sizes (the defaults under what the config gives).

`mlp` (the seed MLP), `seqnet` (the DDP tutorial's net), `resmlp` (uniform pre-norm
residual MLP blocks) and `gpt` (a decoder-only transformer in nanoGPT's shape). Their
planning facts (blocks, tensor-parallel widths) are facts.py's, from the same sizes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping

import torch
from torch import nn
from torch.nn import functional as F

from parabench.models.base import Model
from parabench.models.facts import DEFAULTS, gpt_layout, linear_pairs

# ---------------------------------------------------------------- MLP-like presets


class Residual(nn.Module):
    """Pre-norm residual MLP block: x + W2·gelu(W1·LN(x)). Uniform cost per block."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def _linear_stack(dims: list[int], last: nn.Module | None) -> nn.Sequential:
    blocks: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(dims)):
        is_last = i == len(dims) - 2
        act = last if is_last else nn.ReLU()
        blocks.append(nn.Sequential(nn.Linear(a, b), act) if act is not None else nn.Linear(a, b))
    return nn.Sequential(*blocks)


def linear_plan(blocks: nn.Sequential) -> dict[str, str]:
    """The TP plan of a stack of Linear layers (facts.linear_pairs)."""
    names = [
        name
        for name, m in blocks.named_modules()
        if isinstance(m, nn.Linear) and name.count(".") <= 1
    ]
    plan = {}
    for first, second in linear_pairs(len(names)):
        plan[names[first]], plan[names[second]] = "colwise", "rowwise"
    return plan


def features_batch(features: int, classes: int | None) -> Callable:
    """Gaussian features; targets in {0, 1} of shape (n, 1) (classes None: binary, for
    BCE) or class labels."""

    def batch(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, features, generator=gen, device=gen.device)
        if classes is None:
            y = torch.randint(0, 2, (n, 1), generator=gen, device=gen.device).float()
        else:
            y = torch.randint(0, classes, (n,), generator=gen, device=gen.device)
        return x, y

    return batch


def _mlp(sizes: Mapping) -> Model:
    dims = list(sizes["dims"])
    blocks = _linear_stack(dims, nn.Sigmoid())
    return Model(blocks, nn.BCELoss(), features_batch(dims[0], None), linear_plan(blocks))


def _seqnet(sizes: Mapping) -> Model:
    dims = list(sizes["dims"])
    blocks = _linear_stack(dims, None)
    batch = features_batch(dims[0], dims[-1])
    return Model(blocks, nn.CrossEntropyLoss(), batch, linear_plan(blocks))


def _resmlp(sizes: Mapping) -> Model:
    d_in, width = sizes["d_in"], sizes["width"]
    classes, depth = sizes["classes"], sizes["depth"]
    blocks = nn.Sequential(
        nn.Sequential(nn.Linear(d_in, width), nn.GELU()),
        *(Residual(width) for _ in range(depth)),
        nn.Sequential(nn.LayerNorm(width), nn.Linear(width, classes)),
    )
    plan = {}
    for i in range(1, depth + 1):
        plan[f"{i}.fc1"], plan[f"{i}.fc2"] = "colwise", "rowwise"
    return Model(blocks, nn.CrossEntropyLoss(), features_batch(d_in, classes), plan)


# ---------------------------------------------------------------- gpt (nanoGPT's shape)


class Embed(nn.Module):
    """Token plus learned position embeddings: (B, T) token ids -> (B, T, d)."""

    def __init__(self, vocab: int, seq_len: int, d: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq_len, d)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.wte(idx) + self.wpe(pos)


class Attention(nn.Module):
    """Causal self-attention through scaled_dot_product_attention. q, k and v are three
    Linear layers so tensor parallelism can split each by heads; the head count is read
    from the tensors (-1), so a rank holding 1/n of the heads computes just those."""

    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.head_dim = d // n_head
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
            for proj in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(LN(x)), then x + mlp(LN(x))."""

    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(d), Attention(d, n_head)
        self.ln2, self.mlp = nn.LayerNorm(d), MLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    def __init__(self, d: int, vocab: int) -> None:
        super().__init__()
        self.ln_f, self.lm_head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the vocabulary, mean over every token of the batch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def token_batch(vocab: int, seq_len: int) -> Callable:
    """Random token sequences; the targets are the inputs shifted by one."""

    def batch(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, vocab, (n, seq_len + 1), generator=gen, device=gen.device)
        return tokens[:, :-1], tokens[:, 1:]

    return batch


def _gpt(sizes: Mapping) -> Model:
    vocab, seq_len = sizes["vocab"], sizes["seq_len"]
    n_layer, n_head, d = sizes["n_layer"], sizes["n_head"], sizes["d_model"]
    # Embedding and head untied (nanoGPT ties them): tied weights would belong to the
    # first and the last pipeline stage, and to two FSDP units, at once.
    make = {
        "embed": lambda: Embed(vocab, seq_len, d),
        "block": lambda: Block(d, n_head),
        "head": lambda: Head(d, vocab),
    }
    blocks = nn.Sequential(*(make[kind]() for kind in gpt_layout(n_layer)))
    # nanoGPT's initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2L).
    for name, p in blocks.named_parameters():
        if name.endswith("bias"):
            nn.init.zeros_(p)
        elif p.dim() >= 2:  # weights and embeddings; LayerNorm keeps its ones
            std = (
                0.02 / math.sqrt(2 * n_layer)
                if name.endswith(("out.weight", "proj.weight"))
                else 0.02
            )
            nn.init.normal_(p, 0.0, std)
    # Megatron's split: q, k, v and the MLP's first layer by columns (heads, hidden
    # units), the attention output and the MLP's second layer by rows.
    plan = {}
    for i in range(1, n_layer + 1):
        for name in ("attn.q", "attn.k", "attn.v", "mlp.fc"):
            plan[f"{i}.{name}"] = "colwise"
        for name in ("attn.out", "mlp.proj"):
            plan[f"{i}.{name}"] = "rowwise"
    # Sequence parallel (torchtitan's plan for Llama, on nanoGPT's modules): each block's
    # norms on its part of the sequence, its attention's and MLP's input gathered, their
    # row-wise outputs reduce-scattered; the embeddings and the head split over the
    # vocabulary (the position table over positions, added to the matching part).
    last = n_layer + 1
    sp = {"0.wte": "embed_to_sequence", "0.wpe": "positions_to_sequence"}
    for i in range(1, last):
        for norm, inner, out in (("ln1", "attn", "attn.out"), ("ln2", "mlp", "mlp.proj")):
            sp[f"{i}.{norm}"], sp[f"{i}.{inner}"] = "sequence", "gather"
            sp[f"{i}.{out}"] = "rowwise_to_sequence"
    sp[f"{last}.ln_f"], sp[f"{last}.lm_head"] = "sequence", "colwise_from_sequence"
    return Model(
        blocks,
        lm_loss,
        token_batch(vocab, seq_len),
        plan,
        tokens_per_sample=seq_len,
        sp_plan=sp,
    )


_BUILDERS: dict[str, Callable[[Mapping], Model]] = {
    "mlp": _mlp,
    "seqnet": _seqnet,
    "resmlp": _resmlp,
    "gpt": _gpt,
}


def _with_defaults(arch: str) -> Callable[[Mapping], Model]:
    return lambda sizes: _BUILDERS[arch]({**DEFAULTS[arch], **sizes})


# Each preset's builder from its sizes (the caller has seeded torch: models.build).
PRESET_BUILDERS: dict[str, Callable[[Mapping], Model]] = {a: _with_defaults(a) for a in _BUILDERS}
