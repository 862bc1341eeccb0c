#!/usr/bin/env bash
# Create (or reuse) the virtualenv in which TRL's real AsyncGRPOTrainer drives ckpt-engine for the
# integration tests (tests/integration/test_trl_*.py), and print its python on the last line of stdout.
#
# Built on top of the vLLM venv (scripts/vllm_env.sh): a .pth file puts that venv's site-packages
# on this venv's path, so torch, vLLM and transformers are the vLLM venv's own (no second 2.5 GB
# copy), and only TRL and what it adds (accelerate, datasets, pandas, pyarrow, ...) are installed
# here, constrained to the versions the vLLM venv already has. Rebuilt when the requirement list,
# the vLLM venv or the python version changes.
#
# Environment: CKPT_TRL_VENV (override the venv path), CKPT_CACHE_DIR (default ~/.cache/ckpt-engine).
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
REQS=("trl==1.16.0")
VLLM_PY=$(bash "$(dirname "${BASH_SOURCE[0]}")/vllm_env.sh" | tail -n1)
VLLM_SITE=$("$VLLM_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# The vLLM venv's base interpreter: the .pth only works for the same python version.
BASE_PY=$("$VLLM_PY" -c 'import sys; print(sys._base_executable)')

pyver=$("$BASE_PY" -c 'import sys; print(sys.version.split()[0], sys.implementation.cache_tag)')
key=$(ckpt_cache_key "${REQS[@]}" "vllm venv: $VLLM_SITE" "python: $pyver")
VENV=${CKPT_TRL_VENV:-$CKPT_CACHE/trl-$key}

install_trl() {
    local py=$1 log=$CKPT_INSTALL_LOG site constraints
    site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$VLLM_SITE" >"$site/ckpt-vllm-venv.pth"
    ckpt_log "installing ${REQS[*]} into $VENV on top of the vLLM venv (a minute; installer output: $log)"
    constraints=$VENV/constraints.txt
    # What the vLLM venv has stays as it is: torch, transformers, numpy... may not move.
    "$VLLM_PY" -m pip freeze --exclude-editable 2>>"$log" | grep -v '^-e ' >"$constraints" || return 1
    ckpt_quiet "$log" "$py" -m pip install -c "$constraints" "${REQS[@]}" || return 1
    ckpt_quiet "$log" "$py" -c 'import torch, vllm, trl, accelerate, datasets
from trl.experimental.async_grpo import AsyncGRPOTrainer, AsyncGRPOConfig
print("trl", trl.__version__, "vllm", vllm.__version__, "torch", torch.__version__)'
}

ckpt_cached_venv "$VENV" "$BASE_PY" 1800 install_trl
echo "$VENV/bin/python"
