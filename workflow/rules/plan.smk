# What each strategy would cost at world sizes beyond this machine (parabench.plan): one
# job, rank after rank, timed like a cell (never beside one). Predicted on the fabric
# plan.fabric names; `curves` reads this sweep's collectives benchmark.
import json

PLAN = config["plan"]
PLAN_CURVES = PLAN["fabric"] == "curves"


rule plan:
    input:
        collectives=f"{RESULTS}/collectives.csv" if PLAN_CURVES else [],
    output:
        plan=report(f"{RESULTS}/plan.csv", caption="../report/plan.rst", category="Tables"),
    log:
        f"{RESULTS}/logs/plan.log",
    conda:
        "../envs/parabench.yaml"
    resources:
        gpu=0 if config["device"] == "cpu" else 1,
        runtime=lambda wc: int(config["cell_timeout_s"] // 60) + 5,
        timed_cells=1,
        slurm_extra=slurm_extra,
    params:
        config=json.dumps(config, sort_keys=True),
        curves=lambda wc, input: f"--collectives {input.collectives}" if PLAN_CURVES else "",
        out=lambda wc, output: Path(output.plan).parent,
    shell:
        "parabench plan --config-json {params.config:q} {params.curves} "
        "--out {params.out:q} > {log:q} 2>&1"
