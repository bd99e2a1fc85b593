# The shareable report: one self-contained HTML file (plots inline, no network).
import json


rule report:
    input:
        summary=f"{RESULTS}/summary.csv",
        cells=f"{RESULTS}/cells.csv",
        steps=f"{RESULTS}/steps.csv",
        collectives=f"{RESULTS}/collectives.csv",
        templates=sorted(str(p) for p in (REPO / "report").rglob("*") if p.is_file()),
    output:
        f"{RESULTS}/report.html",
    conda:
        "../envs/parabench.yaml"
    log:
        f"{RESULTS}/logs/report.log",
    params:
        config=json.dumps(config, sort_keys=True),
        results=lambda wc, input: Path(input.summary).parent,
        templates=REPO / "report",
    shell:
        "parabench report --results {params.results:q} --templates {params.templates:q} "
        "--config-json {params.config:q} --out {output:q} > {log:q} 2>&1"


localrules:
    aggregate,
    report,
