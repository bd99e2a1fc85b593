# One job per cell: (model, strategy, devices, repeat). Repeats are separate launches so
# launch-to-launch variance shows. `parabench launch` starts the cell's processes and
# records a failure if they leave no record (crash, kill, timeout), so one bad cell
# never stops the sweep; the log starts with the exact command and ends with the
# launch's wall time. No `benchmark:` directive: it samples
# the job's processes (psutil, /proc/<pid>/smaps) twice a second for its first 30 s,
# which is while the steps are timed, and took the cores from the ranks it measured.


rule benchmark:
    output:
        meta=f"{RESULTS}/{CELL_DIR}/meta.json",
        steps=f"{RESULTS}/{CELL_DIR}/steps.csv",
    log:
        f"{RESULTS}/logs/{CELL_DIR}.log",
    wildcard_constraints:
        **WILDCARDS,
    conda:
        "../envs/parabench.yaml"
    threads: lambda wc: max(1, int(wc.devices))
    resources:
        gpu=gpus,
        runtime=RUNTIME["benchmark"],
        # One timed job at a time (see resource_scopes in the Snakefile).
        timed_cells=1,
        slurm_extra=slurm_extra,
    params:
        # What Snakemake compares (its params trigger): the cell's settings hash, the
        # one its record carries, so a changed steps or lr reruns the cell (as the sweep
        # does) and a changed cell_timeout_s does not. The command is a function of the
        # output, never compared.
        measures=lambda wc: _spec(wc).config_hash(),
        launch=launch,
    shell:
        "{params.launch} > {log:q} 2>&1"


# What the interconnect carries at n ranks (see parabench.run.collectives), for the
# scaling model: one job per multi-rank device count.
rule collectives:
    output:
        meta=f"{RESULTS}/collectives/n{{devices}}/meta.json",
    log:
        f"{RESULTS}/logs/collectives/n{{devices}}.log",
    wildcard_constraints:
        devices=r"[1-9][0-9]*",
    conda:
        "../envs/parabench.yaml"
    threads: lambda wc: int(wc.devices)
    resources:
        gpu=lambda wc: 0 if config["device"] == "cpu" else int(wc.devices),
        runtime=RUNTIME["collectives"],
        # timed like a cell: never beside one (see resource_scopes in the Snakefile)
        timed_cells=1,
        slurm_extra=slurm_extra,
    params:
        # What Snakemake compares (its params trigger): the command is a function of the
        # output, left out, so a changed cell_timeout_s reruns nothing.
        settings=COLLECTIVES_SETTINGS,
        launch=collectives_launch,
    shell:
        "{params.launch} > {log:q} 2>&1"


# A cell needing more GPUs than one node has: the same command, which starts one srun
# task per node, each a torchrun agent (launch.multinode_argv). Its own rule for its
# resources: `mpi` tells the Slurm plugin not to wrap the command in its own srun; GPUs
# are asked per node (--gpus is a total, and slurm_extra refuses --gres).
ruleorder: benchmark_multinode > benchmark


rule benchmark_multinode:
    output:
        meta=f"{RESULTS}/{CELL_DIR}/meta.json",
        steps=f"{RESULTS}/{CELL_DIR}/steps.csv",
    log:
        f"{RESULTS}/logs/{CELL_DIR}.log",
    wildcard_constraints:
        **{**WILDCARDS, "strategy": MULTINODE_STRATEGIES_RE, "devices": MULTINODE_DEVICES_RE},
    conda:
        "../envs/parabench.yaml"
    threads: lambda wc: min(int(wc.devices), config["gpus_per_node"])
    resources:
        mpi="srun",
        nodes=nodes,
        tasks=nodes,
        slurm_extra=lambda wc: f"--gpus-per-node={int(wc.devices) // nodes(wc)} {slurm_extra(wc)}",
        runtime=RUNTIME["benchmark"],
        timed_cells=1,
    params:
        measures=lambda wc: _spec(wc).config_hash(),  # as rule benchmark's
        launch=launch,
    shell:
        "{params.launch} > {log:q} 2>&1"
