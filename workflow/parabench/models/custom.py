"""Your own model: `arch: custom`, `factory: "module.path:function"`, `args: {...}`.

The factory is plain PyTorch. Called with `args` as keyword arguments, it returns
dict(blocks=nn.Sequential, loss=callable(output, target) -> scalar mean,
batch=callable(batch_size, generator) -> (inputs, targets)), and optionally tp_plan=
{module name: "colwise" | "rowwise" | a ParallelStyle}. Or, for a model as it is
written (any nn.Module with a forward of its own), module= in place of blocks=: its
repeated blocks are found (the largest ModuleList of one class) or named by the config
key `blocks`. The module is found on the working directory or PYTHONPATH. See
docs/custom-models.md.

The factory is imported and checked when the workflow plans, before any job: an import
that fails, a factory that raises, a return value that breaks the contract, blocks that
do not chain on the batch, a loss that is not a scalar. Each problem is one sentence;
the config check prefixes the key (models.<name>.factory). Whether stages can be cut
from a module is read then too (stages.trace): where not, its stage cells are skipped.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from typing import TYPE_CHECKING

import torch
from torch import nn

from parabench.models.base import Model, example_batch
from parabench.models.facts import ModelFacts, TPSplit

if TYPE_CHECKING:
    from parabench.spec import ModelSpec


class FactoryError(ValueError):
    """The factory cannot give a model that keeps the contract."""

    key = "factory"  # the config key it is about, under models.<name>


class BlocksError(FactoryError):
    """The config's `blocks` names no container of blocks in the model."""

    key = "blocks"


def _load(path: str):
    module_name, _, function = path.partition(":")
    if not module_name or not function:
        raise FactoryError(f"{path!r} is not 'module.path:function'")
    if os.getcwd() not in sys.path:  # "on the working directory or PYTHONPATH"
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise FactoryError(f"cannot import {module_name!r} ({type(e).__name__}: {e})") from e
    fn = getattr(module, function, None)
    if not callable(fn):
        raise FactoryError(f"module {module_name!r} has no function {function!r}")
    return fn


def build_custom(spec: ModelSpec) -> Model:
    """Call the factory (the caller has seeded torch) and check what it returns."""
    sizes = spec.size_dict()
    fn = _load(sizes["factory"])
    args = dict(sizes.get("args") or {})
    try:
        got = fn(**args)
    except Exception as e:
        raise FactoryError(f"the factory raised {type(e).__name__}: {e}") from e
    if not isinstance(got, dict) or not (
        {"loss", "batch"} <= set(got) and len({"blocks", "module"} & set(got)) == 1
    ):
        kind = f"a dict with keys {sorted(got)}" if isinstance(got, dict) else type(got).__name__
        raise FactoryError(
            f"returned {kind}, not dict(blocks=..., loss=..., batch=...) "
            "or dict(module=..., loss=..., batch=...)"
        )
    loss, batch = got["loss"], got["batch"]
    if "blocks" in got:
        module = got["blocks"]
        if not isinstance(module, nn.Sequential) or len(module) == 0:
            raise FactoryError(
                f"blocks must be a non-empty nn.Sequential, got {type(module).__name__} "
                "(a module with a forward of its own is returned as module=)"
            )
        names: tuple[str, ...] = ()
    else:
        module = got["module"]
        if not isinstance(module, nn.Module):
            raise FactoryError(f"module must be an nn.Module, got {type(module).__name__}")
        try:
            names = find_blocks(module, sizes.get("blocks"))
        except ValueError as e:
            raise BlocksError(str(e)) from None
    for key, value in (("loss", loss), ("batch", batch)):
        if not callable(value):
            raise FactoryError(f"{key} must be callable, got {type(value).__name__}")
    plan = got.get("tp_plan") or {}
    if not isinstance(plan, dict):
        raise FactoryError(f"tp_plan must be a dict, got {type(plan).__name__}")
    where = "blocks" if "blocks" in got else "module"
    for fqn in plan:
        try:
            module.get_submodule(fqn)
        except AttributeError:
            raise FactoryError(f"tp_plan names {fqn!r}, which is not a module of {where}") from None
    return Model(module, loss, batch, dict(plan), device_batches=False, block_names=names)


def find_blocks(module: nn.Module, named: str | None = None) -> tuple[str, ...]:
    """The names of `module`'s repeated blocks: the children of the container `named`
    (dotted, e.g. "model.layers"), else of the ModuleList of one class holding the most
    parameters (the decoder layers of a transformer, not a layer's heads or experts),
    else none: FSDP then shards the module as one unit."""
    if named:
        try:
            container = module.get_submodule(named)
        except AttributeError:
            raise ValueError(f"{named!r} is not a module of the model") from None
        children = [f"{named}.{name}" for name, _ in container.named_children()]
        if not children:
            raise ValueError(f"{named!r} ({type(container).__name__}) holds no blocks")
        return tuple(children)
    best: tuple[str, ...] = ()
    most = 0  # parameters: a layer's own list (heads, experts) holds fewer than the layers
    for prefix, sub in module.named_modules():
        if not isinstance(sub, nn.ModuleList) or len({type(child) for child in sub}) != 1:
            continue
        held = sum(p.numel() for p in sub.parameters())
        if held > most:
            most = held
            best = tuple(f"{prefix}.{name}" if prefix else name for name, _ in sub.named_children())
    return best


def check_runs(model: Model, n: int = 4) -> None:
    """The batch is deterministic, the blocks chain on it, the loss is a scalar."""
    try:
        x, y = example_batch(model, n)
        x2, _ = example_batch(model, n)
    except Exception as e:
        raise FactoryError(f"batch({n}, generator) raised {type(e).__name__}: {e}") from e
    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
        raise FactoryError("batch must return (inputs, targets) tensors")
    if x.shape[0] != n or y.shape[0] != n:
        raise FactoryError(f"batch({n}, ...) gave a first dimension of {x.shape[0]}, not {n}")
    if not torch.equal(x, x2):
        raise FactoryError("batch is not deterministic: draw every value from the generator")
    act = x
    with torch.no_grad():
        if not model.sequential:
            try:
                act = model.module(act)
            except Exception as e:
                raise FactoryError(f"module(inputs) raised {type(e).__name__}: {e}") from e
        for i, block in enumerate(model.blocks() if model.sequential else []):
            try:
                act = block(act)
            except Exception as e:
                raise FactoryError(
                    f"blocks do not chain on the batch: block {i} ({type(block).__name__}) "
                    f"raised {type(e).__name__}: {e}"
                ) from e
        try:
            value = model.loss_fn(act, y)
        except Exception as e:
            raise FactoryError(f"loss(output, target) raised {type(e).__name__}: {e}") from e
    if not isinstance(value, torch.Tensor) or value.dim() != 0:
        raise FactoryError("loss must return a scalar tensor (the mean over the batch)")


def tp_widths(model: Model) -> tuple[int, ...]:
    """What the model's own tensor-parallel plan splits: each column-wise Linear's
    outputs and each row-wise Linear's inputs (a custom ParallelStyle: not known)."""
    widths = []
    for name, style in model.tp_plan.items():
        layer = model.module.get_submodule(name)
        if isinstance(layer, nn.Linear) and style in ("colwise", "rowwise"):
            widths.append(layer.out_features if style == "colwise" else layer.in_features)
    return tuple(dict.fromkeys(widths))


@functools.cache
def inspect_factory(spec: ModelSpec) -> ModelFacts:
    """Import, call and check the factory once per process (planning, each cell)."""
    try:
        torch.manual_seed(0)
        model = build_custom(spec)
        check_runs(model)
    except FactoryError as e:
        return ModelFacts(0, False, problems=(f"{e.key}: {e}",))
    from parabench.models import stages

    split = TPSplit("factory", "the planned layers' widths", tp_widths(model))
    return ModelFacts(
        len(model.block_names),
        bool(model.tp_plan),
        (split,) if split.widths else (),
        cut_skip=stages.trace(model).problem,
        n_params=sum(p.numel() for p in model.module.parameters()),
    )
