# Which layout to run on N GPUs (parabench.predict.advise): every layout that applies, one rank
# of each measured on fake tensors, its step predicted. One job, never beside a timed
# cell (when advise.gpu is this-machine it measures this host, and times a small
# model's ranks here, one at a time).
ADVISE = config["advise"]
ADVISE_CURVES = ADVISE["fabric"] == "curves"


rule advise:
    input:
        # ancient: rewritten by every aggregate; the curves' settings are in `measures`
        collectives=ancient(f"{RESULTS}/collectives.csv") if ADVISE_CURVES else [],
    output:
        advise=report(f"{RESULTS}/advise.csv", caption="../captions/advise.rst", category="Tables"),
        torchtitan=(
            report(
                f"{RESULTS}/advise-torchtitan.csv",
                caption="../captions/advise.rst",
                category="Tables",
            )
            if ADVISE["torchtitan"]
            else []
        ),
    log:
        f"{RESULTS}/logs/advise.log",
    conda:
        "../envs/parabench.yaml"
    resources:
        runtime=RUNTIME["advise"],
        timed_cells=1,
        slurm_extra=slurm_extra,
    params:
        # what advise.csv depends on: the advise settings, the advised models, the curves'
        measures=lambda wc: [*advise_measures(config), COLLECTIVES_SETTINGS],
        launch=lambda wc, input, output: shlex.join(
            advise_command(
                config,
                Path(output.advise).parent,
                input.collectives if ADVISE_CURVES else None,
            )
        ),
    shell:
        "{params.launch} > {log:q} 2>&1"
