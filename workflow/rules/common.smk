# Helpers shared by the rules: the cell table and each cell's command line, built by the
# parabench package (torch-free modules) so the workflow and `parabench run` agree.
import shlex
from pathlib import Path

from snakemake.exceptions import WorkflowError

from parabench.catalog import OPTIMIZERS, PRECISIONS, STRATEGIES, multi_rank
from parabench.cli import spec_argv
from parabench.config import (
    as_integers,
    cells,
    collective_devices,
    collective_sizes,
    problems,
)
from parabench.launch import guarded_argv, guarded_collectives_argv
from parabench.sweep import load_schema

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


def cell_dir(path):
    return f"{RESULTS}/{path}"


# Wildcard patterns, from the catalog: a cell's directory is
# runs/{model}/{variant}/{strategy}/n{devices}/r{repeat}, variant e.g. bf16-adamw-compile.
CELL_DIR = "runs/{model}/{variant}/{strategy}/n{devices}/r{repeat}"
WILDCARDS = {
    "model": r"[A-Za-z][A-Za-z0-9_]*",
    "variant": rf"({'|'.join(PRECISIONS)})-({'|'.join(OPTIMIZERS)})(-compile)?",
    "strategy": "|".join(STRATEGIES),
    "devices": r"[1-9][0-9]*",
    "repeat": r"[0-9]+",
}


def _cell(wc):
    return CELLS[f"runs/{wc.model}/{wc.variant}/{wc.strategy}/n{wc.devices}/r{wc.repeat}"]


def run_args(wc):
    """`parabench run` flags of the cell, shell-quoted: config values never reach the
    shell unquoted."""
    return shlex.join(spec_argv(_cell(wc).spec))


def guarded_launch(wc, output):
    """The cell's launch under `parabench guard` (torchrun for several ranks, plain
    python otherwise), shell-quoted."""
    out = Path(output.meta).parent
    return shlex.join(guarded_argv(_cell(wc).spec, out, config["cell_timeout_s"]))


def gpus(wc):
    """GPUs to ask the scheduler for: none for CPU runs and for cells recorded as
    skipped without running (a job asking for 16 GPUs on 8-GPU nodes would never start)."""
    spec = _cell(wc).spec
    if config["device"] == "cpu" or spec.static_skip_reason():
        return 0
    return spec.devices


# Cells that span nodes (GPU cells needing more than gpus_per_node, torchrun strategies)
# go to rule benchmark_multinode; a regex that matches nothing when there are none.
MULTINODE_DEVICES = sorted(
    {c.spec.devices for c in CELLS.values() if c.spec.nodes > 1 and not c.spec.static_skip_reason()}
)
MULTINODE_DEVICES_RE = "|".join(map(str, MULTINODE_DEVICES)) or "(?!)"
MULTINODE_STRATEGIES_RE = "|".join(multi_rank())


def nodes(wc):
    return _cell(wc).spec.nodes


# The collectives benchmark: one per multi-rank device count of the sweep.
COLLECTIVE_DEVICES = collective_devices(config)


def collectives_launch(wc, output):
    return shlex.join(
        guarded_collectives_argv(
            int(wc.devices),
            collective_sizes(config),
            config["device"],
            config["timeout_s"],
            config["cell_timeout_s"],
            Path(output.meta).parent,
        )
    )
