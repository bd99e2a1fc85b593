"""The nccl-tests parser: the real output reads as before, and reading is linear in the
file's size whatever a line holds (one 200,000-character word once took minutes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from parabench.hardware import fabric

NCCL_TESTS = Path(__file__).parent / "data" / "nccl-tests-all_reduce_perf-8xh100.txt"
WORD = "x" * 200_000


def by_hand(path: Path) -> fabric.BusbwTable:
    """The out-of-place busbw of every result row with a positive one, read plainly."""
    rows = [line.split() for line in path.read_text().splitlines()]
    rows = [r for r in rows if r and not r[0].startswith("#") and float(r[7]) > 0]
    return fabric.BusbwTable(
        tuple(int(r[0]) for r in rows), tuple(float(r[7]) * 1e9 for r in rows), 0.0
    )


def test_the_real_output_reads_as_it_did():
    f = fabric.parse_nccl_tests(NCCL_TESTS)
    assert f.source == (
        "nccl-tests-all_reduce_perf-8xh100.txt: all_reduce_perf at 8 ranks, busbw 0.0 to 454.7 GB/s"
    )
    assert f.tables == {"any": by_hand(NCCL_TESTS)}
    assert len(f.tables["any"].sizes) == 28


def parse_in_child(path: Path, timeout: float = 20) -> str:
    """Parse in a child process, so a regression fails at `timeout` rather than after
    minutes; a bound 100 times what linear reading takes (a few ms), so no busy
    machine trips it."""
    code = (
        "import sys; from parabench.hardware import fabric; "
        "print(fabric.parse_nccl_tests(sys.argv[1]))"
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, str(path)],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"parsing {path.name} ran past {timeout:g} s: not linear in its size")
    return proc.stdout + proc.stderr


@pytest.mark.parametrize("where", [0, 13, -1], ids=["first", "among-header", "last"])
def test_a_200k_character_word_in_a_comment_reads_at_once_and_changes_nothing(tmp_path, where):
    lines = NCCL_TESTS.read_text().splitlines()
    lines.insert(where if where >= 0 else len(lines), f"# {WORD}")
    path = tmp_path / "long.txt"
    path.write_text("\n".join(lines) + "\n")
    out = parse_in_child(path)
    assert "Fabric(name='nccl-tests'" in out, out[-2000:]
    f = fabric.parse_nccl_tests(path)
    assert f.tables == fabric.parse_nccl_tests(NCCL_TESTS).tables
    assert "all_reduce_perf at 8 ranks" in f.source


def test_a_200k_character_row_is_refused_at_once_naming_its_line(tmp_path):
    lines = NCCL_TESTS.read_text().splitlines()
    lines.insert(20, f"  1024  256  {WORD}")
    path = tmp_path / "long.txt"
    path.write_text("\n".join(lines))
    out = parse_in_child(path)
    assert f"{path}:21: not an nccl-tests result row" in out, out[-2000:]
    assert len(out) < 2000, "the message quotes the line's start, not all of it"


def test_a_mesh_dimension_is_priced_on_the_links_its_group_spans():
    """tp innermost: at 64 GPUs with tp 8, a dp_shard group of 8 spans eight nodes and
    crosses the network; alone, a group of 8 is one node's NVLink."""
    from parabench.predict.scaling import layout_comm, spans

    h100 = fabric.PROFILES["h100-nvlink-ndr400"]
    assert spans({"pp": 1, "dp_replicate": 1, "dp_shard": 8, "tp": 8}) == {
        "pp": 64,
        "dp_replicate": 64,
        "dp_shard": 64,
        "tp": 8,
    }
    gather = {"dp_shard": {"all_gather": {"count": 1, "bytes": 1e9}}}
    across = layout_comm(
        [gather], h100.time, {"pp": 1, "dp_replicate": 1, "dp_shard": 8, "tp": 8}, 1
    )
    within = layout_comm(
        [gather], h100.time, {"pp": 1, "dp_replicate": 1, "dp_shard": 8, "tp": 1}, 1
    )
    assert across == pytest.approx(h100.time("all_gather", 8, 1e9, span=64))
    assert within == pytest.approx(h100.time("all_gather", 8, 1e9))
    assert across > within
    # one rank per node: that rank's NIC alone, an eighth of a whole node's (8 per node)
    whole_nodes = h100.time("all_gather", 64, 1e9, span=64)
    inter = h100.tables["inter"]
    assert whole_nodes == pytest.approx(fabric.nccl_time("all_gather", 64, 8, 1e9, inter))
    one_nic = fabric.BusbwTable(inter.sizes, tuple(b / 8 for b in inter.busbw), 0.0)
    assert across == pytest.approx(fabric.nccl_time("all_gather", 8, 8, 1e9, one_nic))
    assert across == pytest.approx(1e9 * (7 / 8) / (inter.busbw[0] / 8), rel=0.01)


def test_a_profiles_latency_grows_with_the_group_as_nccls_own_model_prices_it():
    """NCCL's tuning model (tuning.cc): an 8-byte all-reduce within a node is a ring of
    LL steps, 6.6 + 14 x 0.6 = 15 us; across 128 nodes a ring would take 2,046 steps, and
    NCCL's tree (6.8 + 2 x (7 x 0.6 + 7 x 5) = 85.2 us) is what it runs; a ring
    all-gather, the only algorithm it has, grows with the ranks."""
    h100 = fabric.PROFILES["h100-nvlink-ndr400"]
    assert h100.time("all_reduce", 8, 8) == pytest.approx(15.0e-6, rel=1e-3)
    wide = h100.time("all_reduce", 1024, 8, span=1024)
    assert wide == pytest.approx(
        fabric.nccl_latency_s("all_reduce", 1024, 128, "tree", "LL"), rel=0.01
    )
    assert wide < fabric.nccl_latency_s("all_reduce", 1024, 128, "ring", "LL") / 10
    small = [h100.time("all_gather", n, 8, span=n) for n in (8, 64, 1024)]
    assert small[0] < small[1] < small[2] and small[2] > 1e-3  # a thousand steps
    # bandwidth still rules large messages: within 2% of bytes over busbw
    assert h100.time("all_reduce", 8, 1e9) == pytest.approx(1e9 * 2 * 7 / 8 / 460e9, rel=0.02)


def test_a_collective_is_timed_as_the_median_of_its_loops(monkeypatch):
    """collectives.time_op reports the median of its timed loops' mean calls, not their
    mean: one loop slowed by a descheduled thread (here 100 ms a call against 5 and 10)
    moves nothing. A world of one rank on gloo; the op a sleep of each loop's length."""
    import time

    import torch
    import torch.distributed as dist

    from parabench.run import collectives

    # the warm-up call and the call timed to size the loops, then 3 loops of 3 calls
    lengths = iter([0.01, 0.01] + [0.005] * 3 + [0.1] * 3 + [0.01] * 3)
    monkeypatch.setattr(collectives, "_call", lambda *a: lambda: time.sleep(next(lengths)))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        took, iters = collectives.time_op(
            "all_reduce", 1024, torch.device("cpu"), min_time_s=1e-3, trials=3
        )
    finally:
        dist.destroy_process_group()
    assert iters == 3
    assert 0.009 < took < 0.025, took  # the mean of the loops would be 38 ms


@pytest.mark.parametrize(
    "degrees",
    [
        {"dp_shard": 2, "tp": 2},
        {"dp_replicate": 2, "dp_shard": 2},
        {"pp": 2, "dp_replicate": 2},
        {"pp": 2, "dp_shard": 2, "tp": 2},
        {"dp_replicate": 2, "dp_shard": 4},
    ],
    ids=lambda d: "x".join(f"{k}{v}" for k, v in d.items()),
)
def test_the_benchmark_times_each_group_as_a_layouts_mesh_places_it(degrees):
    """Each mesh dimension's groups, as torch's DeviceMesh lays its ranks out (row-major
    over layout.MESH_DIMS, tp innermost), are one of the benchmark's placements: g ranks
    span / g apart (scaling.spans), which is how fabric.time reads them."""
    import math

    import torch

    from parabench.layout import MESH_DIMS
    from parabench.predict.scaling import spans
    from parabench.run import collectives

    dims = [d for d in MESH_DIMS if degrees.get(d, 1) > 1]
    world = math.prod(degrees.values())
    mesh = torch.arange(world).reshape([degrees[d] for d in dims])
    span = spans(degrees)
    for i, d in enumerate(dims):
        along = mesh.movedim(i, -1).reshape(-1, degrees[d]).tolist()
        placed = (degrees[d], span[d] // degrees[d])
        assert placed in collectives.placements(world)
        assert sorted(collectives.groups_of(world, *placed)) == sorted(along), d


def curve_rows(seconds: float, devices: int, world: int, stride: int) -> list[dict]:
    """collectives.csv's rows of an all-reduce taking `seconds` a call at 4 and 64 KiB,
    among `devices` ranks placed `stride` apart in a benchmark of `world` ranks."""
    return [
        {
            "op": "all_reduce",
            "devices": devices,
            "bytes": b,
            "time_s": seconds,
            "busbw_GBps": b / seconds / 1e9,  # a bus factor of 1 is enough here
            "backend": "gloo",
            "world": world,
            "stride": stride,
        }
        for b in (4096, 65536)
    ]


def test_a_layouts_group_is_priced_on_the_curve_measured_where_its_ranks_sit():
    """fabric.time reads a group of n ranks within a layout of `world` on the curve the
    benchmark measured for that placement (world, span / n apart); a whole world of n,
    a placement never measured, or a table written before groups were (no `world`
    column), on the whole world's curve at n."""
    import pandas as pd

    rows = curve_rows
    curves = pd.DataFrame(rows(1e-3, 2, 2, 1) + rows(4e-3, 2, 4, 1) + rows(2e-3, 2, 4, 2))
    f = fabric.from_curves(curves)
    at = 65536 * 1  # the bus factor's bytes: all_reduce at 2 ranks moves 1x

    def t(**kw) -> float:
        return f.time("all_reduce", 2, at, **kw) * 1e3

    assert t() == pytest.approx(1.0)  # the world of 2
    assert t(span=2, world=2) == pytest.approx(1.0)
    assert t(span=2, world=4) == pytest.approx(4.0)  # consecutive: a tp pair
    assert t(span=4, world=4) == pytest.approx(2.0)  # 2 apart: dp_shard outside tp 2
    assert t(span=2, world=8) == pytest.approx(1.0)  # never measured: the world's curve
    older = fabric.from_curves(curves.drop(columns=["world", "stride"]).head(2))
    assert older.time("all_reduce", 2, at, span=2, world=4) * 1e3 == pytest.approx(1.0)


def test_a_four_rank_benchmark_also_times_its_pairs_where_a_layout_puts_them(tmp_path):
    """A real 4-rank gloo benchmark writes the world's curves and, for each op, its
    pairs consecutive and 2 apart, all pairs calling at once; the report's curves and
    the cells' model read the world's only (collectives.whole)."""
    import pandas as pd

    from parabench.jobs.launch import collectives_argv
    from parabench.run import collectives

    argv = collectives_argv(4, [4096], "cpu", 60, tmp_path, python=sys.executable)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = pd.read_csv(tmp_path / "collectives.csv")
    placed = set(rows[["devices", "world", "stride"]].itertuples(index=False, name=None))
    assert placed == {(4, 4, 1), (2, 4, 1), (2, 4, 2)}
    for _, at in rows.groupby(["devices", "stride"]):
        assert set(at["op"]) == set(collectives.CURVES) and (at["time_s"] > 0).all()
    assert set(collectives.whole(rows)["devices"]) == {4}
    f = fabric.from_curves(rows)
    assert {k for k in f.tables if len(k) == 4} == {
        (op, 2, 4, s) for op in collectives.CURVES for s in (1, 2)
    }


def test_a_profile_of_other_nodes_keeps_its_links_and_a_nic_a_gpu():
    """advise.gpus_per_node 4 on an 8-GPU profile: a group of 8 crosses two nodes (on
    their 4 NICs each), a group of 4 stays on NVLink as before."""
    h100 = fabric.PROFILES["h100-nvlink-ndr400"]
    four = h100.of_nodes(4)
    assert four.gpus_per_node == 4 and h100.of_nodes(8) is h100
    assert four.time("all_gather", 4, 1e9) == h100.time("all_gather", 4, 1e9)
    assert four.time("all_gather", 8, 1e9) > 2 * h100.time("all_gather", 8, 1e9)
    # a node's network is its GPUs' NICs: a group across 4-GPU nodes, half an 8's
    assert four.time("all_gather", 16, 1e9) > h100.time("all_gather", 16, 1e9)
