#!/usr/bin/env bash
# One mutation-testing pass over parabench's core (issue 47): the anatomy, the
# equivalence tolerance, the statistics, advise's pricing and the GPU roofline. Not in
# CI: docs/design/mutation.md has the figures, each survivor judged, and the command.
#
#   tools/mutation.sh                                  the pass
#   tools/mutation.sh 'parabench.analyze.stats.x_verdict__*'   only these mutants (mutmut's names)
#
# Needs mutmut 3 in the venv: .venv/bin/python -m pip install 'mutmut>=3.8,<4'.
# mutmut names a mutant by its file's path less a leading src/, and the tests import
# `parabench`, which lives under workflow/: so the pass runs in a staged copy with the
# package under src/ (MUTATION_DIR, rebuilt every time). Its tests are the fast ones that
# exercise these modules in process (-m "not slow": no torchrun cell, no sweep), run by
# one child at low priority: mutmut's tests on a shared machine.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$repo/.venv/bin/python}
stage=${MUTATION_DIR:-${TMPDIR:-/tmp}/parabench-mutation}

# The functions mutated. predict/advise.py and hardware/gpus.py only where they price a step: the
# search, the table and the CLI around them are not the pass's subject.
targets=(
    'parabench.analyze.anatomy.*'
    'parabench.analyze.equivalence.*'
    'parabench.analyze.stats.*'
    'parabench.predict.advise.x_predict__*'
    'parabench.predict.advise.x__timed_phases__*'
    'parabench.predict.advise.x_binding__*'
    'parabench.predict.advise.x_held__*'
    'parabench.predict.advise.x__held_points__*'
    'parabench.predict.advise.x_rank0_order__*'
    'parabench.predict.advise.x_interleaved_refusal__*'
    'parabench.predict.advise.x_stage_blocks__*'
    'parabench.predict.advise.x__largest_fit__*'
    'parabench.hardware.gpus.xǁGPUǁop_time__*'
    'parabench.hardware.gpus.x_usable__*'
    'parabench.hardware.gpus.x_fits__*'
)
tests=(
    -m 'not slow'
    tests/test_anatomy.py
    tests/test_gpu_trace.py
    tests/test_statistics.py
    tests/test_fingerprint.py
    tests/test_equivalence.py
    # test_advise.py's other tests build models on fake tensors for minutes
    tests/test_advise.py::test_a_step_is_priced_from_its_ranks_work_and_the_fabric
    tests/test_advise.py::test_ranks_sharing_cores_compute_in_turn
    tests/test_advise.py::test_a_rank_timed_on_this_host_takes_the_rooflines_place
    tests/test_advise.py::test_a_pipelines_step_adds_its_fill_and_drain
    tests/test_advise.py::test_a_pipelines_transfers_are_priced_on_the_link_between_its_stages
    tests/test_advise.py::test_a_peak_of_exactly_the_usable_memory_fits
    tests/test_advise.py::test_a_pipelines_first_stage_holds_the_schedules_micro_batches
    tests/test_advise.py::test_a_pipelines_fsdp_stage_holds_its_gradients_whole_over_its_micro_batches
    tests/test_advise.py::test_interleaved_1f1b_holds_one_stages_gradients_at_its_peak_where_torch_reduces_them
    tests/test_advise.py::test_interleaved_1f1b_is_searched_only_where_torch_runs_it_and_its_bubble_is_priced
    tests/test_advise.py::test_the_binding_term_is_the_larger_of_a_tenth_of_the_step
    tests/test_advise.py::test_the_largest_fit_is_found_by_bisection
    tests/test_advise.py::test_an_op_costs_its_roofline_bound_and_at_least_the_floor
    tests/test_plan.py::test_plan_keeps_advises_headroom_free_of_the_device
)

rm -rf "$stage"
mkdir -p "$stage/src"
cp -r "$repo/workflow/parabench" "$repo/workflow/schemas" "$stage/src/"
cp -r "$repo/tests" "$stage/"
{
    cat "$repo/pyproject.toml"
    echo
    echo '[tool.mutmut]'
    echo 'source_paths = ["src/parabench"]'
    echo 'also_copy = ["src/schemas"]'
    echo 'only_mutate = ["src/parabench/analyze/anatomy.py", "src/parabench/analyze/equivalence.py",'
    echo '    "src/parabench/analyze/stats.py", "src/parabench/predict/advise.py",'
    echo '    "src/parabench/hardware/gpus.py"]'
    printf 'pytest_add_cli_args_test_selection = ['
    printf '"%s", ' "${tests[@]}"
    echo ']'
} >"$stage/pyproject.toml"

cd "$stage"
# mutmut's own sys.path puts the mutated package first; the venv's editable install
# stays behind it, and PYTHONPATH, which would come before, is cleared. No warm process
# (conftest starts one per test session, and mutmut runs a session per mutant): these
# tests launch nothing. One OpenMP thread: mutmut forks each mutant's tests from a
# process that ran torch, and a fork's first parallel region waits forever on the
# parent's OpenMP pool (test_fingerprint's aggregate did, until the timeout).
if [ $# -eq 0 ]; then set -- "${targets[@]}"; fi
env -u PYTHONPATH PARABENCH_WARM=0 OMP_NUM_THREADS=1 PATH="$(dirname "$python"):$PATH" \
    nice -n 19 "$python" -m mutmut run --max-children 1 "$@"
env -u PYTHONPATH "$python" -m mutmut results --all true >"$stage/results.txt"
echo "every mutant's status: $stage/results.txt (mutmut show NAME there, for its diff)"
