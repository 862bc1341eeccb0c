# Shared by scripts/test.sh and scripts/demo.sh. Source it; do not run it.
#
# ensure_project_venv: create (or reuse) the project's virtualenv under ~/.cache, keyed by a hash
# of what it installs and the python version, and print its python on stdout. A fresh machine
# builds it (about a minute: torch comes from the local wheel folder pip is configured with);
# a warm one reuses it. The project itself is on PYTHONPATH, never installed, so edits need no
# reinstall.

CKPT_REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CKPT_CACHE=${CKPT_CACHE_DIR:-$HOME/.cache/ckpt-engine}
CKPT_PROJECT_REQS=(
    "torch==2.13.0" "pyzmq>=25" "httpx>=0.25" "safetensors>=0.4" "numpy"
    "pytest>=8" "pytest-timeout>=2" "fastapi>=0.110" "uvicorn>=0.27" "pydantic>=2"
    "prometheus-client>=0.17" "tqdm>=4.60" "schemathesis>=4,<5"
)
# Triton (CPU wheel use only: its interpreter runs the delta's CUDA kernels' source in
# tests/unit/test_delta_kernels_interpreted.py; on a GPU torch's CUDA wheels bring their own).
CKPT_PROJECT_REQS+=("triton==3.9.0")
# P2P store (issue 11): Mooncake's TransferEngine, the build that imports without CUDA. It needs
# Debian's libibverbs1 even for TCP: ensure_p2p_system_libs installs it where it is missing.
CKPT_PROJECT_REQS+=("mooncake-transfer-engine-non-cuda==0.3.13.post1")

ckpt_log() { echo "[$(basename "$0")] $*" >&2; }
# ckpt_cache_key LINE...: 12 hex digits naming a cached environment by what it installs (each line of it)
ckpt_cache_key() { printf '%s\n' "$@" | sha256sum | cut -c1-12; }

# ckpt_quiet LOG CMD...: run CMD with its output appended to LOG (installers are chatty); on
# failure say which command failed, name LOG and show its last lines.
ckpt_quiet() {
    local log=$1; shift
    if ! "$@" >>"$log" 2>&1; then
        ckpt_log "failed: $*"
        ckpt_log "full output in $log; its last lines:"
        tail -n 25 "$log" >&2
        return 1
    fi
}

# ckpt_cached_venv VENV BASE_PYTHON LOCK_WAIT_S INSTALL_FN [ALWAYS_FN]
# Create VENV with BASE_PYTHON and run INSTALL_FN VENV_PYTHON in it, once: a stamp file marks a
# finished install, and a lock keeps two callers (tests and the demo) from installing into one
# venv at the same time. ALWAYS_FN VENV_PYTHON, if given, runs on every call, under the same lock.
# Every step is checked by hand: callers run this inside $(...) or left of ||, where `set -e` is
# off, so a failed install must not reach the stamp. A failed build returns 1, says which step
# failed, and leaves no stamp (the next call rebuilds). Only a directory these scripts created
# (marker file .ckpt-venv) is ever deleted: a VENV path that holds anything else is refused.
# Both see CKPT_INSTALL_LOG (VENV.install.log), where installer output goes (see ckpt_quiet);
# one line per venv says whether it was cached or built, and how long that took.
ckpt_cached_venv() {
    local venv=$1 base=$2 wait=$3 install=$4 always=${5:-}
    mkdir -p "$(dirname "$venv")" || return 1
    (
        export CKPT_INSTALL_LOG=$venv.install.log
        local t0=$SECONDS
        exec 8>"$venv.lock"
        flock -w "$wait" 8 || { ckpt_log "timed out after $wait s waiting for $venv.lock"; exit 1; }
        if [[ ! -f $venv/.ckpt-installed ]]; then
            if [[ -e $venv && ! -f $venv/.ckpt-venv ]] && [[ -n "$(ls -A "$venv" 2>/dev/null)" || ! -d $venv ]]; then
                ckpt_log "refusing to use $venv: it exists and was not made by these scripts (no .ckpt-venv" \
                         "marker); nothing was deleted. Point the variable at a new path or remove it yourself"
                exit 1
            fi
            rm -rf "$venv"   # ours (marker) and unfinished, or an empty directory
            : >"$CKPT_INSTALL_LOG"
            ckpt_quiet "$CKPT_INSTALL_LOG" "$base" -m venv "$venv" \
                || { ckpt_log "creating the virtualenv $venv with $base failed"; exit 1; }
            date -u +%FT%TZ >"$venv/.ckpt-venv"
            if ! "$install" "$venv/bin/python"; then
                ckpt_log "installing into $venv failed (output: $CKPT_INSTALL_LOG); it is left unfinished" \
                         "and is rebuilt on the next run"
                exit 1
            fi
            date -u +%FT%TZ >"$venv/.ckpt-installed" || exit 1
            ckpt_log "$(basename "$venv"): built in $((SECONDS - t0)) s (installer output: $CKPT_INSTALL_LOG)"
        else
            ckpt_log "$(basename "$venv"): cached"
        fi
        if [[ -n $always ]]; then "$always" "$venv/bin/python" || { ckpt_log "$always failed for $venv"; exit 1; }; fi
    )
}

_install_project_reqs() {
    ckpt_log "building the project virtualenv $(dirname "$(dirname "$1")") (about a minute)"
    ckpt_quiet "$CKPT_INSTALL_LOG" "$1" -m pip install "${CKPT_PROJECT_REQS[@]}" || return 1
    ckpt_quiet "$CKPT_INSTALL_LOG" "$1" -c 'import torch, zmq, httpx, safetensors, pytest'
}

ensure_project_venv() {
    local base=${CKPT_BASE_PYTHON:-python3}
    local pyver key venv
    pyver=$("$base" -c 'import sys; print(sys.version.split()[0])')
    key=$(ckpt_cache_key "${CKPT_PROJECT_REQS[@]}" "python: $pyver")
    venv=${CKPT_PROJECT_VENV:-$CKPT_CACHE/project-$key}
    ckpt_cached_venv "$venv" "$base" 1200 _install_project_reqs || return 1
    echo "$venv/bin/python"
}

# ensure_p2p_system_libs: Mooncake's module links libibverbs.so.1 (also for the TCP transport).
# Install Debian's libibverbs1 when it is missing and we may (root with apt-get: CI's fresh Debian).
ensure_p2p_system_libs() {
    if ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'; then return 0; fi
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
        ckpt_log "installing libibverbs1 (needed by Mooncake's TransferEngine)"
        (apt-get install -y -q libibverbs1 || { apt-get update -q && apt-get install -y -q libibverbs1; }) >&2
    else
        ckpt_log "libibverbs.so.1 is missing and cannot be installed here: the P2P tests will be skipped"
    fi
}

# ensure_lint_venv: the linters' own small virtualenv (ruff and mypy at pinned versions, nothing of
# the project's: mypy reads torch, vLLM, ... as untyped, see [tool.mypy] in pyproject.toml), cached
# like the project venv, keyed by the pins and the python version; prints its python on stdout.
CKPT_LINT_REQS=("ruff==0.8.4" "mypy==1.13.0")
CKPT_LINT_PACKAGES=(ckpt_core ckpt_vllm ckpt_sglang ckpt_verl ckpt_ascend)

_install_lint_reqs() {
    ckpt_log "building the lint virtualenv $(dirname "$(dirname "$1")") (${CKPT_LINT_REQS[*]})"
    ckpt_quiet "$CKPT_INSTALL_LOG" "$1" -m pip install "${CKPT_LINT_REQS[@]}" || return 1
    ckpt_quiet "$CKPT_INSTALL_LOG" "$1" -m ruff --version || return 1
    ckpt_quiet "$CKPT_INSTALL_LOG" "$1" -m mypy --version
}

ensure_lint_venv() {
    local base=${CKPT_BASE_PYTHON:-python3}
    local pyver key venv
    pyver=$("$base" -c 'import sys; print(sys.version.split()[0])')
    key=$(ckpt_cache_key "${CKPT_LINT_REQS[@]}" "python: $pyver")
    venv=${CKPT_LINT_VENV:-$CKPT_CACHE/lint-$key}
    ckpt_cached_venv "$venv" "$base" 600 _install_lint_reqs || return 1
    echo "$venv/bin/python"
}

# run_lint PY: ruff, then mypy, over the packages (settings: pyproject.toml). Prints each tool's
# output; returns 1 if either found something. mypy's cache lives in the checkout (.mypy_cache).
run_lint() {
    local py=$1 rc=0
    ckpt_log "ruff check ${CKPT_LINT_PACKAGES[*]}"
    "$py" -m ruff check --no-cache "${CKPT_LINT_PACKAGES[@]}" || rc=1
    ckpt_log "mypy ${CKPT_LINT_PACKAGES[*]}"
    "$py" -m mypy "${CKPT_LINT_PACKAGES[@]}" || rc=1
    return $rc
}
