"""parabench: a reproducible benchmark of PyTorch multi-device training strategies.

The package runs one benchmark cell per call (``parabench run``), merges cells
(``parabench aggregate``) and renders the report (``parabench report``). It never
imports Snakemake: the workflow only calls this command line.
"""

__version__ = "0.1.0"
