# Helpers shared by the rules: the cell table and each cell's command line, built by the
# parabench package (torch-free modules: config, catalog, checks, launch, records) so the
# workflow and `parabench sweep` plan and start cells the same way.
import hashlib
import shlex
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.logging import logger

from parabench.catalog import OPTIMIZERS, PRECISIONS, STRATEGIES, multi_rank
from parabench.layout import AC_PATTERN
from parabench.checks import static_skip_reason
from parabench.config import (
    alone_ranks,
    as_integers,
    cells,
    collective_bytes,
    collective_devices,
    load_schema,
    problems,
    rank_parts,
    ranks_of,
    skipped,
    slurm_jobs,
)
from parabench.preflight import doctor
from parabench.jobs import lock
from parabench.jobs import warm
from parabench.config import advise_measures, measures, planned_specs
from parabench.jobs.launch import (
    advise_command,
    collectives_settings,
    launch_collectives_command,
    launch_command,
    plan_command,
    ranks_command,
)
from parabench.records import CELL_DIR, RANK_COLUMNS, concat_rows

RESULTS = config["results"]
# The repository (where report/ lives), whatever the working directory is.
REPO = Path(workflow.basedir)

# YAML's 4.0 passes the schema's "integer": make such values the ints they mean.
config.update(as_integers(dict(config), load_schema()))

# Rules the schema cannot express: one message per broken rule, naming the key, before
# any job starts.
_problems = problems(config, Path.cwd())
if _problems:
    raise WorkflowError("invalid config:\n  - " + "\n  - ".join(_problems))

CELLS = {cell.path: cell for cell in cells(config)}

# The runtime (minutes) each rule's Slurm jobs ask for: what its guard allows, and a
# margin (config.slurm_jobs, which the preflight checks against the partition).
RUNTIME = {job.rule: job.minutes for job in slurm_jobs(config)}

# Cells a strategy cannot run for this model, device count or device (a width tensor
# parallelism cannot split, fewer blocks than stages, DataParallel on CPU): listed when
# the workflow plans, each recorded as skipped with its reason by its job, which asks
# for no GPU. Said once, by the process that plans, not by every cluster job.
if workflow.is_main_process:
    for reason, where in skipped(config).items():
        logger.info(f"parabench: skipped, {reason}: {', '.join(sorted(set(where)))}")


def cell_dir(path):
    return f"{RESULTS}/{path}"


# Wildcard patterns of records.CELL_DIR, from the catalog: variant e.g. bf16-adamw-compile.
WILDCARDS = {
    "model": r"[A-Za-z][A-Za-z0-9_]*",
    "variant": rf"({'|'.join(PRECISIONS)})-({'|'.join(OPTIMIZERS)})(-compile)?(-ac({AC_PATTERN}))?",
    "strategy": "|".join(STRATEGIES),
    "devices": r"[1-9][0-9]*",
    "repeat": r"[0-9]+",
}


def _spec(wc):
    return CELLS[CELL_DIR.format(**{k: wc[k] for k in WILDCARDS})].spec


def launch(wc, output):
    """The cell's `parabench launch` command (jobs/launch.py decides how its ranks start),
    shell-quoted: config values never reach the shell unquoted."""
    out = Path(output.meta).parent
    return shlex.join(launch_command(_spec(wc), out, config["cell_timeout_s"]))


def slurm_extra(wc):
    """sbatch's extra flags of a timed job: whole nodes unless exclusive_nodes is off
    (ignored by local runs)."""
    return "--exclusive" if config["exclusive_nodes"] else ""


def gpus(wc):
    """GPUs to ask the scheduler for: none for CPU runs and for cells recorded as
    skipped without running (a job asking for 16 GPUs on 8-GPU nodes would never start)."""
    spec = _spec(wc)
    if config["device"] == "cpu" or static_skip_reason(spec):
        return 0
    return spec.devices


# Cells that span nodes (GPU cells needing more than gpus_per_node, torchrun strategies)
# go to rule benchmark_multinode; a regex that matches nothing when there are none.
MULTINODE_DEVICES = sorted(
    {c.spec.devices for c in CELLS.values() if c.spec.nodes > 1 and not static_skip_reason(c.spec)}
)
MULTINODE_DEVICES_RE = "|".join(map(str, MULTINODE_DEVICES)) or "(?!)"
MULTINODE_STRATEGIES_RE = "|".join(multi_rank())


def nodes(wc):
    return _spec(wc).nodes


# The collectives benchmark: one per multi-rank device count of the sweep.
COLLECTIVE_DEVICES = collective_devices(config)


def collectives_launch(wc, output):
    return shlex.join(
        launch_collectives_command(
            int(wc.devices),
            collective_bytes(config),
            config["device"],
            config["timeout_s"],
            Path(output.meta).parent,
            config["cell_timeout_s"],
        )
    )


def rank_part(wc):
    """A ranks job's part (i, k) of ranks.smk's RANK_PARTS, or None: the one job."""
    return (int(wc.part), RANK_PARTS) if hasattr(wc, "part") else None


# Of the ranks and plan jobs, Snakemake compares (its params trigger) what they measure
# (params.measures), nothing else of the config: each reruns when that changes, never
# for cell_timeout_s, rank_timeout_s or exclusive_nodes. Their commands carry the whole
# config, timeouts included; like each cell's, they are functions of the output, which
# it leaves out.
def ranks_launch(wc, output):
    """The ranks job's command; params.measures: each rank and its settings."""
    return shlex.join(ranks_command(config, Path(output.ranks).parent, rank_part(wc)))


def plan_measures(wc):
    """What the plan measures and predicts with: each planned rank and its settings, and
    the fabric: the curves' settings and device counts (its input is ancient: the
    aggregate rewrites collectives.csv whenever any cell reruns), or an nccl-tests
    file's content."""
    fabric = PLAN["fabric"]
    if PLAN_CURVES:
        what = f"{COLLECTIVES_SETTINGS} at {collective_devices(config)}"
    elif Path(fabric).is_file():
        what = hashlib.sha256(Path(fabric).read_bytes()).hexdigest()
    else:
        what = "(a named profile)"
    return [*measures((spec, 0) for spec in planned_specs(config)), f"fabric {fabric} {what}"]


def plan_launch(wc, input, output):
    """The plan's command (it reads the curves where its fabric is `curves`)."""
    curves = input.collectives if PLAN_CURVES else None
    return shlex.join(plan_command(config, Path(output.plan).parent, curves))


# The collectives benchmark's settings: a changed one reruns it (params), nothing else.
COLLECTIVES_SETTINGS = collectives_settings(collective_bytes(config), config["device"])


# One writer per results directory (parabench.jobs.lock): the run holds its lock from onstart
# (the Snakefile's) to onsuccess or onerror, in the main process, for every job of the
# run wherever it runs. Snakemake's own lock covers its working directory, not a
# `parabench sweep` beside it, nor another run with another --directory.
_HELD = []


def take_results_lock():
    try:
        held = lock.acquire(Path(RESULTS), shlex.join(["snakemake", *sys.argv[1:]]))
    except lock.LockHeld as e:
        raise WorkflowError(f"parabench: {e}") from None
    if held.took_over:
        logger.info(f"parabench: took over the lock of {held.took_over}, which is gone")
    _HELD.append(held)


def release_results_lock():
    while _HELD:
        lock.release(_HELD.pop())


def preflight(executor=None):
    """The doctor's checks for this run (parabench.preflight.doctor), a log line each, in a process
    of its own with the jobs' python (`python` on PATH, as the rules start it): their
    torch is what counts, and any CUDA context the checks open ends with it.
    `executor`: the run's executor plugin (default the workflow's, once it runs).
    WorkflowError if one fails, before any job starts."""
    executor = executor or workflow.executor_plugin
    local = executor is None or executor.common_settings.local_exec
    slurm = None
    if not local:
        slurm = doctor.resources(workflow.resource_settings.default_resources.args or [])
    lines, ok = doctor.in_child(config, "python", slurm, gpus=local)
    for line in lines:
        logger.info(f"parabench doctor: {line}")
    if not ok:
        raise WorkflowError(
            "parabench doctor: this environment cannot run this config (the FAIL lines "
            "above); nothing was started"
        )


def run_held(execute):
    """Snakemake's run of the workflow (`workflow.execute`), holding the results lock
    and after the preflight where --no-hooks leaves out onstart, onsuccess and onerror,
    which do both otherwise: the run's settings are known here (Snakemake sets them
    before it calls this), and so is its executor (a dry run's takes neither). In the
    main process only: a cluster job's parse runs no workflow of its own. A run whose
    jobs run here has a warm process for their launches (parabench.jobs.warm), importing
    torch while the preflight runs; a cluster's jobs start on other hosts, without."""

    def run(*args, **kwargs):
        executor = kwargs.get("executor_plugin", args[0] if args else None)
        settings = executor.common_settings
        here = settings.local_exec and not settings.dryrun_exec
        # a cluster's jobs start cold, on their own hosts (warm.elsewhere)
        warmed = warm.warm_process(hf_types=warm.hf_types(config)) if here else warm.elsewhere()
        with warmed:
            if not workflow.execution_settings.no_hooks or settings.dryrun_exec:
                return execute(*args, **kwargs)
            take_results_lock()
            try:
                preflight(executor)
                return execute(*args, **kwargs)
            finally:
                release_results_lock()

    return run
