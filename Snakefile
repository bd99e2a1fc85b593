# parabench: PyTorch multi-device training strategies, each at 1, 2 and 4 devices.
#   snakemake --cores 1                      small CPU run (config/config.yaml)
#   snakemake --profile profiles/slurm       on a GPU cluster (see README)
from snakemake.utils import min_version, validate

min_version("8.20")


configfile: "config/config.yaml"


validate(config, "workflow/schemas/config.schema.yaml")


# Cells packed into one Slurm allocation (job groups, see profiles/slurm) must run one
# after another, never side by side, or they would time each other. With
# `--resources timed_cells=1` and this scope, each group job gets its own pool of one:
# Snakemake stacks the group's cells in series and asks for the largest cell's GPUs and
# the sum of their runtimes, while the sweep as a whole stays unlimited.
resource_scopes:
    timed_cells="local",


include: "workflow/rules/common.smk"
include: "workflow/rules/benchmark.smk"
include: "workflow/rules/aggregate.smk"
include: "workflow/rules/report.smk"


rule all:
    default_target: True
    input:
        f"{RESULTS}/summary.csv",
        f"{RESULTS}/report.html",
