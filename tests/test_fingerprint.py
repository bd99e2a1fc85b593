"""What a cell keeps of its parameters (parabench/fingerprint.py): a small model's whole,
compared exactly as before; a large model's count sketch and sample, a few MiB whatever
its size, whose distance is within the stated error of the exact one and whose verdict
is the exact one's wherever the exact distance is not within that error of the
tolerance. A broken hash (every element in one bucket, signs that are not random)
fails here."""

import io
import json
import math

import pandas as pd
import pytest
import torch

from conftest import run_cell, tiny_spec
from parabench import records
from parabench.analyze import equivalence, fingerprint
from parabench.report.aggregate import aggregate
from parabench.spec import ModelSpec
from report_fixture import make_results

# Just above the sample: every sketch below hashes about a million elements.
SHAPES = {"layer.weight": (1024, 1024), "layer.bias": (1024,), "head.weight": (24, 1024)}


def weights(seed: int, scale: float = 0.02) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: scale * torch.randn(s, generator=g) for k, s in SHAPES.items()}


def unit(seed: int) -> dict[str, torch.Tensor]:
    """A random direction over every element, of norm 1."""
    d = weights(seed, 1.0)
    norm = math.sqrt(sum((t.double() ** 2).sum().item() for t in d.values()))
    return {k: t / norm for k, t in d.items()}


def plus(a: dict, d: dict, c: float = 1.0) -> dict:
    return {k: a[k] + c * d[k] for k in a}


def test_a_small_model_is_kept_whole_and_compared_exactly(tmp_path):
    state = {"w": torch.randn(64, 32), "b": torch.randn(32)}
    other = plus(state, {"w": torch.randn(64, 32), "b": torch.zeros(32)}, 1e-3)
    assert fingerprint.of(state).keys() == state.keys()  # a state dict, as before
    (tmp_path / "a.pt").write_bytes(fingerprint.encode(state))
    (tmp_path / "b.pt").write_bytes(fingerprint.encode(other))
    a, b = fingerprint.load(tmp_path / "a.pt"), fingerprint.load(tmp_path / "b.pt")
    assert all(torch.equal(a[k], state[k]) for k in state)
    assert fingerprint.difference(b, a) == (
        equivalence.max_abs_diff(other, state),
        equivalence.l2_diff(other, state),
    )


def test_a_sketch_is_a_few_mib_whatever_the_model():
    """Its size depends on the buckets and the sample, not on the parameters: a model
    twice as large keeps as much (the names aside). config/gpu.yaml's 541M-parameter
    resmlp kept 2.2 GB a cell whole."""
    sizes = []
    for rows in (4100, 8200):  # 4.2M and 8.4M parameters: above EXACT_MAX
        state = {"w": torch.zeros(rows, 1024), "b": torch.zeros(rows)}
        sizes.append(len(fingerprint.encode(state)))
    assert sizes[0] == sizes[1]
    assert fingerprint.stored_bytes(2**20) <= sizes[0] < fingerprint.stored_bytes(2**30) + 2**14


def test_a_sketch_is_linear_and_the_same_on_every_cell():
    a, b = weights(0), weights(1)
    sa, sb = fingerprint.sketch(a), fingerprint.sketch(b)
    assert torch.equal(fingerprint.sketch(dict(reversed(a.items())))["sketch"], sa["sketch"])
    assert torch.equal(fingerprint.sketch(a, torch.device("cpu"))["sketch"], sa["sketch"])
    diff = fingerprint.sketch({k: a[k].double() - b[k].double() for k in a})["sketch"]
    assert torch.allclose(sa["sketch"] - sb["sketch"], diff, rtol=0, atol=1e-12)
    # the sample: the same places in every cell, each tensor in proportion to its size
    assert fingerprint.difference(sa, sa) == (0.0, 0.0)
    assert sa["sample"].numel() == fingerprint.SAMPLE
    assert (sa["sample"] != 0).all() and sa["sample"].std() == pytest.approx(0.02, rel=0.01)


DIFFERENCES = {
    # what training and rounding leave: every element off a little
    "dense": lambda: unit(7),
    # a shift of every element by the same amount: all-positive signs would add them up
    "constant": lambda: {k: torch.ones(s) for k, s in SHAPES.items()},
    # alternating along each row: signs that follow an index's parity would add them up
    "alternating": lambda: {
        k: torch.tensor([1.0, -1.0]).repeat((math.prod(s) + 1) // 2)[: math.prod(s)].reshape(s)
        for k, s in SHAPES.items()
    },
    # one tensor alone (a bias a strategy forgot to average)
    "one tensor": lambda: {
        k: torch.randn(s) if k == "layer.bias" else torch.zeros(s) for k, s in SHAPES.items()
    },
    # a few elements
    "three elements": lambda: {
        k: torch.zeros(s).index_put_((torch.tensor([0]),) * len(s), torch.tensor(1.0))
        for k, s in SHAPES.items()
    },
}


@pytest.mark.parametrize("kind", list(DIFFERENCES))
def test_the_sketch_estimates_the_distance_within_its_stated_error(kind):
    """‖S(a) − S(b)‖ against the exact ‖a − b‖: within SKETCH_ERROR (1.4%, 5 standard
    deviations at 2^16 buckets) for differences of every shape. Every element in one
    bucket misses the dense one by ~100%, all-positive signs the constant one by a
    factor ~4, signs by parity the alternating one by as much."""
    a = weights(0)
    b = plus(a, DIFFERENCES[kind](), 1e-3)
    exact = equivalence.l2_diff(a, b)
    _, sketched = fingerprint.difference(fingerprint.sketch(a), fingerprint.sketch(b))
    assert sketched / exact - 1 == pytest.approx(0, abs=fingerprint.SKETCH_ERROR), kind


def test_the_squared_norm_is_unbiased_with_the_stated_spread_over_hashes(monkeypatch):
    """Over 200 hashes (seeds), with 2^8 buckets for a spread that a few hundred draws
    measure: ‖S(d)‖² / ‖d‖² averages 1, and its standard deviation is at most √(2/k)
    (the module's bound) and no less than 0.8 of it (d spread over many elements, where
    the bound is tight: a hash that placed elements in a pattern would show less or
    more)."""
    monkeypatch.setattr(fingerprint, "BUCKETS", 2**8)
    monkeypatch.setattr(fingerprint, "SAMPLE", 2**10)
    d = {"w": torch.randn(2**14, generator=torch.Generator().manual_seed(3))}
    exact = (d["w"].double() ** 2).sum().item()
    ratios = []
    for seed in range(200):
        monkeypatch.setattr(fingerprint, "SEED", seed)
        ratios.append((fingerprint.sketch(d)["sketch"] ** 2).sum().item() / exact)
    ratios = torch.tensor(ratios, dtype=torch.float64)
    bound = math.sqrt(2 / 2**8)
    assert abs(ratios.mean().item() - 1) < 4 * bound / math.sqrt(len(ratios))
    assert 0.8 * bound < ratios.std().item() < 1.15 * bound


@pytest.mark.parametrize("times", [1.2, 4.8, 9.2, 24, 26, 148])
def test_the_verdict_on_a_sketch_is_the_exact_one(times):
    """single moved by `travel`; its reordered run landed REORDER of that away; a cell
    `times` that distance away. Strategies that do the same maths land at 1.2-9.2x, half
    the learning rate at 148x or more (analyze/equivalence.py): the sketch's verdict is the exact
    one at each, and at 24x and 26x, 4% either side of the tolerance."""
    initial, reference = weights(0), weights(1)
    travel = equivalence.l2_diff(reference, initial)
    reorder = 1e-4
    cell = plus(reference, unit(2), times * reorder * travel)
    tol = equivalence.tolerance(reorder, "ddp", 2)
    exact = equivalence.l2_diff(cell, reference) / travel
    _, sketched = fingerprint.difference(fingerprint.sketch(cell), fingerprint.sketch(reference))
    assert sketched / travel == pytest.approx(exact, rel=fingerprint.SKETCH_ERROR)
    assert (sketched / travel <= tol) == (exact <= tol) == (times < 25)


def test_the_tolerance_is_the_reordered_runs_distance_widened_floored_and_rounded():
    """equivalence.tolerance as its module states it, on figures by hand: 25x the
    reordered run's distance, never under 1e-6; a strategy that rounds its gradients to
    bf16's 8 significant bits (ddp_compress) at least 2 x (n + 1) x 2^-8."""
    assert equivalence.tolerance(1e-4, "ddp", 2) == pytest.approx(25e-4)
    assert equivalence.tolerance(1e-9, "ddp", 2) == 1e-6
    assert equivalence.tolerance(1e-4, "ddp_compress", 2) == pytest.approx(2 * 3 / 256)
    assert equivalence.tolerance(1e-4, "ddp_compress", 4) == pytest.approx(2 * 5 / 256)
    assert equivalence.tolerance(1e-2, "ddp_compress", 4) == pytest.approx(0.25)
    assert equivalence.rounding_bound(8, 2) == pytest.approx(3 / 256)


def test_the_distances_are_over_every_parameter():
    a = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0])}
    b = {"w": torch.tensor([1.0, -1.0]), "b": torch.tensor([7.0])}
    assert equivalence.max_abs_diff(a, b) == 4.0
    assert equivalence.l2_diff(a, b) == pytest.approx(5.0)  # sqrt(3^2 + 4^2)


def test_half_the_learning_rate_is_far_outside_the_tolerance_on_a_sketch():
    initial, reference = weights(0), weights(1)
    half = {k: initial[k] + 0.5 * (reference[k] - initial[k]) for k in initial}
    travel = equivalence.l2_diff(reference, initial)
    _, sketched = fingerprint.difference(fingerprint.sketch(half), fingerprint.sketch(reference))
    assert sketched / travel == pytest.approx(0.5, rel=fingerprint.SKETCH_ERROR)


def test_fingerprints_of_other_parameters_are_not_compared():
    a = fingerprint.sketch(weights(0))
    renamed = fingerprint.sketch({k.replace("head", "out"): t for k, t in weights(0).items()})
    with pytest.raises(ValueError, match="parameter names differ"):
        fingerprint.difference(renamed, a)
    reshaped = {**weights(0), "head.weight": torch.zeros(1024, 24)}
    with pytest.raises(ValueError, match="parameter shapes differ"):
        fingerprint.difference(fingerprint.sketch(reshaped), a)


def _as_version_4(metas: list) -> None:
    for meta in metas:
        meta.write_text(
            meta.read_text().replace(
                f'"schema_version": {records.SCHEMA_VERSION}', '"schema_version": 4'
            )
        )


def test_a_version_4_result_is_merged_where_its_parameters_are_what_version_5_keeps(tmp_path):
    """Version 4 kept every model's parameters whole. A small model's are what version
    5 keeps: merged as they are. A large model's would be read whole (GB a cell): refused,
    naming the file, without reading them."""
    metas = make_results(tmp_path / "small", 1)
    _as_version_4(metas)
    aggregate(metas, *(tmp_path / "small" / f"{t}.csv" for t in ("steps", "summary", "cells")))
    whole = {"w": torch.zeros(fingerprint.EXACT_MAX + 1)}
    data = fingerprint.encode({"w": whole["w"][:-1]})  # at the bound: kept whole
    metas = make_results(tmp_path / "large", 1, params=lambda s: data)
    buf = io.BytesIO()
    torch.save(whole, buf)  # what version 4 wrote for a model one element larger
    (metas[0].parent / "params.pt").write_bytes(buf.getvalue())
    _as_version_4(metas)
    with pytest.raises(records.ResultsError, match="rerun the cell") as err:
        aggregate(metas, *(tmp_path / "large" / f"{t}.csv" for t in ("steps", "summary", "cells")))
    assert str(metas[0].parent / "params.pt") in str(err.value)
    assert json.loads(metas[0].read_text())["schema_version"] == 4


@pytest.mark.slow
def test_a_cell_of_a_large_model_keeps_its_sketch_and_the_verdicts_hold(tmp_path):
    """Real cells of an mlp just above EXACT_MAX (4.2M parameters): single, ddp at 2
    ranks and single at half the learning rate, merged from their sketches: ddp the same
    maths, half the learning rate not."""
    model = ModelSpec.of("mlp", dims=[2048, 2048, 1])
    metas = []
    for name, spec in {
        "single": tiny_spec("single", 1, model=model, lr=0.05),
        "ddp": tiny_spec("ddp", 2, model=model, lr=0.05),
    }.items():
        meta, proc = run_cell(spec, tmp_path / name)
        assert meta["status"] == "ok", f"{meta['reason']}\n{proc.stderr[-2000:]}"
        metas.append(tmp_path / name / "meta.json")
    kept = fingerprint.load(tmp_path / "single" / "params.pt")
    assert fingerprint.is_sketch(kept)
    assert (tmp_path / "single" / "params.pt").stat().st_size < 5 * 2**20
    aggregate(metas, *(tmp_path / f"{t}.csv" for t in ("steps", "summary", "cells")))
    cells = pd.read_csv(tmp_path / "cells.csv").set_index("strategy")
    assert cells.loc["ddp", "equivalent"], cells.loc["ddp"]
    half, proc = run_cell(tiny_spec("single", 1, model=model, lr=0.025), tmp_path / "half")
    assert half["status"] == "ok", proc.stderr[-2000:]
    ref = json.loads(metas[0].read_text())
    _, l2 = fingerprint.difference(fingerprint.load(tmp_path / "half" / "params.pt"), kept)
    tol = equivalence.tolerance(ref["reorder_rel_diff"], "single", 1)
    print(
        f"\nreorder {ref['reorder_rel_diff']:.2e}, tolerance {tol:.2e}; ddp "
        f"{cells.loc['ddp', 'rel_param_diff']:.2e}; half the learning rate "
        f"{l2 / ref['param_travel']:.2e}"
    )
    assert l2 / ref["param_travel"] > 25 * tol
