"""A factory is the user's own code: a function defined in a file the user provides (in
the working directory, or in the directory the config's `path` names), never a file
inside a Python installation or environment (the standard library, installed packages,
a virtual environment: any Python's on the host, not only the running one's). Anything
else is refused when the workflow plans, naming models.<name>.factory (or .path),
before any of its code runs (not called, not imported). The user's file is loaded by
its path under a name of its own, so no file of the working directory shadows a module,
and the file may be named like one (test.py, types.py); its own directory comes last on
sys.path while it loads and runs, so it imports the files beside it and they shadow
nothing either."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from conftest import REPO, planned_outputs, snakemake
from parabench.config import problems
from parabench.models import build
from parabench.spec import ModelSpec


def config(factory: str, args: dict | None = None, **entry) -> dict:
    model = {"arch": "custom", "factory": factory, "args": args or {}, "batch_size": 8, **entry}
    return {"models": {"mine": model}, "strategies": ["single"], "devices": [1], "repeats": 1}


def refused(cfg: dict, key: str = "factory") -> str:
    found = problems(cfg)
    assert len(found) == 1 and found[0].startswith(f"models.mine.{key}: "), found
    return found[0]


@pytest.mark.parametrize(
    "factory, args",
    [
        ("os:system", {"command": "touch {marker}"}),
        ("subprocess:getoutput", {"cmd": "touch {marker}"}),
        ("shutil:rmtree", {"path": "{keep}"}),
    ],
)
def test_a_factory_of_the_standard_library_is_refused_and_never_called(
    tmp_path, monkeypatch, factory, args
):
    monkeypatch.chdir(tmp_path)
    marker, keep = tmp_path / "ran", tmp_path / "keep"
    keep.mkdir()
    args = {k: v.format(marker=marker, keep=keep) for k, v in args.items()}
    found = problems(config(factory, args))
    assert not marker.exists() and keep.is_dir(), f"the factory was called: {found}"
    assert "standard library" in refused(config(factory, args)), found


def test_snakemake_plans_nothing_of_a_config_naming_os_system(tmp_path):
    """`snakemake -n` (and so --lint, --report and every Slurm job's parse of the
    Snakefile) stops at the factory, naming it, and runs nothing."""
    marker = tmp_path / "ran"
    proc = snakemake(tmp_path, "-n", config=config("os:system", {"command": f"touch {marker}"}))
    assert not marker.exists(), "planning ran the factory"
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "models.mine.factory: no file os.py in" in out, out[-3000:]
    assert "'os' is Python's standard library, never a factory" in out
    assert not planned_outputs(proc)


def test_a_file_that_is_not_the_users_is_refused_before_it_is_imported(tmp_path, monkeypatch):
    """A link in the working directory to a module of Python's, and a `path` naming the
    installed packages: where the file really is decides, and its code never runs."""
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "ran"
    stdlib = Path(sysconfig.get_paths()["stdlib"], "subprocess.py")
    (tmp_path / "mine.py").symlink_to(stdlib)
    found = problems(config("mine:getoutput", {"cmd": f"touch {marker}"}))
    assert not marker.exists(), f"the factory was called: {found}"
    message = refused(config("mine:getoutput", {"cmd": f"touch {marker}"}))
    assert f"is {stdlib.resolve()}, a file of Python's or an installed package's" in message
    site = Path(sysconfig.get_paths()["purelib"])
    (site_pkg,) = [p for p in ("yaml", "jinja2") if (site / p / "__init__.py").is_file()][:1]
    message = refused(config(f"{site_pkg}:load", path=str(site)), key="path")
    assert "inside a Python installation or environment" in message, message
    assert not marker.exists()


# Another Python on the host than the one running, made in the test's directory: each
# tree is recognised by what makes a directory some Python's, not by where it is.
OTHER_PYTHONS = {
    # a standard library's root: os.py and site.py side by side (/usr/lib/python3.12)
    "stdlib": ({"os.py": "", "site.py": ""}, "multiprocessing"),
    # a virtual environment's root
    "venv": ({"pyvenv.cfg": "home = /usr/bin\n"}, "lib/tools"),
    # lib/python3.x without the standard library's own files (a split layout)
    "lib": ({}, "lib/python3.9/multiprocessing"),
    "dist-packages": ({}, "dist-packages/tool"),
}
# What multiprocessing.util would do: write the marker when imported, or when called.
UTIL = """
open({marker!r}, "w").close()


def spawnv_passfds(path, args, passfds):
    open({marker!r}, "w").close()
"""


def other_python(root: Path, kind: str, marker: Path) -> Path:
    """A Python's tree at `root`; the directory holding its util.py."""
    files, sub = OTHER_PYTHONS[kind]
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    where = root / sub
    where.mkdir(parents=True)
    (where / "util.py").write_text(UTIL.format(marker=str(marker)))
    return where


@pytest.mark.parametrize("kind", sorted(OTHER_PYTHONS))
def test_a_file_of_any_python_on_the_host_is_refused_however_it_is_named(
    tmp_path, monkeypatch, kind
):
    """Not only the running Python's: a `path` naming another Python's directory (by
    its absolute path or through `..`), a dotted module reaching into one, or a link to
    one of its files is refused before the file is imported."""
    work, marker = tmp_path / "work", tmp_path / "ran"
    work.mkdir()
    monkeypatch.chdir(work)
    where = other_python(tmp_path / "python", kind, marker)
    args = {"path": "/bin/sh", "args": ["sh", "-c", f"touch {marker}"], "passfds": []}
    factory = "util:spawnv_passfds"
    for path in (str(where), os.path.relpath(where, work)):
        message = refused(config(factory, args, path=path), key="path")
        assert "inside a Python installation or environment" in message, message
    folders = where.relative_to(tmp_path).parts
    if all(f.isidentifier() for f in folders):  # (python3.9, dist-packages: no module's)
        message = refused(config(".".join(folders) + ".util:spawnv_passfds", args, path=".."))
        assert "a file of Python's or an installed package's" in message, message
    (work / "util.py").symlink_to(where / "util.py")
    message = refused(config(factory, args))
    assert f"is {where / 'util.py'}, a file of Python's or an installed package's" in message
    assert not marker.exists(), "a file of another Python was imported"


def host_pythons() -> list[Path]:
    """multiprocessing of the running Python and of every Python installed on this host
    in the usual places."""
    found = {Path(sysconfig.get_paths()["stdlib"], "multiprocessing")}
    for root in ("/usr/lib", "/usr/local/lib", "/usr/lib64"):
        found |= set(Path(root).glob("python3*/multiprocessing"))
    return sorted(p for p in found if (p / "util.py").is_file())


@pytest.mark.parametrize("where", host_pythons(), ids=str)
def test_the_multiprocessing_util_escape_is_refused_for_every_python_here(
    tmp_path, monkeypatch, where
):
    """The reviewer's command: multiprocessing.util.spawnv_passfds, which runs a
    program, from a `path` naming a standard library."""
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "ran"
    args = {"path": "/bin/sh", "args": ["sh", "-c", f"touch {marker}"], "passfds": []}
    refused(config("util:spawnv_passfds", args, path=str(where)), key="path")
    refused(config("util:spawnv_passfds", args, path=f"../{'../' * 20}{where}"), key="path")
    assert not marker.exists()


def test_snakemake_plans_nothing_of_a_config_reaching_another_python(tmp_path):
    marker = tmp_path / "ran"
    where = other_python(tmp_path / "python", "stdlib", marker)
    work = tmp_path / "work"
    work.mkdir()
    args = {"path": "/bin/sh", "args": ["sh", "-c", f"touch {marker}"], "passfds": []}
    cfg = config("util:spawnv_passfds", args, path=os.path.relpath(where, work))
    proc = snakemake(work, "-n", config=cfg)
    assert not marker.exists(), "planning ran another Python's code"
    assert proc.returncode != 0
    assert "models.mine.path: " in proc.stdout + proc.stderr
    assert not planned_outputs(proc)


@pytest.mark.parametrize("name", ["test", "profile", "trace", "code", "types"])
def test_a_users_file_may_be_named_like_a_module_of_the_standard_library(
    tmp_path, monkeypatch, name
):
    """It is loaded by its path under a name of its own, so the name clashes with
    nothing: the file's place decides, not its name."""
    monkeypatch.chdir(tmp_path)
    shutil.copy(REPO / "examples" / "my_model.py", tmp_path / f"{name}.py")
    assert problems(config(f"{name}:build")) == []
    model = build(ModelSpec.of("custom", factory=f"{name}:build"), 0)
    assert len(model.block_names) == 6
    assert not sys.modules.get(name) or not sys.modules[name].__file__.startswith(str(tmp_path))


def test_a_function_imported_into_the_users_file_is_no_factory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "ran"
    (tmp_path / "mine.py").write_text("from subprocess import getoutput\n")
    found = problems(config("mine:getoutput", {"cmd": f"touch {marker}"}))
    assert not marker.exists(), f"the factory was called: {found}"
    message = refused(config("mine:getoutput", {"cmd": f"touch {marker}"}))
    assert "'getoutput' is not defined in" in message and "'subprocess'" in message, message


def test_the_users_file_is_found_in_the_working_directory_or_on_the_path_the_config_names(
    tmp_path, monkeypatch
):
    """The working directory (snakemake's --directory, or where it was started: not
    necessarily where the config file is), or `path`, relative to it; nowhere else: not
    PYTHONPATH, not sys.path."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    shutil.copy(REPO / "examples" / "my_model.py", tmp_path / "models" / "my_model.py")
    message = refused(config("my_model:build"))
    assert f"no file my_model.py in {tmp_path}" in message, message
    monkeypatch.syspath_prepend(str(REPO / "examples"))  # importable, and still not found
    assert refused(config("my_model:build")) == message
    assert problems(config("my_model:build", path="models")) == []
    model = build(ModelSpec.of("custom", factory="my_model:build", path="models"), 0)
    assert len(model.block_names) == 6
    # dots are folders
    assert problems(config("models.my_model:build")) == []


SHADOW = """
import json, sys
before = list(sys.path)
from parabench.config import problems
cfg = {"models": {"mine": {"arch": "custom", "factory": "my_model:build", "batch_size": 8}},
       "strategies": ["single"], "devices": [1], "repeats": 1}
assert problems(cfg) == [], problems(cfg)
import colorsys  # the standard library's, though the working directory has one
print(json.dumps({
    "sys_path_kept": sys.path == before,
    "colorsys": colorsys.__file__,
    "as_my_model": "my_model" in sys.modules,
}))
"""


def test_loading_a_factory_leaves_sys_path_alone_and_shadows_nothing(tmp_path):
    """A file of the working directory named like a module imported later (colorsys,
    which sympy's mpmath imports when torch's fake tensors are first used; a numpy or
    a yaml elsewhere) stays a file: the factory's module is loaded by its path, under a
    name of its own."""
    shutil.copy(REPO / "examples" / "my_model.py", tmp_path / "my_model.py")
    marker = tmp_path / "shadowed"
    (tmp_path / "colorsys.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    env = {**os.environ, "PYTHONPATH": str(REPO / "workflow")}
    proc = subprocess.run(  # -P: Python itself puts no working directory on sys.path
        [sys.executable, "-P", "-c", textwrap.dedent(SHADOW)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = __import__("json").loads(proc.stdout.strip().splitlines()[-1])
    assert not marker.exists(), got
    assert got == {
        "sys_path_kept": True,
        "colorsys": got["colorsys"],
        "as_my_model": False,
    } and not got["colorsys"].startswith(str(tmp_path)), got


SIBLINGS = """
import json, sys
before = list(sys.path)
from parabench.config import problems
from parabench.models import build
from parabench.spec import ModelSpec
entry = {"arch": "custom", "factory": "mine:build", "path": "models", "batch_size": 8}
cfg = {"models": {"mine": entry}, "strategies": ["single"], "devices": [1], "repeats": 1}
assert problems(cfg) == [], problems(cfg)
model = build(ModelSpec.of("custom", factory="mine:build", path="models"), 0)
import colorsys  # the standard library's, though the factory's directory has one
print(json.dumps({
    "blocks": len(model.module),
    "sys_path_kept": sys.path == before,
    "colorsys": colorsys.__file__,
}))
"""


def test_a_factory_imports_the_files_beside_it_and_they_shadow_nothing(tmp_path):
    """`from helpers import WIDTHS` in the factory's file (at its top), and a lazy
    `from layers import block` in the factory: each a file beside it, as a script
    imports its neighbours. A file there named like a module of Python's (colorsys,
    which torch's fake tensors import while planning calls the factory) stays a file,
    and sys.path is as it was once planning and the build are done."""
    models = tmp_path / "models"
    models.mkdir()
    (models / "helpers.py").write_text("WIDTHS = [4, 3, 2]\n")
    (models / "layers.py").write_text(
        "from torch import nn\n\ndef block(a, b):\n    return nn.Sequential(nn.Linear(a, b))\n"
    )
    (models / "mine.py").write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn
            from helpers import WIDTHS

            def build():
                from layers import block

                def batch(n, g):
                    return torch.randn(n, WIDTHS[0], generator=g), torch.randn(n, 2, generator=g)

                blocks = [block(a, b) for a, b in zip(WIDTHS, WIDTHS[1:])]
                return dict(blocks=nn.Sequential(*blocks), loss=nn.MSELoss(), batch=batch)
            """
        )
    )
    marker = tmp_path / "shadowed"
    (models / "colorsys.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    env = {**os.environ, "PYTHONPATH": str(REPO / "workflow")}
    proc = subprocess.run(  # -P: Python itself puts no working directory on sys.path
        [sys.executable, "-P", "-c", textwrap.dedent(SIBLINGS)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = __import__("json").loads(proc.stdout.strip().splitlines()[-1])
    assert not marker.exists(), got
    assert got["blocks"] == 2 and got["sys_path_kept"], got
    assert not got["colorsys"].startswith(str(tmp_path)), got


def test_a_factory_that_hands_back_planning_s_fake_model_is_stopped_naming_why(
    tmp_path, monkeypatch
):
    """Planning calls the factory on fake tensors; one that caches what it built would
    give the cell that fake model to train."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cached.py").write_text(
        textwrap.dedent(
            """
            import functools, torch
            from torch import nn

            @functools.lru_cache
            def build():
                def batch(n, g):
                    return torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g)
                return dict(blocks=nn.Sequential(nn.Linear(4, 2)), loss=nn.MSELoss(), batch=batch)
            """
        )
    )
    assert problems(config("cached:build")) == []
    with pytest.raises(ValueError, match="must build a new model on every call"):
        build(ModelSpec.of("custom", factory="cached:build"), 0)
