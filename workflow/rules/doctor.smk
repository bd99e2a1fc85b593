# The preflight (parabench.preflight.doctor): before the first job, whether this environment can
# run this config, one line per check. A local run checks everything here, where its
# cells run; a Slurm run checks the planning host (torch build, compiler, account and
# partition, disk) and leaves the GPU checks to the GPU node, where
#   snakemake --profile profiles/slurm doctor
# runs all of them in a short job asking for the GPUs of the largest cell. The checks
# before the first job are common.smk's preflight(), which the Snakefile's onstart
# calls (under --no-hooks, the run itself: run_held): not on a dry run, so
# `snakemake -n` plans any config on any host.
import json

from parabench.preflight import doctor


rule doctor:
    output:
        f"{RESULTS}/doctor.txt",
    log:
        f"{RESULTS}/logs/doctor.log",
    conda:
        "../envs/parabench.yaml"
    resources:
        gpu=0 if config["device"] == "cpu" else max(1, doctor.gpus_per_node(config)),
        runtime=RUNTIME["doctor"],
    params:
        config=json.dumps(config, sort_keys=True),
    shell:
        "parabench doctor --config-json {params.config:q} --gpus here --out {output:q} "
        "> {log:q} 2>&1"
