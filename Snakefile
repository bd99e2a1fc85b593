# parabench: PyTorch multi-device training strategies, each at 1, 2 and 4 devices.
#   snakemake --cores 1                      small CPU run (config/config.yaml)
#   snakemake --profile profiles/slurm       on a GPU cluster (see README)
from snakemake.utils import min_version, validate

min_version("8.20")


configfile: "config/config.yaml"


validate(config, "workflow/schemas/config.schema.yaml")


include: "workflow/rules/common.smk"
include: "workflow/rules/benchmark.smk"
include: "workflow/rules/aggregate.smk"
include: "workflow/rules/report.smk"


rule all:
    default_target: True
    input:
        f"{RESULTS}/summary.csv",
        f"{RESULTS}/report.html",
