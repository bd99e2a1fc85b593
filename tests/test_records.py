import csv
import json
import os

import pytest

from parabench import records


def test_step_columns_are_the_documented_contract():
    assert list(records.STEP_COLUMNS) == [
        "schema_version",
        "model",
        "precision",
        "optimizer",
        "compile",
        "ac",
        "strategy",
        "devices",
        "repeat",
        "step",
        "phase",
        "step_time_s",
        "step_time_min_s",
        "loss",
        "samples",
    ]
    assert all(records.STEP_COLUMNS.values()), "every column is documented"


def test_steps_csv_has_header_version_and_rows(tmp_path):
    row = {
        "model": "m",
        "precision": "fp32",
        "optimizer": "sgd",
        "compile": False,
        "ac": "none",
        "strategy": "ddp",
        "devices": 2,
        "repeat": 0,
        "step": 0,
        "phase": "warmup",
        "step_time_s": 0.5,
        "step_time_min_s": 0.4,
        "loss": 0.7,
        "samples": 64,
    }
    records.write_steps(tmp_path / "steps.csv", [row])
    with open(tmp_path / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    assert rows == [
        {k: str(v) for k, v in {"schema_version": records.SCHEMA_VERSION, **row}.items()}
    ]


def test_meta_round_trip_and_status_is_checked(tmp_path):
    meta = {
        "status": "skipped",
        "reason": "no GPUs",
        "model": "m",
        "precision": "fp32",
        "optimizer": "sgd",
        "compile": False,
        "ac": "none",
        "strategy": "dp",
        "devices": 2,
        "repeat": 0,
    }
    records.write_meta(tmp_path / "meta.json", meta)
    assert records.read_meta(tmp_path / "meta.json") == {
        "schema_version": records.SCHEMA_VERSION,
        **meta,
    }
    with pytest.raises(ValueError, match="status"):
        records.write_meta(tmp_path / "x.json", {**meta, "status": "great"})


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "unreadable"),
        (json.dumps({"schema_version": 99, "status": "ok"}), "schema version 99"),
        (json.dumps({"schema_version": records.SCHEMA_VERSION, "status": "ok"}), "lacks"),
        ("[]", "not a JSON object"),
    ],
)
def test_untrustworthy_meta_is_rejected_naming_the_file(tmp_path, content, message):
    path = tmp_path / "meta.json"
    path.write_text(content)
    with pytest.raises(records.ResultsError, match=message) as err:
        records.read_meta(path)
    assert str(path) in str(err.value)


def test_atomic_write_leaves_no_temp_and_keeps_old_file_on_failure(tmp_path):
    path = tmp_path / "f.txt"
    records.atomic_write_bytes(path, b"old")

    with pytest.raises(TypeError):
        records.atomic_write_bytes(path, object())  # type: ignore[arg-type]
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["f.txt"]
    assert oct(path.stat().st_mode & 0o777) != oct(0o600), "shareable, not mkstemp's 0600"


def _failure(rank: int, exitcode: int) -> list[str]:
    return [
        "  time      : 2026-11-23_10:00:00",
        "  host      : node1",
        f"  rank      : {rank} (local_rank: {rank})",
        f"  exitcode  : {exitcode} (pid: 4242)",
        "  error_file: <N/A>",
    ]


def _torchrun_report(rank: int, exitcode: int, *others: tuple[int, int]) -> list[str]:
    """The agent's failure report, in the layout torchrun prints it: the other
    failures, then the one it names the root cause."""
    lines = ["Failures:"]
    for i, (other, code) in enumerate(others, 1):
        lines += [f"[{i}]:", *_failure(other, code), "-" * 20]
    return [*lines, "Root Cause (first observed failure):", "[0]:", *_failure(rank, exitcode)]


def _error(rank: int, kind: str, message: str) -> dict:
    return {"rank": rank, "type": kind, "message": message}


@pytest.mark.parametrize(
    "report, errors, expected",
    [
        # Nothing to go on.
        ([], [], ""),
        # A rank died without an exception: torchrun's verdict is the cause.
        (
            _torchrun_report(1, 13),
            [],
            "torchrun: rank 1 failed first (exit code 13) without a Python exception",
        ),
        # Both ranks raised: the ranks' own clocks (errors, earliest first) beat the
        # agent's poll, which may find the later one dead first.
        (
            _torchrun_report(1, 1),
            [_error(0, "ValueError", "first"), _error(1, "RuntimeError", "then")],
            "rank 0: ValueError: first",
        ),
        # The named rank died of a signal; another's exception is its symptom, kept.
        (
            _torchrun_report(1, -6),
            [_error(0, "RuntimeError", "Connection closed by peer")],
            "torchrun: rank 1 failed first (killed by signal SIGABRT) without a Python "
            "exception; then rank 0: RuntimeError: Connection closed by peer",
        ),
        # Both failed within the agent's one-second resolution and it named the rank
        # whose exception says a peer went away: the one killed by SIGABRT was first.
        (
            _torchrun_report(0, 1, (1, -6)),
            [_error(0, "RuntimeError", "Read error: Connection reset by peer")],
            "torchrun named rank 0, whose peer went away; rank 1 failed first (killed by "
            "signal SIGABRT) without a Python exception; then rank 0: RuntimeError: Read "
            "error: Connection reset by peer",
        ),
        # torchrun named a rank killed by a signal: its verdict stands, whatever else
        # it lists.
        (
            _torchrun_report(1, -6, (2, -9)),
            [_error(0, "RuntimeError", "Connection reset by peer")],
            "torchrun: rank 1 failed first (killed by signal SIGABRT) without a Python "
            "exception; then rank 0: RuntimeError: Connection reset by peer",
        ),
        # A rank the agent stopped with SIGTERM is not a cause, whatever the others saw.
        (
            _torchrun_report(0, 1, (1, -15)),
            [_error(0, "RuntimeError", "Connection closed by peer")],
            "rank 0: RuntimeError: Connection closed by peer",
        ),
        # No report (the agent itself was killed): the earliest exception.
        ([], [_error(1, "OutOfMemoryError", "injected")], "rank 1: OutOfMemoryError: injected"),
    ],
    ids=[
        "nothing",
        "exit-no-exception",
        "earliest-exception",
        "signal-then-symptom",
        "symptom-named-first",
        "signal-named-first",
        "stopped-by-agent",
        "no-report",
    ],
)
def test_root_cause_names_the_first_failure(report, errors, expected):
    from parabench.jobs import guard

    assert guard.root_cause(report, errors, 2) == expected


def test_a_result_of_the_version_before_activation_checkpointing_is_read_as_none(tmp_path):
    """Version 3 records (no `ac`) are what those cells ran without checkpointing: read
    as `ac: none`, so a finished result survives the upgrade (its settings hash is the
    same too); an older version is still refused."""
    meta = {
        "schema_version": 3,
        "status": "skipped",
        "reason": "no GPUs",
        "model": "m",
        "precision": "fp32",
        "optimizer": "sgd",
        "compile": False,
        "strategy": "dp",
        "devices": 2,
        "repeat": 0,
    }
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    assert records.read_meta(tmp_path / "meta.json")["ac"] == "none"
    old = [c for c in records.STEP_COLUMNS if c != "ac"]
    records.check_step_header(tmp_path / "steps.csv", old)
    (tmp_path / "meta.json").write_text(json.dumps({**meta, "schema_version": 2}))
    with pytest.raises(records.ResultsError, match="schema version 2"):
        records.read_meta(tmp_path / "meta.json")
