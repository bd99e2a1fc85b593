# The two commands of the README. Each sets up what it needs in .venv first.
#   make run     the default pipeline (config/config.yaml: a small CPU run)
#   make test    lint + the test suite
# And CI's third: make test-torch-min, the tests of the strategies on the oldest torch
# we support, in a venv of its own.
# GPU users: install your CUDA build of torch into .venv first and run with TORCH=
# (empty), e.g.  python3 -m venv .venv && .venv/bin/pip install torch && make run TORCH=
VENV   ?= .venv
PYTHON ?= python3
# Pinned: this version is the CPU wheel on our machines. A bare `torch` pulls a
# multi-GB CUDA build.
TORCH  ?= torch==2.13.0
CORES  ?= 1
# Extra snakemake arguments, e.g. ARGS="--configfile config/gpu.yaml"
ARGS   ?=
# The tests in two workers, a test file each (its module fixtures, one sweep, stay in
# one worker): most of a test's time is processes starting and waiting on each other,
# which two files side by side overlap. Files go out in collection order, the longest
# first (tests/conftest.py: LONGEST_FIRST), not xdist's order by number of tests, which
# left a long file to run alone at the end. PYTEST_WORKERS= runs them in one process.
# make test prints its 25 slowest tests: where its 20-minute budget goes, in CI's log.
PYTEST_WORKERS ?= -n 2 --dist loadfile --no-loadscope-reorder
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.parabench-installed
# What make run installs: the workflow, and transformers (the `hf` extra: the default
# run's advise check builds Llama 3.1 shapes, torchtitan's published runs, on fake
# tensors). The tests' and lint's tools (`dev`) and Holistic Trace Analysis (`trace`),
# which the run does not need, come with make test and make lint only.
DEV_STAMP := $(VENV)/.parabench-dev-installed
# Holistic Trace Analysis, for tests/test_gpu_trace.py: without the dependencies its
# metadata declares (jupyterlab), with those it imports (pyproject's `trace` extra).
HTA := HolisticTraceAnalysis==0.5.0
# Byte-compiled on every core (compileall -j 0) rather than by pip, one file at a time:
# half the time on two. Compiled it must be: where PYTHONDONTWRITEBYTECODE is set, as
# on our machines, nothing imported later is cached, and every process compiles torch
# again (import torch 5.6 s instead of 3.6 s). A file that does not compile (torch ships
# one in Python 3.12's syntax) is left to import time, as pip leaves it.
PIP_INSTALL := -m pip install -q --no-compile
COMPILE = $(1)/bin/python -m compileall -q -j 0 \
	$$($(1)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
	> /dev/null || true

# The GPU check runs with whatever python has a CUDA torch: the venv's if there is one,
# else python3 (a GPU image with torch, pandas, seaborn, jinja2, pyyaml and jsonschema needs
# no Snakemake).
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)

# The oldest torch we support: pyproject's `torch>=` and doctor.TORCH_MIN name its
# release (a test holds the three together; README, GPU users, says why not older).
# PyPI has it only as a CUDA build (7.5 GB installed with its nvidia-* libraries), which
# runs on the CPU; in a venv of its own, so .venv keeps TORCH. The tests that run the
# strategies and layouts through torch's distributed APIs, where releases differ
# (pipelining, DTensor, FSDP2, and advise's fake ranks over them and torch's FLOP
# formulas), not the whole suite: make test runs that on TORCH.
TORCH_MIN      ?= torch==2.10.0
MIN_VENV       ?= .venv-torch-min
MIN_STAMP      := $(MIN_VENV)/.parabench-installed
TORCH_MIN_TESTS := tests/test_equivalence.py tests/test_layouts.py tests/test_cuda_paths.py \
	tests/test_cli_cells.py tests/test_models.py tests/test_hf.py tests/test_advise.py

.PHONY: run test test-torch-min lint bench gpu-check mutation clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(if $(TORCH),$(BIN)/python $(PIP_INSTALL) "$(TORCH)")
	$(BIN)/python $(PIP_INSTALL) -e ".[workflow,hf]"
	$(call COMPILE,$(VENV))
	touch $@

# TORCH_MIN named again: installing the package must not replace that torch.
$(MIN_STAMP): pyproject.toml
	test -x $(MIN_VENV)/bin/python || $(PYTHON) -m venv $(MIN_VENV)
	$(MIN_VENV)/bin/python $(PIP_INSTALL) "$(TORCH_MIN)"
	$(MIN_VENV)/bin/python $(PIP_INSTALL) -e ".[workflow,dev,hf]" "$(TORCH_MIN)"
	$(call COMPILE,$(MIN_VENV))
	touch $@

$(DEV_STAMP): $(STAMP)
	$(BIN)/python $(PIP_INSTALL) -e ".[workflow,hf,dev,trace]"
	$(BIN)/python $(PIP_INSTALL) --no-deps $(HTA)
	$(call COMPILE,$(VENV))
	touch $@

run: $(STAMP)
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/snakemake --cores $(CORES) $(ARGS)
	@echo "report: results/report.html"

lint: $(DEV_STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/ruff format --check .
	$(BIN)/snakefmt --check Snakefile workflow/rules/
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/snakemake --lint

test: $(DEV_STAMP) lint
	tests/setup-system.sh
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest -q -ra --durations=25 $(PYTEST_WORKERS)

test-torch-min: $(MIN_STAMP)
	PATH="$(abspath $(MIN_VENV)/bin):$$PATH" $(MIN_VENV)/bin/python -m pytest -q -ra \
	  $(PYTEST_WORKERS) $(TORCH_MIN_TESTS)

bench: $(STAMP)
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python benchmarks/single_overhead.py
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python benchmarks/pipeline_wall.py
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python benchmarks/sharded_overhead.py
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python benchmarks/collectives_overhead.py
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python benchmarks/launch_overhead.py
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python benchmarks/timed_turns.py

# One mutation-testing pass over the core (issue 47; not in CI): docs/design/mutation.md.
# ARGS: mutmut's names of some mutants to run again, e.g. ARGS='parabench.analyze.stats.x_verdict__*'
mutation: $(DEV_STAMP)
	$(BIN)/python -m pip install -q "mutmut>=3.8,<4"
	PYTHON="$(abspath $(BIN))/python" tools/mutation.sh $(ARGS)

gpu-check:
	PYTHONPATH="$(abspath workflow):$$PYTHONPATH" $(GPU_PYTHON) -m parabench sweep \
	  config/gpu-check.yaml --devices auto $(ARGS)
	@echo "report: results/gpu-check/report.html"

clean:
	rm -rf results logs .snakemake
