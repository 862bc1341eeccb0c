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
)

ckpt_log() { echo "[$(basename "$0")] $*" >&2; }

ensure_project_venv() {
    local base=${CKPT_BASE_PYTHON:-python3}
    local pyver key venv
    pyver=$("$base" -c 'import sys; print(sys.version.split()[0])')
    key=$(printf '%s\n' "${CKPT_PROJECT_REQS[@]}" "python: $pyver" | sha256sum | cut -c1-12)
    venv=${CKPT_PROJECT_VENV:-$CKPT_CACHE/project-$key}
    mkdir -p "$CKPT_CACHE"
    (
        exec 8>"$venv.lock"
        flock -w 1200 8 || { ckpt_log "timed out waiting for $venv.lock"; exit 1; }
        if [[ ! -f $venv/.ckpt-installed ]]; then
            ckpt_log "creating the project virtualenv $venv"
            rm -rf "$venv"
            "$base" -m venv "$venv"
            "$venv/bin/python" -m pip install -q "${CKPT_PROJECT_REQS[@]}" >&2
            "$venv/bin/python" -c 'import torch, zmq, httpx, safetensors, pytest' >&2
            date -u +%FT%TZ >"$venv/.ckpt-installed"
        fi
    ) || return 1
    echo "$venv/bin/python"
}
