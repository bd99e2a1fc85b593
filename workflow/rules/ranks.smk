# One rank of every multi-process cell, alone (parabench.ranks): what the scaling model
# predicts the cells from. One job, rank after rank, timed like a cell (never beside
# one); none when no cell runs several ranks.
import json

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
        config=json.dumps(config, sort_keys=True),
        out=lambda wc, output: Path(output.ranks).parent,
    shell:
        "parabench ranks --config-json {params.config:q} --out {params.out:q} > {log:q} 2>&1"
