# The preflight (parabench.doctor): before the first job, whether this environment can
# run this config, one line per check. A local run checks everything here, where its
# cells run; a Slurm run checks the planning host (torch build, compiler, account and
# partition, disk) and leaves the GPU checks to the GPU node, where
#   snakemake --profile profiles/slurm doctor
# runs all of them in a short job asking for the GPUs of the largest cell. Not on a dry
# run (onstart is skipped), so `snakemake -n` plans any config on any host.
import json

from parabench import doctor


onstart:
    if workflow.is_main_process:
        _slurm = None
        if workflow.executor_plugin is not None and not workflow.local_exec:
            _slurm = doctor.resources(workflow.resource_settings.default_resources.args or [])
        _found = doctor.run_checks(config, Path.cwd(), _slurm, gpus=workflow.local_exec)
        for _check in _found:
            logger.info(f"parabench doctor: {_check.line()}")
        if doctor.failed(_found):
            raise WorkflowError(
                "parabench doctor: this environment cannot run this config (the FAIL lines "
                "above); nothing was started"
            )


rule doctor:
    output:
        f"{RESULTS}/doctor.txt",
    log:
        f"{RESULTS}/logs/doctor.log",
    conda:
        "../envs/parabench.yaml"
    resources:
        gpu=0 if config["device"] == "cpu" else max(1, doctor.gpus_per_node(config)),
        runtime=5,
    params:
        config=json.dumps(config, sort_keys=True),
    shell:
        "parabench doctor --config-json {params.config:q} --gpus here --out {output:q} "
        "> {log:q} 2>&1"
