"""Your own model: `arch: custom`, `factory: "module:function"`, `args: {...}`, and
optionally `path: dir` (the directory holding the module's file).

The factory is plain PyTorch. Called with `args` as keyword arguments, it returns
dict(blocks=nn.Sequential, loss=callable(output, target) -> scalar mean,
batch=callable(batch_size, generator) -> (inputs, targets)), and optionally tp_plan=
{module name: "colwise" | "rowwise" | a ParallelStyle}. Or, for a model as it is
written (any nn.Module with a forward of its own), module= in place of blocks=: its
repeated blocks are found (the largest ModuleList of one class) or named by the config
key `blocks`. See docs/custom-models.md.

A factory is the user's own code, which a config runs as a Snakefile does: the module is
a file the user provides, `<module>.py` (dots are folders) in the config's `path` or
the working directory, never a file inside a Python installation or environment (the
standard library, installed packages, a virtual environment: any Python's on the host,
not only the running one's). The file is found without importing anything and loaded
by its path under a name of its own (it shadows no module, so its name may be any,
test.py or types.py too); anything else is refused before any of its code runs. The
function must be defined in that file. While the file loads and the factory runs, its
directory is importable after every other (`importable`): it may import a file beside
it, which shadows no module either.

The factory is checked when the workflow plans, before any job, on fake tensors
(FakeTensorMode: no memory, no arithmetic, so a 70B model plans in seconds): an import
that fails, a factory that raises, a return value that breaks the contract, blocks that
do not chain on the batch, a loss that is not a scalar. Each problem is one sentence;
the config check prefixes the key (models.<name>.factory). Whether stages can be cut
from a module is read then too (stages.trace): where not, its stage cells are skipped.
What needs values fake tensors lack is left to the cell, which runs it for real: a
forward that reads them, and a factory that reads one while building, whose facts are
then read off another build that allocates nothing, where one works
(_facts_without_values).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
import re
import site
import sys
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from parabench.models.base import (
    FAKE_LIMITS,
    Model,
    example_batch,
    fake_mode,
    fake_mode_of,
    quiet_fake,
    running,
)
from parabench.models.facts import UNKNOWN_BLOCKS, ModelFacts, TPSplit

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from parabench.spec import ModelSpec


class FactoryError(ValueError):
    """The factory cannot give a model that keeps the contract."""

    key = "factory"  # the config key it is about, under models.<name>


class ReadsValues(FactoryError):
    """The factory read a tensor's value while building, on fake tensors, which have
    none: not the factory's fault (_facts_without_values)."""


class PathError(FactoryError):
    """The config's `path` is no directory of the user's."""

    key = "path"


class BlocksError(FactoryError):
    """The config's `blocks` names no container of blocks in the model."""

    key = "blocks"


# parabench's own modules are no user's factory either.
PARABENCH = Path(__file__).resolve().parents[1]


def _not_yours() -> list[Path]:
    """Where the running Python's own and installed modules live: the standard library,
    the site directories (system, virtual environment, user), its prefixes, and
    parabench itself."""
    paths = sysconfig.get_paths()
    found = [paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths]
    found += site.getsitepackages() if hasattr(site, "getsitepackages") else []
    found += [site.getusersitepackages(), str(PARABENCH)]
    found += [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    resolved = [Path(p).resolve() for p in found if p]
    return [p for p in resolved if p != Path(p.anchor)]  # a prefix of / would be everything


# A directory named so holds a Python's standard library or its installed packages:
# lib/python3.12, lib64/python3.11, lib/pypy3.10, lib/python3.13t.
PYTHON_LIB = re.compile(r"(python|pypy)3(\.\d+)?[a-z]*")


def _is_python_home(d: Path) -> bool:
    """`d` is the root of some Python's modules, whichever Python: any interpreter on
    the host, not only the one running (whose own directories are _not_yours)."""
    if d.name in ("site-packages", "dist-packages"):
        return True
    if d.parent.name in ("lib", "lib64") and PYTHON_LIB.fullmatch(d.name):
        return True
    try:  # a virtual environment's root; a standard library's root
        return (d / "pyvenv.cfg").is_file() or (
            (d / "os.py").is_file() and (d / "site.py").is_file()
        )
    except OSError:  # a directory we may not read is no Python we could be given
        return False


def python_tree(where: Path) -> Path | None:
    """The directory that makes `where` (resolved) part of a Python installation or
    environment, or None: where `where` or a directory above it is the running Python's
    (its prefixes, standard library, site directories) or any Python's (_is_python_home).
    A file there is never the user's own, even one the user could edit."""
    mine = _not_yours()
    for d in (where, *where.parents):
        if d in mine or _is_python_home(d):
            return d
    return None


def locate(factory: str, path: str | None = None) -> tuple[Path, str]:
    """The file of `factory` ('module:function', dots in the module being folders) and
    the function's name, found without importing anything: `<module>.py` (or
    `<module>/__init__.py`) in `path` (relative to the working directory, or absolute),
    else in the working directory; nowhere else. Where the file really is decides, not
    its name (it is loaded under a name of its own, so a file called test.py or
    types.py shadows nothing): FactoryError where `path` or the file lies inside a
    Python installation or environment (any Python's, not only the running one's) or
    parabench, or no such file exists."""
    module, _, function = factory.partition(":")
    parts = module.split(".")
    if not module or not function.isidentifier() or not all(p.isidentifier() for p in parts):
        raise FactoryError(f"{factory!r} is not 'module:function'")
    where = [Path(os.getcwd())]
    if path:
        folder = Path(os.getcwd(), path)
        try:
            home = python_tree(folder.resolve())
        except (OSError, ValueError, RuntimeError):  # a NUL, a loop of links
            raise PathError(f"{path!r} is not a directory a factory could be in") from None
        if home is not None:
            raise PathError(
                f"{path!r} is {folder.resolve()}, inside a Python installation or environment "
                f"({home}): a factory's module is a file of your own"
            )
        where.insert(0, folder)
    rel = Path(*parts)
    for folder in where:
        for candidate in (folder / rel.with_suffix(".py"), folder / rel / "__init__.py"):
            try:
                if not candidate.is_file():
                    continue
                real = candidate.resolve()  # a link to a file elsewhere is that file
            except (OSError, ValueError, RuntimeError):  # a NUL, too long, a loop of links
                continue
            if (home := python_tree(real.parent)) is not None:
                raise FactoryError(
                    f"{candidate} is {real}, a file of Python's or an installed package's "
                    f"({home}), not a module of your own"
                )
            return real, function
    looked = " or ".join(str(d) for d in where)
    known = parts[0] in sys.stdlib_module_names or parts[0] in sys.builtin_module_names
    ours = f"{parts[0]!r} is Python's standard library, never a factory; " if known else ""
    raise FactoryError(
        f"no file {rel}.py in {looked} ({ours}a factory's module is a file of your own, in "
        "the working directory or in the directory models.<name>.path names)"
    )


@functools.cache
def _module(file: Path, label: str):
    """Load the user's file by its path under a name of its own (never `label`, the
    module's name in the config, which an `import` elsewhere could mean), once per
    process."""
    digest = hashlib.sha256(str(file).encode()).hexdigest()[:12]
    name = f"_parabench_factory_{label.replace('.', '_')}_{digest}"
    found = importlib.util.spec_from_file_location(name, file)
    if found is None or found.loader is None:
        raise FactoryError(f"cannot load {file}")
    module = importlib.util.module_from_spec(found)
    sys.modules[name] = module  # as `import` would: dataclasses and pickle look it up
    try:
        with importable(file.parent):
            found.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise FactoryError(f"cannot import {label!r} ({type(e).__name__}: {e})") from e
    return module


@contextlib.contextmanager
def importable(folder: Path) -> Iterator[None]:
    """The factory's own directory (never inside a Python installation: locate refuses
    one) importable while its file loads and while the factory runs, so it may import a
    file beside it (`from helpers import width`), as a script imports the files beside
    it. Appended to sys.path, never first: a file there is found only where no module of
    Python's or of an installed package has its name, so it shadows none (the rule
    PYTHONSAFEPATH keeps for the jobs), and only meanwhile: a later import of a module
    nobody installed never finds the user's file."""
    entry = str(folder)
    added = entry not in sys.path
    if added:
        sys.path.append(entry)
    try:
        yield
    finally:
        if added and entry in sys.path:
            sys.path.remove(entry)


def _load(factory: str, path: str | None = None) -> tuple[Callable, Path]:
    """The factory function and its file."""
    file, function = locate(factory, path)
    label = factory.partition(":")[0]
    module = _module(file, label)
    fn = getattr(module, function, None)
    if not callable(fn):
        raise FactoryError(f"module {label!r} ({file}) has no function {function!r}")
    if getattr(fn, "__module__", None) != module.__name__:
        # e.g. `from subprocess import getoutput` in the user's file
        raise FactoryError(
            f"{function!r} is not defined in {file} (it comes from "
            f"{getattr(fn, '__module__', None)!r}): a factory is a function of your own file"
        )
    return fn, file


def build_custom(spec: ModelSpec, fake: FakeTensorMode | None = None) -> Model:
    """Call the factory (the caller has seeded torch) and check what it returns. With
    `fake`, the factory runs under that FakeTensorMode (its module is loaded outside
    it, so what the file makes at import is real)."""
    sizes = spec.size_dict()
    fn, file = _load(sizes["factory"], sizes.get("path"))
    args = dict(sizes.get("args") or {})
    try:
        with contextlib.ExitStack() as under:
            under.enter_context(importable(file.parent))
            if fake:
                under.enter_context(quiet_fake())
                under.enter_context(fake)
            got = fn(**args)
    except Exception as e:
        if fake and isinstance(e, FAKE_LIMITS):
            raise ReadsValues(f"the factory read a value while building ({e})") from e
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
    if fake is None and fake_mode_of(module) is not None:
        # a factory that keeps what it built (a cache) hands the planning check's model back
        raise FactoryError(
            "returned a model on fake tensors, the one planning's check had it build: the "
            "factory must build a new model on every call (no cache)"
        )
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
    """The batch is deterministic, the blocks chain on it, the loss is a scalar. The
    batch is drawn for real (n samples); the model runs where it was built (on fake
    tensors at planning: shapes are checked, values never read). A forward that needs
    values fake tensors do not have is left to the cell, which runs it for real."""
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
    with running(model.module) as bring, torch.no_grad():
        act, y = bring(x), bring(y)
        try:
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
        except FactoryError as e:
            if isinstance(e.__cause__, FAKE_LIMITS):
                return  # it reads values: the cell runs it for real
            raise
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


def inspect_factory(spec: ModelSpec) -> ModelFacts:
    """Load, call and check the factory once per process (planning, each cell's check),
    the model built on fake tensors: nothing of its size is allocated, no arithmetic
    done, and the cell's own build stays its only real one."""
    return _inspect(spec, os.getcwd())  # the file it names depends on where we are


@functools.cache
def _inspect(spec: ModelSpec, _cwd: str) -> ModelFacts:
    try:
        try:
            model = build_custom(spec, fake=fake_mode())
        except ReadsValues:
            return _facts_without_values(spec)
        check_runs(model)
    except FactoryError as e:
        return ModelFacts(0, False, problems=(f"{e.key}: {e}",))
    from parabench.models import stages

    return _facts(model, cut_skip=stages.trace(model).problem)


def _facts(model: Model, cut_skip: str | None = None) -> ModelFacts:
    split = TPSplit("factory", "the planned layers' widths", tp_widths(model))
    return ModelFacts(
        len(model.block_names),
        bool(model.tp_plan),
        (split,) if split.widths else (),
        cut_skip=cut_skip,
        n_params=sum(p.numel() for p in model.module.parameters()),
    )


def _facts_without_values(spec: ModelSpec) -> ModelFacts:
    """The facts of a factory that reads a value while building (`w.std().item()` for
    its init), which a fake tensor does not have: the same factory works for real, so
    it is not refused. Built again, still allocating nothing, where the values it reads
    need not be known: on fake tensors whose read values are symbols (a value used in
    arithmetic, not in an `if`), else on the meta device (a value read from a tensor
    made on a named device, which is real there). Its parameters, blocks and plan are
    read off that model; running its forward and cutting stages are left to the cell,
    which runs it for real. Where neither build works, those facts are unknown (no
    parameter count; no cell skipped for its blocks or plan) and the cell finds out."""
    for build in (_build_symbolic, _build_meta):
        try:
            return _facts(build(spec))
        except FactoryError as e:
            if e.__cause__ is None:  # built, and what it returned breaks the contract
                return ModelFacts(0, False, problems=(f"{e.key}: {e}",))
    return ModelFacts(UNKNOWN_BLOCKS, True)


def _build_symbolic(spec: ModelSpec) -> Model:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    # .item() gives a symbol in place of raising
    env = ShapeEnv(allow_scalar_outputs=True)
    return build_custom(spec, fake=FakeTensorMode(allow_non_fake_inputs=True, shape_env=env))


def _build_meta(spec: ModelSpec) -> Model:
    with torch.device("meta"):
        return build_custom(spec)
