# parabench: PyTorch multi-device training strategies, each at 1, 2 and 4 devices.
#   snakemake --cores 1                      small CPU run (config/config.yaml)
#   snakemake --profile profiles/slurm       on a GPU cluster (see README)
import os

from snakemake.exceptions import WorkflowError
from snakemake.utils import min_version, update_config, validate

from parabench.config import from_command_line, load_schema

# 8.25: params computed from a job's input or output (every command here: a cell's,
# the ranks', the plan's) are left out of its rerun triggers (snakemake PR #3154), so
# only what each rule names as what it measures decides a rerun, not its timeouts.
min_version("8.25")

# The jobs' Pythons (python -m parabench ...) leave the working directory off sys.path,
# so a file in the working directory never shadows a module they import (Python >= 3.11).
os.environ.setdefault("PYTHONSAFEPATH", "1")


# A user's --configfile is the whole config (the schema's defaults under it), as in
# `parabench sweep`; config/config.yaml is only the config of a run that names none.
# (A `configfile:` always read would be deep-merged under the user's: their one-model
# config would also run the default models.) --config key=value still overrides.
if not workflow.overwrite_configfiles:

    configfile: "config/config.yaml"


# --config devices=[1,2]: Snakemake reads a value's top level itself, what a list or
# mapping holds as strings ("2"); read as the same text in a config file means it.
update_config(config, from_command_line(dict(workflow.config_settings.config), load_schema()))


# Snakemake's validation (it fills the schema's defaults), its error said in one line
# naming the key: its own message prints the whole schema after that line.
try:
    validate(config, "workflow/schemas/config.schema.yaml")
except WorkflowError as e:
    from parabench.config import schema_problem

    lines = str(e).splitlines()
    why = schema_problem(config) or next((x for x in lines if "Error:" in x), lines[0])
    raise WorkflowError(f"invalid config: {why}") from None


# Timed jobs (cells, the collectives benchmark) take one `timed_cells` each, and the
# profiles give one (`resources: timed_cells: 1`), so no two are timed side by side on
# one machine whatever --cores says. Locally the scope makes no difference. On Slurm,
# "local" makes it a pool per submitted job: separate jobs run at once (each on its own
# node), and a job group stacks its cells one after another, asking for the sum of
# their runtimes (the cells of one group job run in series in any case).
resource_scopes:
    timed_cells="local",


include: "workflow/rules/common.smk"
include: "workflow/rules/doctor.smk"
include: "workflow/rules/benchmark.smk"
include: "workflow/rules/ranks.smk"
include: "workflow/rules/aggregate.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/plan.smk"
include: "workflow/rules/advise.smk"


# The run's hooks, in the main process only (not in a cluster job's parse of this file),
# and none on a dry run (Snakemake calls no hook then, nor when there is nothing to do).
# The lock first: a second writer is refused before the preflight's checks. Under
# --no-hooks, which skips the three, the run itself takes both (common.smk's run_held).
if workflow.is_main_process:
    workflow.execute = run_held(workflow.execute)


onstart:
    if workflow.is_main_process:
        take_results_lock()
        try:
            preflight()
        except BaseException:
            release_results_lock()
            raise


onsuccess:
    release_results_lock()


onerror:
    release_results_lock()


rule all:
    default_target: True
    input:
        f"{RESULTS}/summary.csv",
        f"{RESULTS}/report.html",
        f"{RESULTS}/plan.csv" if config["plan"]["enabled"] else [],
        f"{RESULTS}/advise.csv" if config["advise"]["enabled"] else [],
