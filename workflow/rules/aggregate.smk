# Merge every configured cell's records with pandas. Reads only the cells of this config,
# so stale directories from an older config never leak into the tables.


rule aggregate:
    input:
        meta=[f"{cell_dir(path)}/meta.json" for path in CELLS],
        steps=[f"{cell_dir(path)}/steps.csv" for path in CELLS],
        collectives=[f"{RESULTS}/collectives/n{n}/meta.json" for n in COLLECTIVE_DEVICES],
        ranks=f"{RESULTS}/ranks.csv" if RANKS else [],
    output:
        steps=f"{RESULTS}/steps.csv",
        collectives=report(
            f"{RESULTS}/collectives.csv", caption="../captions/collectives.rst", category="Tables"
        ),
        cells=f"{RESULTS}/cells.csv",
        summary=report(
            f"{RESULTS}/summary.csv", caption="../captions/summary.rst", category="Tables"
        ),
    log:
        f"{RESULTS}/logs/aggregate.log",
    conda:
        "../envs/parabench.yaml"
    params:
        ranks=lambda wc, input: f"--ranks {shlex.quote(input.ranks)}" if RANKS else "",
        # per cell, in input.meta's order: a record of other settings is refused
        hashes=[cell.spec.config_hash() for cell in CELLS.values()],
    # through parabench.jobs.warm: aggregate imports torch (the parameter files), so it is
    # forked from the run's warm process where there is one
    shell:
        "python -m parabench.jobs.warm python -m parabench aggregate "
        "--meta {input.meta:q} --steps-out {output.steps:q} "
        "--cells-out {output.cells:q} --summary-out {output.summary:q} "
        "--collectives {input.collectives:q} --collectives-out {output.collectives:q} "
        "--config-hashes {params.hashes} {params.ranks} > {log:q} 2>&1"
