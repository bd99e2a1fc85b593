"""How a run's processes start, and are guarded: every launch command, the guard that
records any outcome, warm starts, the sweep without Snakemake, the results
directory's lock."""
