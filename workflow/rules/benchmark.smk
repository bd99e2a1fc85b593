# One job per cell: (model, strategy, devices, repeat). Repeats are separate launches so
# launch-to-launch variance shows. `parabench guard` records a failure if the launch
# leaves no record (crash, kill, timeout), so one bad cell never stops the sweep.


rule benchmark:
    output:
        meta=f"{RESULTS}/runs/{{model}}/{{strategy}}/n{{devices}}/r{{repeat}}/meta.json",
        steps=f"{RESULTS}/runs/{{model}}/{{strategy}}/n{{devices}}/r{{repeat}}/steps.csv",
    conda:
        "../envs/parabench.yaml"
    log:
        "logs/runs/{model}/{strategy}/n{devices}/r{repeat}.log",
    benchmark:
        "logs/runs/{model}/{strategy}/n{devices}/r{repeat}.bench.tsv"
    wildcard_constraints:
        model=r"[A-Za-z][A-Za-z0-9_]*",
        strategy="|".join(STRATEGIES),
        devices=r"[1-9][0-9]*",
        repeat=r"[0-9]+",
    threads: lambda wc: max(1, int(wc.devices))
    resources:
        gpu=gpus,
        runtime=lambda wc: int(config["cell_timeout_s"] // 60) + 5,
    params:
        launch=launcher,
        args=run_args,
        timeout=config["cell_timeout_s"],
        out=lambda wc, output: Path(output.meta).parent,
    shell:
        "parabench guard --out {params.out:q} --timeout {params.timeout} -- "
        "{params.launch} run {params.args} --out {params.out:q} > {log:q} 2>&1"
