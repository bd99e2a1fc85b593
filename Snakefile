# parabench: PyTorch multi-device training strategies, each at 1, 2 and 4 devices.
#   snakemake --cores 1                      small CPU run (config/config.yaml)
#   snakemake --profile profiles/slurm       on a GPU cluster (see README)
from snakemake.exceptions import WorkflowError
from snakemake.utils import min_version, validate

min_version("8.20")


# A user's --configfile is the whole config (the schema's defaults under it), as in
# `parabench sweep`; config/config.yaml is only the config of a run that names none.
# (A `configfile:` always read would be deep-merged under the user's: their one-model
# config would also run the default models.) --config key=value still overrides.
if not workflow.overwrite_configfiles:

    configfile: "config/config.yaml"


# Snakemake's validation (it fills the schema's defaults), its error said in one line
# naming the key: its own message prints the whole schema after that line.
try:
    validate(config, "workflow/schemas/config.schema.yaml")
except WorkflowError:
    from parabench.config import schema_problem

    raise WorkflowError(f"invalid config: {schema_problem(config)}") from None


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


rule all:
    default_target: True
    input:
        f"{RESULTS}/summary.csv",
        f"{RESULTS}/report.html",
        f"{RESULTS}/plan.csv" if config["plan"]["enabled"] else [],
