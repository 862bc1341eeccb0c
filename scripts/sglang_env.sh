#!/usr/bin/env bash
# Create (or reuse) the virtualenv in which SGLang's real HTTP app and its real Qwen2 model run on
# CPU for the integration tests (tests/integration/test_sglang*.py), and print its python on the
# last line of stdout.
#
# No SGLang server runs on CPU-only machines (its CPU kernels need AVX512/AMX), but its FastAPI
# app, weight-update managers and models import and run in-process with: the torch build SGLang
# pins (2.14.1, CUDA build, from the local wheel folder; CUDA is never initialised), sglang and
# sglang-kernel without their GPU dependencies (--no-deps), the stock checkpoint-engine worker
# SGLang embeds (0.4.2), and SGLang's pure-Python dependencies. ~4 GB, a few minutes.
#
# Environment: CKPT_SGLANG_BASE_PYTHON (python used to create the venv, default python3),
#              CKPT_SGLANG_VENV (override the venv path), CKPT_CACHE_DIR (default ~/.cache/ckpt-engine).
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
BASE_PY=${CKPT_SGLANG_BASE_PYTHON:-python3}
TORCH=("torch==2.14.1" "torchvision==0.29.1")
NO_DEPS=("sglang==0.5.23" "sglang-kernel==0.4.10" "checkpoint-engine==0.4.2")
# What `import sglang.srt.entrypoints.http_server, sglang.srt.models.qwen2` needs (pins: sglang's own).
PURE=(
    "transformers==5.19.0" "tokenizers==0.23.2" "apache-tvm-ffi==0.1.11" "sentencepiece==0.2.1"
    "compressed-tensors==0.18.0" "openai==2.8.0" "xgrammar==0.2.7" "soundfile==0.13.1" "uvicorn>=0.51"
    fastapi pydantic orjson msgspec pyzmq httpx requests aiohttp psutil packaging pybase64 python-multipart
    uvloop setproctitle safetensors einops loguru prometheus-client tqdm regex pillow partial_json_parser
    xxhash ipython dill gguf jsonschema numpy pytest pytest-timeout
)

pyver=$("$BASE_PY" -c 'import sys; print(sys.version.split()[0], sys.implementation.cache_tag)')
key=$(ckpt_cache_key "${TORCH[@]}" "${NO_DEPS[@]}" "${PURE[@]}" "python: $pyver")
VENV=${CKPT_SGLANG_VENV:-$CKPT_CACHE/sglang-$key}

install_sglang() {
    local py=$1 log=$CKPT_INSTALL_LOG
    ckpt_log "installing SGLang for CPU tests into $VENV (a few minutes, ~4 GB; installer output: $log)"
    ckpt_quiet "$log" "$py" -m pip install --upgrade pip || return 1
    ckpt_log "  torch ${TORCH[*]}"
    ckpt_quiet "$log" "$py" -m pip install "${TORCH[@]}" || return 1
    ckpt_log "  ${NO_DEPS[*]} (--no-deps)"
    ckpt_quiet "$log" "$py" -m pip install --no-deps "${NO_DEPS[@]}" || return 1
    ckpt_log "  SGLang's pure-Python dependencies (${#PURE[@]} requirements)"
    ckpt_quiet "$log" "$py" -m pip install "${PURE[@]}" "${TORCH[@]}" || return 1   # torch again: nothing may move it
    # Fail here, not in the first test, if SGLang's app and model cannot be imported. The pip
    # resolver's complaints about sglang's undeclared GPU dependencies (installed --no-deps on
    # purpose) stay in the log; only this import decides.
    ckpt_log "  checking that SGLang's app and Qwen2 model import"
    ckpt_quiet "$log" "$py" -c 'import sys, types
ops = types.ModuleType("vllm._custom_ops"); sys.modules["vllm._custom_ops"] = ops
import torch, checkpoint_engine.worker, sglang.srt.entrypoints.http_server, sglang.srt.models.qwen2
print("sglang ok, torch", torch.__version__)'
}

ckpt_cached_venv "$VENV" "$BASE_PY" 1800 install_sglang
echo "$VENV/bin/python"
