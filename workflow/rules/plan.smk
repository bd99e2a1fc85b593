# What each strategy would cost at world sizes beyond this machine (parabench.predict.plan): one
# job, rank after rank, timed like a cell (never beside one). Predicted on the fabric
# plan.fabric names; `curves` reads this sweep's collectives benchmark.
PLAN = config["plan"]
PLAN_CURVES = PLAN["fabric"] == "curves"


rule plan:
    input:
        # ancient: rewritten by every aggregate; what the curves hold is in `measures`
        collectives=ancient(f"{RESULTS}/collectives.csv") if PLAN_CURVES else [],
    output:
        plan=report(f"{RESULTS}/plan.csv", caption="../captions/plan.rst", category="Tables"),
    log:
        f"{RESULTS}/logs/plan.log",
    conda:
        "../envs/parabench.yaml"
    resources:
        gpu=0 if config["device"] == "cpu" else 1,
        # rank_timeout_s for each planned rank (launch.launch_plan)
        runtime=RUNTIME["plan"],
        timed_cells=1,
        slurm_extra=slurm_extra,
    params:
        measures=plan_measures,
        launch=plan_launch,
    shell:
        "{params.launch} > {log:q} 2>&1"
