# One rank of every multi-process cell, alone (parabench.ranks): what the scaling model
# predicts the cells from. One job, rank after rank, timed like a cell (never beside
# one); none when no cell runs several ranks.
RANK_CELLS = len({spec for spec, _ in alone_ranks(config)})
RANKS = RANK_CELLS > 0


rule ranks:
    output:
        ranks=f"{RESULTS}/ranks.csv",
    log:
        f"{RESULTS}/logs/ranks.log",
    conda:
        "../envs/parabench.yaml"
    resources:
        gpu=0 if config["device"] == "cpu" else 1,
        runtime=lambda wc: int(config["cell_timeout_s"] * RANK_CELLS // 60) + 5,
        timed_cells=1,
        slurm_extra=slurm_extra,
    params:
        # what Snakemake compares (its params trigger): each rank and its settings
        measures=lambda wc: measures(alone_ranks(config)),
        launch=ranks_launch,
    shell:
        "{params.launch} > {log:q} 2>&1"
