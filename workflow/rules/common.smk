# Helpers shared by the rules: the cell table and each cell's command line, built by the
# parabench package (torch-free modules) so the workflow and `parabench run` agree.
import shlex
from pathlib import Path

from snakemake.exceptions import WorkflowError

from parabench.catalog import STRATEGIES, uses_torchrun
from parabench.cli import spec_argv
from parabench.config import cells, problems

RESULTS = config["results"]
# The repository (where report/ lives), whatever the working directory is.
REPO = Path(workflow.basedir)

# Rules the schema cannot express: one message per broken rule, naming the key, before
# any job starts.
_problems = problems(config, Path.cwd())
if _problems:
    raise WorkflowError("invalid config:\n  - " + "\n  - ".join(_problems))

CELLS = {cell.path: cell for cell in cells(config)}


def cell_dir(path):
    return f"{RESULTS}/{path}"


def _cell(wc):
    return CELLS[f"runs/{wc.model}/{wc.strategy}/n{wc.devices}/r{wc.repeat}"]


def run_args(wc):
    """`parabench run` flags of the cell, shell-quoted: config values never reach the
    shell unquoted."""
    return shlex.join(spec_argv(_cell(wc).spec))


def launcher(wc):
    """torchrun for strategies with one rank per device, plain python otherwise."""
    n = int(wc.devices)
    if uses_torchrun(wc.strategy, n):
        return f"torchrun --standalone --nnodes 1 --nproc-per-node {n} -m parabench"
    return "python -m parabench"


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


def nodes(wc):
    return _cell(wc).spec.nodes
