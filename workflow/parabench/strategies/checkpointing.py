"""Activation checkpointing (AC) of a model's repeated blocks: an axis like precision.

A checkpointed block keeps only its input from the forward; backward runs its forward
again to rebuild the activations it needs (the recompute), trading compute for
memory. Levels (layout.AC_PATTERN), as torchtitan's `activation_checkpoint` offers:
- full: every repeated block;
- selective: every block, under torchtitan's per-op policy: the results of every
  other matmul, of attention and of collectives are saved, the cheap elementwise ops
  recomputed (less memory saved than full, little compute added);
- every<k>: every k-th block in full (torchtitan's per-layer option).

Applied in place, as compile is (`block.forward` replaced): parameter names stay the
model's, where torch's `checkpoint_wrapper` would put `_checkpoint_wrapped_module.`
into each. Non-reentrant checkpointing, as torchtitan uses: it composes with FSDP2,
DTensor and torch.compile, and leaves the maths bitwise as it was.

The recompute runs inside backward in a RECOMPUTE region (process/marks.py), so the anatomy
measures what it costs (`recompute_s`, a share of compute). Autograd marks the forward
it replays by a graph task, which is how a block tells a recompute from its forward.
"""

from __future__ import annotations

import collections
import functools
import threading

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from parabench.process.marks import RECOMPUTE, region


def repeated(blocks: list[nn.Module]) -> list[nn.Module]:
    """The blocks of the most common class between the first and the last (a
    transformer's layers, not its embedding or head, where a model declares those as
    blocks too: a sequential model's children; at one layer, or where the embedding
    and the head share a class, the middle still tells)."""
    if not blocks:
        return []
    middle = blocks[1:-1] or blocks
    common = collections.Counter(type(b) for b in middle).most_common(1)[0][0]
    return [b for b in blocks if type(b) is common]


def every(level: str) -> int:
    """Which blocks a level checkpoints: every k-th (1: all; 0: none)."""
    if level == "none":
        return 0
    return int(level.removeprefix("every")) if level.startswith("every") else 1


def apply(
    blocks: list[nn.Module], level: str, within: list[nn.Module] | None = None
) -> list[nn.Module]:
    """Checkpoint the model's `blocks` (each repeated block, or every k-th of them) at
    `level`, in place, those `within` a pipeline stage's only; the blocks checkpointed.
    Chosen over the whole model: a stage of an embedding and one layer must checkpoint
    the layer, and every k-th counts across stages as it does without them."""
    k = every(level)
    if not k:
        return []
    chosen = [b for i, b in enumerate(repeated(blocks)) if (i + 1) % k == 0]
    if within is not None:
        chosen = [b for b in chosen if any(b is w for w in within)]
    context = _selective if level == "selective" else _plain
    for block in chosen:
        block.forward = functools.partial(
            checkpoint, _marked(block.forward), use_reentrant=False, context_fn=context
        )
        block._parabench_ac = level
    return chosen


def count(blocks: list[nn.Module]) -> int:
    """How many of `blocks` `apply` checkpointed."""
    return sum(hasattr(b, "_parabench_ac") for b in blocks)


_replaying = threading.local()


def recomputing() -> bool:
    """Whether this thread is inside a checkpointed block's recompute (what advise's
    op counter books apart: predict/fakerank.py)."""
    return getattr(_replaying, "depth", 0) > 0


def _marked(forward):
    """`forward`, inside a RECOMPUTE region when backward replays it."""

    @functools.wraps(forward)
    def run(*args, **kwargs):
        # Under torch.compile the recompute is the compiled graph's, unmarked (reading
        # autograd's graph task would break the graph): recompute_s is then not measured.
        if torch.compiler.is_compiling() or torch._C._current_graph_task_id() == -1:
            return forward(*args, **kwargs)
        _replaying.depth = getattr(_replaying, "depth", 0) + 1
        try:
            with region(RECOMPUTE, traced=False):
                return forward(*args, **kwargs)
        finally:
            _replaying.depth -= 1

    return run


def _plain():
    return torch.utils.checkpoint.noop_context_fn()


def _saved_ops() -> set:
    """torchtitan's per-op save list (torchtitan/models/llama3/infra/parallelize.py
    `_save_list`: mm, the attention kernels, reduce_scatter_tensor, max), with the
    CPU's attention kernel and two of parabench's own: addmm, a biased linear's matmul
    (torchtitan's Llama has no biases), saved every time, as the every-other rule
    counts mm only (so a biased model's linears all keep their outputs: the GPT
    preset's); and all_reduce, tensor parallelism's row-wise output without sequence
    parallelism (which torchtitan always runs), the reduce-scatter's counterpart, so
    that the recompute issues no collective. What a selective block keeps."""
    ops = torch.ops
    names = [
        (ops.aten, "mm"),
        (ops.aten, "addmm"),
        (ops.aten, "_scaled_dot_product_efficient_attention"),
        (ops.aten, "_scaled_dot_product_flash_attention"),
        (ops.aten, "_scaled_dot_product_flash_attention_for_cpu"),
        (ops.aten, "_scaled_dot_product_cudnn_attention"),
        (ops._c10d_functional, "reduce_scatter_tensor"),
        (ops._c10d_functional, "all_reduce"),
        (ops.aten, "max"),
    ]
    out = set()
    for namespace, name in names:
        op = getattr(namespace, name, None)
        if op is not None:
            out.add(op.default)
    return out


def _selective():
    """A block call's policy (context_fn runs once per call, so counts start at 0)."""
    saved, mm = _saved_ops(), torch.ops.aten.mm.default
    count = collections.Counter()

    def policy(ctx, func, *args, **kwargs):
        # torchtitan saves every other matmul: the forward and its recompute count
        # their own, so both take the same decisions.
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == mm:
            count[mode] += 1
        keep = func in saved and not (func == mm and count[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)
