#!/usr/bin/env bash
# Create (or reuse) the virtualenv in which verl's checkpoint-engine seam runs for the integration
# tests (tests/integration/test_verl_backend.py), and print its python on the last line of stdout.
#
# verl's own code, pinned: `verl.checkpoint_engine` (CheckpointEngine, CheckpointEngineRegistry,
# CheckpointEngineWorker) and `verl.utils.import_utils` (what loads `custom_backend_module`).
# verl declares a training stack (wandb, datasets, peft, flash-attn, vLLM ...) that those modules
# never import, so verl goes in with --no-deps and beside it only what `import
# verl.checkpoint_engine` imports (ray, tensordict, omegaconf, transformers, fastapi/uvicorn,
# pyzmq), plus what ckpt-engine's P2P path needs (Mooncake's CPU build). CPU torch 2.13.0 comes
# from the local wheel folder. ~1.5 GB, a few minutes.
#
# Environment: CKPT_VERL_BASE_PYTHON (python used to create the venv, default python3),
#              CKPT_VERL_VENV (override the venv path), CKPT_CACHE_DIR (default ~/.cache/ckpt-engine).
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
BASE_PY=${CKPT_VERL_BASE_PYTHON:-python3}
# verl 0.9.1: the newest release whose base.py has CheckpointEngine (prepare, build_topology,
# init_process_group, send_weights(weights, global_steps), receive_weights(global_steps), finalize)
# and loads custom_backend_module; tensordict's own pins drag in nothing we need.
NO_DEPS=("verl==0.9.1" "tensordict==0.10.0")
DEPS=(
    "torch==2.13.0" "ray==2.60.0" "transformers==5.10.4" "omegaconf==2.4.0" "pyvers==0.1.0" "codetiming"
    importlib_metadata cloudpickle orjson fastapi uvicorn pyzmq httpx numpy packaging safetensors
    "mooncake-transfer-engine-non-cuda==0.3.13.post1"
)

pyver=$("$BASE_PY" -c 'import sys; print(sys.version.split()[0], sys.implementation.cache_tag)')
key=$(ckpt_cache_key "${NO_DEPS[@]}" "${DEPS[@]}" "python: $pyver")
VENV=${CKPT_VERL_VENV:-$CKPT_CACHE/verl-$key}

install_verl() {
    local py=$1 log=$CKPT_INSTALL_LOG
    ckpt_log "installing verl for CPU tests into $VENV (a few minutes, ~1.5 GB; installer output: $log)"
    ckpt_quiet "$log" "$py" -m pip install --upgrade pip || return 1
    ckpt_log "  ${#DEPS[@]} requirements (torch from the local wheel folder)"
    ckpt_quiet "$log" "$py" -m pip install "${DEPS[@]}" || return 1
    ckpt_log "  ${NO_DEPS[*]} (--no-deps)"
    ckpt_quiet "$log" "$py" -m pip install --no-deps "${NO_DEPS[@]}" || return 1
    # Fail here, not in the first test. pip's complaints about verl's undeclared-here training
    # stack (installed --no-deps on purpose) stay in the log; only this import decides.
    ckpt_log "  checking that verl's checkpoint-engine seam imports"
    ckpt_quiet "$log" "$py" -c 'import torch, zmq, transformers, mooncake.engine
from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry, CheckpointEngineWorker
from verl.utils.import_utils import import_external_libs
import verl; print("verl", verl.__version__, "torch", torch.__version__)'
}

ckpt_cached_venv "$VENV" "$BASE_PY" 1800 install_verl
echo "$VENV/bin/python"
