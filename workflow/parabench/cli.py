"""Command line: `parabench run | guard | aggregate | report | sweep`.

`run` executes one cell. Its flags are generated from RunSpec's fields, so the
workflow's command line (spec_argv) and the parser cannot drift apart, and every
logged command reruns its cell by hand, without Snakemake.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import sys
from pathlib import Path

from parabench.config import COLLECTIVE_SIZES
from parabench.spec import ModelSpec, RunSpec

_SPEC_FIELDS = [f for f in dataclasses.fields(RunSpec) if f.name != "model"]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _bool(text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def spec_argv(spec: RunSpec) -> list[str]:
    """The `parabench run` arguments that reproduce `spec` exactly."""
    argv = ["--arch", spec.model.arch, "--sizes", json.dumps(dict(spec.model.sizes))]
    for f in _SPEC_FIELDS:
        value = getattr(spec, f.name)
        if value is not None:
            argv += [_flag(f.name), str(value)]
    return argv


def _add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", required=True, help="model architecture (mlp, seqnet, resmlp)")
    p.add_argument(
        "--sizes",
        default="{}",
        type=json.loads,
        help="architecture size overrides as JSON, e.g. '{\"dims\": [64, 32, 1]}'",
    )
    types = {"int": int, "float": float, "str": str, "bool": _bool, "float | None": float}
    for f in _SPEC_FIELDS:
        required = f.default is dataclasses.MISSING
        p.add_argument(
            _flag(f.name),
            dest=f.name,
            type=types[str(f.type)],
            required=required,
            default=None if required else f.default,
        )


def _spec_from(args: argparse.Namespace) -> RunSpec:
    model = ModelSpec.of(args.arch, **args.sizes)
    return RunSpec(model=model, **{f.name: getattr(args, f.name) for f in _SPEC_FIELDS})


def spec_from_launch(cmd: list[str]) -> RunSpec | None:
    """The cell a launch command runs (the arguments after `run`), or None if it is not
    a `parabench run` command: spec_argv's inverse, through the same parser."""
    if "run" not in cmd:
        return None
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    _add_spec_args(parser)
    parser.add_argument("--out")
    try:
        args, _ = parser.parse_known_args(cmd[cmd.index("run") + 1 :])
        return _spec_from(args)
    except (argparse.ArgumentError, ValueError, SystemExit):
        return None


def record_static_skip(spec: RunSpec, out: Path, reason: str) -> int:
    """Record a skip known from the settings alone, without importing torch."""
    from parabench import envinfo, records

    records.write_outcome(
        out, "skipped", reason, **spec.record_fields(), env=envinfo.base(), device_type=spec.device
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="parabench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run one cell (under torchrun for multi-rank strategies)")
    _add_spec_args(run)
    run.add_argument("--out", type=Path, required=True, help="cell directory for the records")

    agg = sub.add_parser("aggregate", help="merge cell records into steps.csv and summary.csv")
    agg.add_argument("--meta", type=Path, nargs="+", required=True, help="cells' meta.json files")
    agg.add_argument("--steps-out", type=Path, required=True)
    agg.add_argument("--summary-out", type=Path, required=True)
    agg.add_argument("--cells-out", type=Path, required=True)
    agg.add_argument(
        "--collectives", type=Path, nargs="*", default=[], help="benchmarks' meta.json"
    )
    agg.add_argument("--collectives-out", type=Path, help="merged collective curves (CSV)")

    rep = sub.add_parser("report", help="render report.html from the aggregated tables")
    rep.add_argument("--results", type=Path, required=True, help="directory with summary.csv")
    rep.add_argument("--templates", type=Path, required=True, help="the report/ directory")
    rep.add_argument("--config-json", default="", help="the workflow config, as JSON")
    rep.add_argument("--out", type=Path, required=True)
    rep.add_argument("--plots-dir", type=Path, help="also write each plot as a PNG here")

    cmp = sub.add_parser("compare", help="run B against run A: each change with its interval")
    cmp.add_argument("a", type=Path, help="results directory of run A (the baseline)")
    cmp.add_argument("b", type=Path, help="results directory of run B")
    cmp.add_argument("--out", type=Path, default=Path("compare.html"), help="the HTML")
    cmp.add_argument("--csv", type=Path, help="the table (default: beside --out, .csv)")
    cmp.add_argument("--force", action="store_true", help="compare runs that differ")
    cmp.add_argument("--templates", type=Path, help="the report/ directory")

    swp = sub.add_parser("sweep", help="run a whole config without Snakemake, then report")
    swp.add_argument("config", type=Path, help="a workflow config file (config/*.yaml)")
    swp.add_argument("--results", help="results directory (overrides the config's)")
    swp.add_argument("--devices", help="device counts, e.g. 1,2,4, or auto: what the GPUs allow")
    swp.add_argument("--force", action="store_true", help="rerun cells already recorded")

    col = sub.add_parser("collectives", help="collective curves at n ranks (under torchrun)")
    col.add_argument("--devices", type=int, required=True, help="ranks (torchrun's nproc)")
    col.add_argument(
        "--sizes", default=",".join(map(str, COLLECTIVE_SIZES)), help="bytes, comma-separated"
    )
    col.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    col.add_argument("--timeout-s", type=float, default=300.0, help="process-group timeout")
    col.add_argument("--out", type=Path, required=True)

    grd = sub.add_parser("guard", help="run a launch command; record a failure if it leaves none")
    grd.add_argument("--out", type=Path, required=True, help="the cell directory")
    grd.add_argument("--timeout", type=float, required=True, help="wall-clock limit, seconds")
    grd.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the launch command")

    args = parser.parse_args(argv)
    if args.command in ("run", "collectives"):  # the commands the ranks run
        # A rank killed by a signal (a segfault, an abort in native code) prints every
        # thread's Python stack into its log; the guard names the innermost frame.
        faulthandler.enable()
    if args.command == "run":
        try:
            spec = _spec_from(args)
        except ValueError as e:
            print(f"parabench: invalid cell: {e}", file=sys.stderr)
            return 2
        if problems := spec.problems():
            print("parabench: invalid cell: " + "; ".join(problems), file=sys.stderr)
            return 2
        if reason := spec.static_skip_reason():
            return record_static_skip(spec, args.out, reason)
        from parabench.cell import run_cell

        return run_cell(spec, args.out)
    if args.command == "guard":
        from parabench.guard import guard

        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        if "collectives" in cmd and "--devices" in cmd:
            fields = {"kind": "collectives", "devices": int(cmd[cmd.index("--devices") + 1])}
            return guard(args.out, cmd, args.timeout, fields)
        spec = spec_from_launch(cmd)
        if spec is None:
            parser.error("guard needs a `parabench run` or `collectives` command after --")
        return guard(args.out, cmd, args.timeout, spec.record_fields())
    if args.command == "collectives":
        from parabench.collectives import run as run_collectives

        sizes = [int(s) for s in args.sizes.split(",") if s]
        return run_collectives(args.devices, sizes, args.device, args.timeout_s, args.out)
    if args.command == "compare":
        from parabench import compare
        from parabench.records import atomic_write_bytes
        from parabench.sweep import TEMPLATES

        try:
            table, diffs = compare.compare(args.a, args.b, args.force)
        except compare.CompareError as e:
            print(f"parabench compare: {e}", file=sys.stderr)
            return 2
        for d in diffs:
            print(f"differs: {d}")
        csv_out = args.csv or args.out.with_suffix(".csv")
        atomic_write_bytes(csv_out, table.to_csv(index=False).encode())
        compare.render(table, diffs, args.a, args.b, args.templates or TEMPLATES, args.out)
        for verdict, n in table["verdict"].value_counts().items():
            print(f"{verdict}: {n} cells")
        print(f"comparison: {args.out} and {csv_out}")
        return 0
    if args.command == "sweep":
        from parabench.sweep import main as sweep

        return sweep(args.config, args.results, args.devices, args.force)
    if args.command == "report":
        from parabench.report import load_config, render

        render(
            args.results, args.templates, load_config(args.config_json), args.out, args.plots_dir
        )
        return 0
    if args.command == "aggregate":
        from parabench.aggregate import aggregate
        from parabench.records import ResultsError

        try:
            aggregate(
                args.meta,
                args.steps_out,
                args.summary_out,
                args.cells_out,
                args.collectives,
                args.collectives_out,
            )
        except ResultsError as e:  # one clear line naming the file, not a traceback
            print(f"parabench aggregate: refusing to merge: {e}", file=sys.stderr)
            return 1
        return 0
    return 1
