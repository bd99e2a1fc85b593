"""`parabench compare`: a run against itself is indistinguishable everywhere; a run
where one strategy is 30% slower says slower for exactly those cells; runs on
different hardware are refused unless forced. Real CLI, the report fixture's results."""

import subprocess
import sys

import pandas as pd
import pytest

from parabench.report.aggregate import aggregate
from report_fixture import CELLS, make_results


def results(root, cells=CELLS):
    metas = make_results(root, cells=cells)
    aggregate(metas, root / "steps.csv", root / "summary.csv", root / "cells.csv")
    return root


def run_compare(a, b, out, *extra):
    return subprocess.run(
        [sys.executable, "-m", "parabench", "compare", str(a), str(b), "--out", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return results(tmp_path_factory.mktemp("a"))


def test_a_run_against_itself_is_indistinguishable_everywhere(base, tmp_path):
    proc = run_compare(base, base, tmp_path / "c.html")
    assert proc.returncode == 0, proc.stderr
    table = pd.read_csv(tmp_path / "c.csv")
    assert len(table) == sum(1 for v in CELLS.values() if v[1] == "ok")
    assert (table["verdict"] == "indistinguishable").all()
    html = (tmp_path / "c.html").read_text()
    assert "indistinguishable" in html and "<script" not in html.split("</style>")[1]


def test_thirty_percent_slower_ddp_is_slower_exactly_there(base, tmp_path):
    slow = {
        k: ((v[0] * 1.3 if k[0] == "ddp" and v[0] else v[0]), v[1], v[2]) for k, v in CELLS.items()
    }
    b = results(tmp_path / "b", slow)
    proc = run_compare(base, b, tmp_path / "c.html")
    assert proc.returncode == 0, proc.stderr
    table = pd.read_csv(tmp_path / "c.csv").set_index(["strategy", "devices"])
    slower = set(table.index[table["verdict"] == "slower"])
    assert slower == {("ddp", 2), ("ddp", 4)}
    assert (table.drop(list(slower))["verdict"] == "indistinguishable").all()
    assert table.loc[("ddp", 2), "ratio"] == pytest.approx(1.3)


def test_different_hardware_is_refused_unless_forced(base, tmp_path):
    b = results(tmp_path / "b")
    cells = pd.read_csv(b / "cells.csv")
    cells["cpu_model"] = "Another CPU 9000"
    cells.to_csv(b / "cells.csv", index=False)
    refused = run_compare(base, b, tmp_path / "c.html")
    assert refused.returncode == 2
    assert "cpu_model" in refused.stderr and "Another CPU 9000" in refused.stderr
    assert not (tmp_path / "c.html").exists()
    forced = run_compare(base, b, tmp_path / "c.html", "--force")
    assert forced.returncode == 0, forced.stderr
    assert "differs: hardware: cpu_model" in forced.stdout
    assert "Another CPU 9000" in (tmp_path / "c.html").read_text()


@pytest.mark.parametrize(
    "where, option",
    [
        (lambda a, b, t: ["--out", b / "summary.html"], "--out"),  # its CSV: B's summary.csv
        (lambda a, b, t: ["--out", t / "c.html", "--csv", a / "cells.csv"], "--csv"),
        (lambda a, b, t: ["--out", b / "new" / "c.html"], "--out"),  # a new file, but in B
        (lambda a, b, t: ["--out", t / "c.csv"], "are one file"),  # the CSV is the HTML
    ],
    ids=["beside-B-summary", "A-cells", "new-in-B", "csv-is-out"],
)
def test_an_output_inside_a_run_it_reads_is_refused_and_nothing_is_written(tmp_path, where, option):
    a, b = results(tmp_path / "a"), results(tmp_path / "b")
    before = {p: p.read_bytes() for r in (a, b) for p in r.rglob("*") if p.is_file()}
    argv = [str(x) for x in where(a, b, tmp_path)]
    proc = subprocess.run(
        [sys.executable, "-m", "parabench", "compare", str(a), str(b), *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert option in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    after = {p: p.read_bytes() for r in (a, b) for p in r.rglob("*") if p.is_file()}
    assert after == before, "a run's files were changed"
    assert not list(tmp_path.glob("c.*"))
