#!/usr/bin/env bash
# Install stock checkpoint-engine releases (the reference implementation, from PyPI) into cached
# target folders for the compat-codec tests, and print "VERSION=DIR" lines on stdout.
#   bash scripts/stock_ce_env.sh [VERSION...]      (default: 0.4.2 0.3.4 0.2.1)
#
# A folder holds only checkpoint_engine and loguru (--no-deps): the tests put it on PYTHONPATH of
# engine-worker processes running the project venv's python, which has the rest of its needs
# (torch, pyzmq, ...). 0.4.x ends an update with two messages, 0.2.1-0.3.4 with one; 0.2.x also
# answers errors pickled, which our codec must refuse without unpickling.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
PY=$(ensure_project_venv)
VERSIONS=("$@")
[[ ${#VERSIONS[@]} -gt 0 ]] || VERSIONS=(0.4.2 0.3.4 0.2.1)
LOGURU="loguru==0.7.3"

for v in "${VERSIONS[@]}"; do
    key=$(ckpt_cache_key "checkpoint-engine==$v" "$LOGURU")
    dir=$CKPT_CACHE/stock-ce-$v-$key
    mkdir -p "$CKPT_CACHE"
    (
        exec 8>"$dir.lock"
        flock -w 600 8 || { ckpt_log "timed out waiting for $dir.lock"; exit 1; }
        if [[ ! -f $dir/.ckpt-installed ]]; then
            rm -rf "$dir"
            log=$dir.install.log
            : >"$log"
            ckpt_log "installing checkpoint-engine==$v into $dir (installer output: $log)"
            ckpt_quiet "$log" "$PY" -m pip install --no-deps --target "$dir" "checkpoint-engine==$v" "$LOGURU" || exit 1
            ckpt_quiet "$log" env PYTHONPATH="$dir" "$PY" -c 'import checkpoint_engine.worker' || exit 1
            date -u +%FT%TZ >"$dir/.ckpt-installed"
        fi
    )
    echo "$v=$dir"
done
