"""Every file the package writes is written whole or not at all (records.atomic_write_bytes:
a temporary name, then a rename), so a killed run never leaves half a table that reads as
a shorter one. Read from the source: a new writer that opens its output for writing, or
hands pandas, json or matplotlib a path, fails here until it goes through records or is
listed below with its reason."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "workflow" / "parabench"

# (module, function): why its write is not a results file written in place
ALLOWED = {
    ("records.py", "atomic_write_files"): "the one writer: temporary files, then os.replace",
    ("sweep.py", "_logged"): "a job's log, streamed while it runs",
    ("profiling.py", "save"): "the trace: gzip into a temporary file, then a rename",
    ("lock.py", "_write_whole"): "the lock's holder, into a file no reader names yet: a "
    "temporary one then link(2), or O_EXCL where link(2) is refused, removed if half-written",
}
# Calls that write to the path or file they are given.
WRITERS = {"to_csv", "to_json", "to_parquet", "write_text", "write_bytes", "savefig", "dump"}


def _writes(call: ast.Call) -> bool:
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    if name in ("open", "fdopen"):  # open(path, "w"), gzip.open(path, "wt"), os.fdopen(fd, "wb")
        modes = [a for a in call.args[1:2] if isinstance(a, ast.Constant)]
        modes += [k.value for k in call.keywords if k.arg == "mode"]
        return any(isinstance(m, ast.Constant) and set(str(m.value)) & set("wax") for m in modes)
    if name == "savefig":  # into a buffer is fine: the buffer then goes to records
        return not (call.args and isinstance(call.args[0], ast.Name) and call.args[0].id == "buf")
    if name in ("to_csv", "to_json"):  # without a path they return the text
        return bool(call.args) or any(k.arg == "path_or_buf" for k in call.keywords)
    return name in WRITERS


def _writers() -> list[tuple[str, str, int]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and _writes(node):
                    found.append((str(path.relative_to(PACKAGE)), fn.name, node.lineno))
    return found


def test_every_file_the_package_writes_goes_through_the_atomic_writer():
    direct = [(m, f, line) for m, f, line in _writers() if (m, f) not in ALLOWED]
    assert not direct, f"written in place (use records.atomic_write_bytes): {direct}"


@pytest.mark.parametrize("where", sorted(ALLOWED))
def test_each_allowed_writer_still_exists(where):
    """A stale exemption would let a new writer of that name through unseen."""
    assert where in {(m, f) for m, f, _ in _writers()}, where
