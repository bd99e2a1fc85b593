# One rank of every multi-process cell, alone (parabench.predict.rank_alone): what the scaling model
# predicts the cells from. Rank after rank, timed like a cell (never beside one), each
# rank within rank_timeout_s; none when no cell runs several ranks. One job (one process
# for them all, as a local run always has) while their limits fit in max_job_minutes;
# past that, parts that each fit (config.rank_parts), on Slurm side by side, merged
# into ranks.csv here.
RANKS = bool(alone_ranks(config))
RANK_PARTS = rank_parts(config)

if RANK_PARTS == 1:

    rule ranks:
        output:
            ranks=f"{RESULTS}/ranks.csv",
        log:
            f"{RESULTS}/logs/ranks.log",
        conda:
            "../envs/parabench.yaml"
        resources:
            gpu=0 if config["device"] == "cpu" else 1,
            runtime=RUNTIME["ranks"],
            timed_cells=1,
            slurm_extra=slurm_extra,
        params:
            # what Snakemake compares (its params trigger): each rank and its settings
            measures=lambda wc: measures(ranks_of(config)),
            launch=ranks_launch,
        shell:
            "{params.launch} > {log:q} 2>&1"

else:

    rule ranks_part:
        output:
            ranks=f"{RESULTS}/ranks/part{{part}}of{RANK_PARTS}/ranks.csv",
        log:
            f"{RESULTS}/logs/ranks/part{{part}}of{RANK_PARTS}.log",
        wildcard_constraints:
            part=r"[1-9][0-9]*",
        conda:
            "../envs/parabench.yaml"
        resources:
            gpu=0 if config["device"] == "cpu" else 1,
            runtime=RUNTIME["ranks"],
            timed_cells=1,
            slurm_extra=slurm_extra,
        params:
            measures=lambda wc: measures(ranks_of(config, rank_part(wc))),
            launch=ranks_launch,
        shell:
            "{params.launch} > {log:q} 2>&1"

    rule ranks:
        input:
            parts=[
                f"{RESULTS}/ranks/part{i}of{RANK_PARTS}/ranks.csv"
                for i in range(1, RANK_PARTS + 1)
            ],
        output:
            ranks=f"{RESULTS}/ranks.csv",
        log:
            f"{RESULTS}/logs/ranks.log",
        run:
            Path(log[0]).write_text(concat_rows(input.parts, Path(output.ranks), RANK_COLUMNS))

    localrules:
        ranks,
