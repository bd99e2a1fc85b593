"""Command line: `parabench launch | run | launch-collectives | collectives | ranks |
aggregate | report | compare | plan | sweep | unlock | doctor`.

`launch` starts one cell however it must be started and records its outcome, whatever
happens; `run` is what each of its processes runs. Their flags are RunSpec's fields
(spec.add_arguments), so every logged command reruns its cell by hand, without
Snakemake.
"""

from __future__ import annotations

import argparse
import atexit
import faulthandler
import os
import sys
from pathlib import Path
from typing import NoReturn

from parabench import spec as specs
from parabench.config import COLLECTIVE_BYTES


def _bytes_list(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="parabench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    launch = sub.add_parser("launch", help="start one cell (its ranks) and record its outcome")
    specs.add_arguments(launch)
    launch.add_argument("--out", type=Path, required=True, help="the cell's directory")
    launch.add_argument(
        "--cell-timeout-s", type=float, default=1800.0, help="wall-clock limit, then killed"
    )

    run = sub.add_parser("run", help="one process of a cell (what `launch` starts)")
    specs.add_arguments(run)
    run.add_argument("--out", type=Path, required=True, help="cell directory for the records")

    for name, helptext in (
        ("launch-collectives", "start the collectives benchmark at n ranks and record it"),
        ("collectives", "one rank of the collectives benchmark (what the launch starts)"),
    ):
        col = sub.add_parser(name, help=helptext)
        col.add_argument("--devices", type=int, required=True, help="ranks (torchrun's nproc)")
        col.add_argument(
            "--message-bytes",
            type=_bytes_list,
            default=list(COLLECTIVE_BYTES),
            help="message sizes in bytes, comma-separated",
        )
        col.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
        col.add_argument("--timeout-s", type=float, default=300.0, help="process-group timeout")
        col.add_argument("--out", type=Path, required=True)
        if name == "launch-collectives":
            col.add_argument("--cell-timeout-s", type=float, default=1800.0)

    agg = sub.add_parser("aggregate", help="merge cell records into steps.csv and summary.csv")
    agg.add_argument("--meta", type=Path, nargs="+", required=True, help="cells' meta.json files")
    agg.add_argument("--steps-out", type=Path, required=True)
    agg.add_argument("--summary-out", type=Path, required=True)
    agg.add_argument("--cells-out", type=Path, required=True)
    agg.add_argument(
        "--collectives", type=Path, nargs="*", default=[], help="benchmarks' meta.json"
    )
    agg.add_argument("--collectives-out", type=Path, help="merged collective curves (CSV)")
    agg.add_argument(
        "--ranks", type=Path, help="ranks.csv (parabench ranks), for the scaling model"
    )
    agg.add_argument(
        "--config-hashes",
        nargs="+",
        help="per --meta, the settings hash of the config's cell there: a record of other "
        "settings is refused",
    )

    rep = sub.add_parser("report", help="render report.html from the aggregated tables")
    rep.add_argument("--results", type=Path, required=True, help="directory with summary.csv")
    rep.add_argument("--templates", type=Path, help="the report/ directory (default: ours)")
    rep.add_argument("--config-json", default="", help="the workflow config, as JSON")
    rep.add_argument("--out", type=Path, required=True)
    rep.add_argument("--plots-dir", type=Path, help="also write each plot as a PNG here")

    cmp = sub.add_parser("compare", help="run B against run A: each change with its interval")
    cmp.add_argument("a", type=Path, help="results directory of run A (the baseline)")
    cmp.add_argument("b", type=Path, help="results directory of run B")
    cmp.add_argument(
        "--out", type=Path, default=Path("compare.html"), help="the HTML (outside A and B)"
    )
    cmp.add_argument("--csv", type=Path, help="the table (default: beside --out, .csv)")
    cmp.add_argument("--force", action="store_true", help="compare runs that differ")
    cmp.add_argument("--templates", type=Path, help="the report/ directory")

    rks = sub.add_parser(
        "ranks", help="one rank of each multi-process cell, alone: ranks.csv (the scaling model)"
    )
    rks.add_argument("config", type=Path, nargs="?", help="a workflow config file")
    rks.add_argument("--config-json", default="", help="the workflow config, as JSON")
    rks.add_argument("--out", type=Path, required=True, help="directory for ranks.csv")
    rks.add_argument(
        "--part", type=_part, help="I/K: the I-th of K jobs measuring them (default all)"
    )
    rks.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # the child

    pln = sub.add_parser("plan", help="one real rank at world sizes beyond this machine: plan.csv")
    pln.add_argument("config", type=Path, nargs="?", help="a workflow config file")
    pln.add_argument("--config-json", default="", help="the workflow config, as JSON")
    pln.add_argument(
        "--fabric",
        help="curves, a named profile or an nccl-tests output file (default: the config's)",
    )
    pln.add_argument(
        "--collectives", type=Path, help="collectives.csv, for fabric curves (default: results')"
    )
    pln.add_argument("--out", type=Path, required=True, help="directory for plan.csv")
    pln.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # the child

    adv = sub.add_parser(
        "advise", help="which layout on N GPUs, whether it fits, how fast: advise.csv"
    )
    adv.add_argument("config", type=Path, nargs="?", help="a workflow config file")
    adv.add_argument("--config-json", default="", help="the workflow config, as JSON")
    adv.add_argument("--gpus", type=int, nargs="+", help="GPU counts N (default: the config's)")
    adv.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: the config's)")
    adv.add_argument("--gpu", help="a GPU profile, this-machine, or a profile file")
    adv.add_argument("--fabric", help="curves, a named profile or an nccl-tests output file")
    adv.add_argument("--global-batch", type=int, help="samples per step over all GPUs")
    adv.add_argument("--global-tokens", type=int, help="tokens per step over all GPUs")
    adv.add_argument("--models", nargs="+", help="the models (default: the config's)")
    adv.add_argument(
        "--compile", action="store_true", help="price the runs compiled (advise.compile)"
    )
    adv.add_argument("--float8", action="store_true", help="price Float8 linears (advise.float8)")
    adv.add_argument(
        "--torchtitan",
        action="store_true",
        help="also predict torchtitan's published runs: advise-torchtitan.csv",
    )
    adv.add_argument(
        "--layout",
        help="price this one layout instead of searching, as people write it: "
        "'FSDP 32 x TP 8, full AC, micro 2' (its GPUs are its degrees' product)",
    )
    adv.add_argument(
        "--collectives", type=Path, help="collectives.csv, for fabric curves (default: results')"
    )
    adv.add_argument(
        "--workers",
        type=int,
        help="processes searching side by side (default: this host's cores, where the "
        "search is large enough to pay for starting them)",
    )
    adv.add_argument(
        "--cache",
        type=Path,
        help="a directory to keep each rank's fake step in, and read it from: a later "
        "search of the same model (other GPUs, fabric or N) takes seconds (off by default)",
    )
    adv.add_argument("--out", type=Path, required=True, help="directory for advise.csv")

    reh = sub.add_parser(
        "rehearse",
        help="every cell at its real size on fake tensors (fake CUDA for a GPU config), "
        "before anything is queued: rehearsal.csv",
    )
    reh.add_argument("config", type=Path, nargs="?", help="a workflow config file")
    reh.add_argument("--config-json", default="", help="the workflow config, as JSON")
    reh.add_argument(
        "--gpu", help="the GPU each rank's peak is set against (default: rehearse.gpu)"
    )
    reh.add_argument(
        "--out", type=Path, help="directory for rehearsal.csv (default: the config's results)"
    )

    doc = sub.add_parser("doctor", help="check this environment can run a config, one line each")
    doc.add_argument(
        "config", type=Path, nargs="?", help="a workflow config file (default config/config.yaml)"
    )
    doc.add_argument("--config-json", default="", help="the workflow config, as JSON")
    doc.add_argument("--profile", type=Path, help="a Slurm profile directory to check")
    doc.add_argument(
        "--slurm-resources", default="", help="a Slurm run's default resources, as JSON"
    )
    doc.add_argument(
        "--gpus",
        choices=("auto", "here", "later"),
        default="auto",
        help="GPU checks: here, later (on the GPU node), auto (here if this host has GPUs)",
    )
    doc.add_argument("--out", type=Path, help="also write the lines to this file")

    swp = sub.add_parser("sweep", help="run a whole config without Snakemake, then report")
    swp.add_argument("config", type=Path, help="a workflow config file (config/*.yaml)")
    swp.add_argument("--results", help="results directory (overrides the config's)")
    swp.add_argument("--devices", help="device counts, e.g. 1,2,4, or auto: what the GPUs allow")
    swp.add_argument("--force", action="store_true", help="rerun cells already recorded")
    swp.add_argument(
        "--retry-failed",
        action="store_true",
        help="rerun the cells recorded as failed, and keep every other recorded cell",
    )
    swp.add_argument(
        "-n", "--dry-run", action="store_true", help="plan and list the cells, run nothing"
    )

    unl = sub.add_parser(
        "unlock", help="clear a results directory's lock whose holder is gone (a killed run)"
    )
    unl.add_argument("results", type=Path, help="the results directory")
    return parser


def exit_now(code: int) -> NoReturn:
    """Exit once the exit handlers have run (logging, multiprocessing, torch's own),
    without tearing the interpreter down: with torch loaded that takes a second here,
    which every process of a sweep would pay. Every record is already written and
    closed; only the streams need flushing. Skipped with the teardown: threading's
    shutdown (joining non-daemon threads, concurrent.futures' workers), which
    parabench does not use."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def entry() -> NoReturn:
    """The `parabench` command (and `python -m parabench`)."""
    exit_now(main())


def main(argv: list[str] | None = None) -> int:
    # Every Python a command starts (a cell's ranks, torchrun's agent) leaves the working
    # directory off sys.path: a file there (a factory's json.py, a config's colorsys.py)
    # never shadows a module a rank imports (Python >= 3.11; the user's factory itself
    # is loaded by its path, models/custom.py).
    os.environ.setdefault("PYTHONSAFEPATH", "1")
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command in ("run", "collectives"):  # the commands the ranks run
        # A rank killed by a signal (a segfault, an abort in native code) prints its
        # Python stack into its log; the guard names the innermost frame.
        _on_fatal_signal()
    if args.command in ("run", "launch"):
        try:
            spec = specs.from_namespace(args)
        except ValueError as e:
            print(f"parabench: invalid cell: {e}", file=sys.stderr)
            return 2
        if args.command == "launch":
            from parabench.jobs.launch import launch_cell

            return launch_cell(spec, args.out, args.cell_timeout_s)
        return _run(spec, args.out)
    if args.command == "launch-collectives":
        from parabench.jobs.launch import launch_collectives

        return launch_collectives(
            args.devices,
            args.message_bytes,
            args.device,
            args.timeout_s,
            args.out,
            args.cell_timeout_s,
        )
    if args.command == "collectives":
        from parabench.run.collectives import run as run_collectives

        return run_collectives(
            args.devices, args.message_bytes, args.device, args.timeout_s, args.out
        )
    if args.command == "compare":
        return _compare(args)
    if args.command == "plan":
        return _plan(args)
    if args.command == "advise":
        return _advise(args)
    if args.command == "ranks":
        return _ranks(args)
    if args.command == "doctor":
        return _doctor(args)
    if args.command == "rehearse":
        return _rehearse(args)
    if args.command == "sweep":
        from parabench.jobs.sweep import main as sweep

        return sweep(
            args.config, args.results, args.devices, args.force, args.dry_run, args.retry_failed
        )
    if args.command == "unlock":
        return _unlock(args.results)
    if args.command == "report":
        from parabench.report import TEMPLATES, load_config, render

        templates = args.templates or TEMPLATES
        render(args.results, templates, load_config(args.config_json), args.out, args.plots_dir)
        return 0
    if args.command == "aggregate":
        from parabench.records import ResultsError
        from parabench.report.aggregate import aggregate

        try:
            aggregate(
                args.meta,
                args.steps_out,
                args.summary_out,
                args.cells_out,
                args.collectives,
                args.collectives_out,
                args.ranks,
                args.config_hashes,
            )
        except ResultsError as e:  # one clear line naming the file, not a traceback
            print(f"parabench aggregate: refusing to merge: {e}", file=sys.stderr)
            return 1
        return 0
    return 1


def preload(argv: list[str]) -> None:
    """Import what a rank of `parabench <argv>` will import (parabench.torchrun forks
    its ranks after this): for a cell, its strategy's module and torch._dynamo, which
    every torch.optim constructor imports on first use. A bad argument is left for
    the ranks to report, as they would without it."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit:  # argparse has printed why; the ranks will say it again
        return
    if args.command == "run":
        import torch._dynamo  # noqa: F401

        from parabench import strategies
        from parabench.catalog import CATALOG

        if args.strategy in CATALOG:
            strategies.get(args.strategy)
        try:
            model = specs.from_namespace(args).model
        except ValueError:  # the ranks will say why
            return
        if model.arch == "hf":  # transformers and the model's own module
            from parabench.models import hf

            hf.preload(model)
    elif args.command == "collectives":
        from parabench.run import collectives  # noqa: F401


def _run(spec: specs.RunSpec, out: Path) -> int:
    """One process of a cell: checked once here, skipped if the settings say so."""
    from parabench import checks

    if problems := checks.problems(spec):
        print("parabench: invalid cell: " + "; ".join(problems), file=sys.stderr)
        return 2
    if reason := checks.static_skip_reason(spec):
        from parabench.jobs.launch import record_skip

        record_skip(spec, out, reason)
        return 0
    from parabench.run.cell import run_cell

    return run_cell(spec, out)


def _compare(args: argparse.Namespace) -> int:
    from parabench.records import atomic_write_bytes
    from parabench.report import TEMPLATES, compare

    csv_out = args.csv or args.out.with_suffix(".csv")
    try:  # before anything is read or written
        compare.refuse_outputs_inside(args.a, args.b, {"--out": args.out, "--csv": csv_out})
        table, diffs = compare.compare(args.a, args.b, args.force)
    except compare.CompareError as e:
        print(f"parabench compare: {e}", file=sys.stderr)
        return 2
    for d in diffs:
        print(f"differs: {d}")
    atomic_write_bytes(csv_out, table.to_csv(index=False).encode())
    compare.render(table, diffs, args.a, args.b, args.templates or TEMPLATES, args.out)
    for verdict, n in table["verdict"].value_counts().items():
        print(f"{verdict}: {n} cells")
    print(f"comparison: {args.out} and {csv_out}")
    return 0


def _config(args: argparse.Namespace) -> dict:
    """The config a command names: a file, or the workflow's as JSON (checked alike)."""
    import json

    from parabench.config import ConfigError, checked, load_config

    if args.config:
        return load_config(args.config)
    if args.config_json:
        return checked(json.loads(args.config_json))
    raise ConfigError(f"parabench {args.command} needs a config file or --config-json")


def _doctor(args: argparse.Namespace) -> int:
    from parabench.config import ConfigError, load_config
    from parabench.preflight import doctor

    try:
        if not args.config and not args.config_json:
            args.config = Path("config/config.yaml")
        config = _config(args) if args.config_json else load_config(args.config)
    except (ConfigError, OSError) as e:
        print(f"parabench doctor: {e}", file=sys.stderr)
        return 2
    gpus = {"auto": None, "here": True, "later": False}[args.gpus]
    slurm = doctor.profile_resources(args.profile) if args.profile else None
    if args.slurm_resources:
        import json

        slurm = json.loads(args.slurm_resources)
    found = doctor.run_checks(config, Path.cwd(), slurm, gpus)
    text = "\n".join(c.line() for c in found) + "\n"
    print(text, end="", flush=True)
    if args.out:
        from parabench.records import atomic_write_bytes

        atomic_write_bytes(args.out, text.encode())
    if bad := doctor.failed(found):
        print(f"parabench doctor: {len(bad)} check(s) failed", file=sys.stderr)
        return 1
    return 0


def _on_fatal_signal() -> None:
    """faulthandler for a rank: the stack of the thread the signal hit, not every
    thread's. Walking other threads' frames while they run (autograd's, a hook's) is
    unsafe, the Python docs warn, and once turned a rank's abort into a SIGSEGV inside
    the handler, with no stack written."""
    faulthandler.enable(all_threads=False)


def _rehearse(args: argparse.Namespace) -> int:
    """The rehearsal (preflight/rehearse.py): 0 when every cell can run, 1 when some cannot, 2 when
    it could not rehearse at all."""
    import json

    import yaml

    from parabench.config import ConfigError
    from parabench.preflight import fakecuda

    try:  # the fake CUDA device loads before anything imports torch (a factory may)
        raw = json.loads(args.config_json) if args.config_json else None
        if raw is None and args.config:
            raw = yaml.safe_load(args.config.read_text())
        how = "fake tensors on the CPU"
        if (raw or {}).get("device", "auto") != "cpu":
            how = fakecuda.install()
        config = _config(args)
    except (ConfigError, OSError, fakecuda.Unavailable) as e:
        print(f"parabench rehearse: {e}", file=sys.stderr)
        return 2
    from parabench.preflight import rehearse

    out = args.out or Path(config["results"])
    out.mkdir(parents=True, exist_ok=True)
    print(f"rehearse: CUDA stands in as {how}", flush=True)
    print("rehearse: not rehearsed: " + "; ".join(rehearse.LIMITS.values()), flush=True)
    gpu = args.gpu or config["rehearse"]["gpu"]
    rows = rehearse.run(config, out, gpu, log=lambda line: print(line, flush=True))
    for line in rehearse.summary(rows):
        print(f"rehearse: {line}", flush=True)
    return 1 if rehearse.refused(rows) else 0


def _unlock(results: Path) -> int:
    from parabench.jobs.lock import LockHeld, unlock

    try:
        print(f"parabench unlock: {unlock(results)}")
    except LockHeld as e:
        print(f"parabench unlock: {e}", file=sys.stderr)
        return 1
    return 0


def _ranks(args: argparse.Namespace) -> int:
    from parabench.config import ConfigError

    try:
        config = _config(args)
    except ConfigError as e:
        print(f"parabench ranks: {e}", file=sys.stderr)
        return 2
    if not args.measure:  # the guard: always a row per rank, whatever the child does
        from parabench.jobs.launch import launch_ranks

        return launch_ranks(config, args.out, args.part)
    _on_fatal_signal()  # a rank killed in native code: where Python was, in the log
    from parabench.predict.rank_alone import run_ranks

    run_ranks(config, args.out, args.part)
    return 0


def _part(text: str) -> tuple[int, int]:
    """`I/K` (1 <= I <= K) as (I, K)."""
    i, _, k = text.partition("/")
    try:
        part = int(i), int(k)
    except ValueError:
        part = (0, 0)
    if not 1 <= part[0] <= part[1]:
        raise argparse.ArgumentTypeError(f"{text!r} is not I/K with 1 <= I <= K")
    return part


def _plan(args: argparse.Namespace) -> int:
    import pandas as pd

    from parabench.config import ConfigError, plan_problems
    from parabench.hardware.fabric import FabricError, resolve

    try:
        config = _config(args)
        if args.fabric:
            config["plan"]["fabric"] = args.fabric
        if found := plan_problems(config, Path.cwd()):
            raise ConfigError("; ".join(found))
        path = args.collectives or Path(config["results"]) / "collectives.csv"
        curves = pd.read_csv(path) if path.is_file() else None
        if config["plan"]["fabric"] == "curves" and curves is None:
            raise ConfigError(
                f"plan.fabric: curves needs the collectives benchmark's {path} "
                "(run the sweep first, or name another fabric with --fabric)"
            )
        fabric = resolve(config["plan"]["fabric"], curves)
    except (ConfigError, FabricError) as e:
        print(f"parabench plan: {e}", file=sys.stderr)
        return 2
    if not args.measure:  # the guard: always a row per planned rank, whatever the child does
        from parabench.jobs.launch import launch_plan

        fields = {"scaling": config["plan"]["scaling"], "fabric": fabric.name}
        fields["fabric_source"] = fabric.source
        launch_plan(config, args.out, args.collectives, fields)
        print(f"plan: {args.out / 'plan.csv'} (fabric {fabric.name})")
        return 0
    _on_fatal_signal()  # a rank killed in native code: where Python was, in the log
    from parabench.predict.plan import run_plan

    run_plan(config, fabric, args.out)
    return 0


def _advise(args: argparse.Namespace) -> int:
    from parabench.config import ConfigError, advise_problems, checked
    from parabench.hardware.fabric import FabricError, resolve
    from parabench.hardware.gpus import THIS_MACHINE, GPUError
    from parabench.hardware.gpus import resolve as resolve_gpu

    try:
        config = _config(args)
        adv = config["advise"]
        adv["enabled"] = True
        for key in ("gpus", "gpus_per_node", "gpu", "fabric", "models"):
            if getattr(args, key) is not None:
                adv[key] = getattr(args, key)
        if args.global_batch is not None or args.global_tokens is not None:
            adv.pop("global_batch", None), adv.pop("global_tokens", None)
            by_batch = args.global_batch is not None
            adv["global_batch" if by_batch else "global_tokens"] = (
                args.global_batch if by_batch else args.global_tokens
            )
        for key in ("compile", "float8"):
            adv[key] = adv.get(key) or getattr(args, key)
        config = checked(config)  # the options as the file's keys: the same bounds
        adv = config["advise"]
        if found := advise_problems(config, Path.cwd()):
            raise ConfigError("; ".join(found))
        curves = None
        if adv["fabric"] == "curves":
            import pandas as pd

            path = args.collectives or Path(config["results"]) / "collectives.csv"
            if not path.is_file():
                raise ConfigError(f"advise.fabric: curves needs the collectives benchmark's {path}")
            curves = pd.read_csv(path)
        # a named profile's nodes, as many GPUs as the search's (which keeps tp within)
        fabric = resolve(adv["fabric"], curves).of_nodes(adv["gpus_per_node"])
        if adv["gpu"] == THIS_MACHINE:
            from parabench.predict.fakerank import this_machine

            # the device the cells run on (`device`), in the precision advise prices
            gpu = this_machine(config["device"], adv["precision"])
        else:
            gpu = resolve_gpu(adv["gpu"])
    except (ConfigError, FabricError, GPUError, OSError) as e:
        print(f"parabench advise: {e}", file=sys.stderr)
        return 2
    from parabench.predict import advise, fakerank

    args.out.mkdir(parents=True, exist_ok=True)
    if args.cache:  # in the environment: the spawned workers measure too
        os.environ[fakerank.CACHE_ENV] = str(args.cache.resolve())
    if args.layout:
        try:
            advise.price(config, args.layout, gpu, fabric, args.out, gpus=args.gpus)
        except ValueError as e:  # the layout or its micro-batch, named
            print(f"parabench advise: {e}", file=sys.stderr)
            return 2
        print(f"advise: {args.out / advise.LAYOUT_CSV} (gpu {gpu.name}, fabric {fabric.name})")
        return 0
    from parabench import envinfo

    torchtitan = args.torchtitan or adv.get("torchtitan")
    # Each worker imports torch (seconds): worth it from tens of layouts (N = 4 has 44
    # for a GPT, each measured in about a second) or torchtitan's four runs (several
    # seconds each); a search at 1 or 2 GPUs is done sooner in this process.
    large = max(adv["gpus"]) >= 4 or torchtitan
    workers = args.workers or (envinfo.usable_cores() if large else 1)
    # Each (model, N) and each torchtitan run that fails is a row saying why (advise.run,
    # check_torchtitan): the tables are written whatever fails, and the report says it.
    with advise.pool(workers) as pool:
        advise.run(config, gpu, fabric, args.out, pool=pool)
        print(f"advise: {args.out / 'advise.csv'} (gpu {gpu.name}, fabric {fabric.name})")
        if torchtitan:
            from parabench.records import TORCHTITAN_COLUMNS, write_rows

            # torchtitan's runs are on its GPU and fabric, whatever the config advises on
            checked = advise.check_torchtitan(
                resolve_gpu("h100-96gb-500w"), resolve("h100-nvlink-ndr400"), pool=pool
            )
            write_rows(args.out / "advise-torchtitan.csv", TORCHTITAN_COLUMNS, checked)
            print(f"advise: {args.out / 'advise-torchtitan.csv'}")
    return 0
