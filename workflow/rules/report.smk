# The shareable report: one self-contained HTML file (plots inline, no network). Its
# plots also go to plots/ as PNGs, and the report, plots and tables are Snakemake report
# items: `snakemake --report report.zip` packs them with their captions.
import json


rule report:
    input:
        summary=f"{RESULTS}/summary.csv",
        cells=f"{RESULTS}/cells.csv",
        steps=f"{RESULTS}/steps.csv",
        collectives=f"{RESULTS}/collectives.csv",
        plan=f"{RESULTS}/plan.csv" if config["plan"]["enabled"] else [],
        advise=f"{RESULTS}/advise.csv" if config["advise"]["enabled"] else [],
        torchtitan=(
            f"{RESULTS}/advise-torchtitan.csv"
            if config["advise"]["enabled"] and config["advise"]["torchtitan"]
            else []
        ),
        templates=sorted(str(p) for p in (REPO / "report").rglob("*") if p.is_file()),
    output:
        html=report(
            f"{RESULTS}/report.html",
            caption="../captions/report.rst",
            category="Report",
        ),
        plots=report(
            directory(f"{RESULTS}/plots"),
            patterns=["{name}.png"],
            caption="../captions/plots.rst",
            category="Plots",
        ),
    log:
        f"{RESULTS}/logs/report.log",
    conda:
        "../envs/parabench.yaml"
    params:
        config=json.dumps(config, sort_keys=True),
        results=lambda wc, input: Path(input.summary).parent,
        templates=REPO / "report",
    shell:
        "parabench report --results {params.results:q} --templates {params.templates:q} "
        "--config-json {params.config:q} --out {output.html:q} "
        "--plots-dir {output.plots:q} > {log:q} 2>&1"


localrules:
    aggregate,
    report,
