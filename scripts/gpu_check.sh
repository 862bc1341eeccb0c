#!/usr/bin/env bash
# GPU check for air-gapped hosts: install what the interpreter lacks from a folder of wheels,
# run the GPU tests and the update benchmark, and keep every log and result under --out.
#
#   scripts/gpu_check.sh --wheelhouse DIR --out DIR [--nproc N] [--cases LIST] [options] [-- BENCH_ARGS...]
#
# --wheelhouse DIR   wheels to take missing distributions from (pyzmq, pytest, ...); only the
#                    distributions the interpreter does not already have are installed, with
#                    --no-index --no-deps, into --site (default /tmp/ckpt-site), put on PYTHONPATH
# --out DIR          where logs, junit XML and benchmark JSON go (created)
# --nproc N          benchmark ranks (default: the number of visible GPUs)
# --cases LIST       benchmark cases, e.g. dense16,dense40,moe8,tiny (default: the benchmark's)
# --repeats N        timed updates per case (default: the benchmark's)
# --lowmem GIB       also run dense16 with only GIB of device memory left free (bench-lowmem.json);
#                    (the PS then uses fewer, smaller slots; tensors larger than what is free fail)
# --single           also run dense16 on one GPU (bench-1gpu.json)
# --vllm-bench LIST also run benchmarks/vllm_bench.py (a real vLLM engine; needs vLLM importable) for
#                    each of LIST, e.g. 7b,tiny:fp8,moe,7b@fp8-block (SHAPE[:QUANTIZATION][@FORMAT]), with
#                    --verify; bf16 checkpoints also with checkpoint-engine where it is importable
#                    (vllm-SHAPE[-Q][-FORMAT].json)
# --sglang-bench LIST also run benchmarks/sglang_bench.py (a real SGLang server; needs SGLang and
#                    checkpoint-engine importable, e.g. PYTHONPATH=/tmp/ssite from ../shared/gpu_sglang)
#                    for each shape of LIST (7b, tiny): ours against checkpoint-engine, each checked
#                    equal to a cold load, the H2D floor, the staged commit's pause (sglang-SHAPE.json)
# --sglang-tests     also run tests/gpu/test_sglang_gpu.py on its own (sglang-gpu-tests.log/.xml and
#                    sglang-gpu-CASE.json per model); the GPU tests step runs it too when SGLang imports
# --delta-density D  also time delta updates at density D (or "measured"): the main update_bench run
#                    (--delta-density D: full and delta side by side, bit-exact) and each bf16 --vllm-bench
#                    run (ours: delta versions pushed into the engine, checked against a cold load of the last)
# --skip-tests / --skip-bench
# --python PY        interpreter (default python3)
# --step-timeout S   kill a step that runs longer than S seconds (needs coreutils timeout)
# Arguments after "--" go to every benchmark run unchanged.
# The project is not installed: its root (this script's parent's parent) goes on PYTHONPATH.
# Exit status: 0 when every step passed, 1 otherwise (a summary is printed and saved).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY=python3
WHEELHOUSE=""
OUT=""
SITE=/tmp/ckpt-site
NPROC=""
CASES=""
REPEATS=""
LOWMEM=""
SINGLE=0
SKIP_TESTS=0
SKIP_BENCH=0
STEP_TIMEOUT=""
VLLM_BENCH=""
SGLANG_BENCH=""
SGLANG_TESTS=0
DELTA_DENSITY=""
BENCH_EXTRA=()

die() { echo "gpu_check: $*" >&2; exit 2; }
need_arg() { [[ $# -ge 2 && -n "$2" ]] || die "$1 needs a value"; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --wheelhouse) need_arg "$@"; WHEELHOUSE="$2"; shift 2 ;;
    --out) need_arg "$@"; OUT="$2"; shift 2 ;;
    --site) need_arg "$@"; SITE="$2"; shift 2 ;;
    --nproc) need_arg "$@"; NPROC="$2"; shift 2 ;;
    --cases) need_arg "$@"; CASES="$2"; shift 2 ;;
    --repeats) need_arg "$@"; REPEATS="$2"; shift 2 ;;
    --lowmem) need_arg "$@"; LOWMEM="$2"; shift 2 ;;
    --single) SINGLE=1; shift ;;
    --vllm-bench) need_arg "$@"; VLLM_BENCH="$2"; shift 2 ;;
    --sglang-bench) need_arg "$@"; SGLANG_BENCH="$2"; shift 2 ;;
    --sglang-tests) SGLANG_TESTS=1; shift ;;
    --delta-density) need_arg "$@"; DELTA_DENSITY="$2"; shift 2 ;;
    --skip-tests) SKIP_TESTS=1; shift ;;
    --skip-bench) SKIP_BENCH=1; shift ;;
    --python) need_arg "$@"; PY="$2"; shift 2 ;;
    --step-timeout) need_arg "$@"; STEP_TIMEOUT="$2"; shift 2 ;;
    --) shift; BENCH_EXTRA=("$@"); break ;;
    -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done
[[ -n "$OUT" ]] || die "--out DIR is required"
mkdir -p "$OUT" || die "cannot create $OUT"
OUT="$(cd "$OUT" && pwd)"
command -v "$PY" >/dev/null || die "no interpreter $PY"

export NCCL_NVLS_ENABLE=0          # NVLink SHARP multicast stays off on these hosts
export CKPT_BENCH_OUT="$OUT"        # benchmarks run by the GPU tests (P2P) leave their JSON here
export PYTHONUNBUFFERED=1
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
FAILED=0
note() { echo "$*" | tee -a "$SUMMARY"; }

# ---------------------------------------------------------------- missing wheels
install_missing() {
  [[ -n "$WHEELHOUSE" ]] || { note "wheels: no --wheelhouse given; nothing installed"; return 0; }
  [[ -d "$WHEELHOUSE" ]] || die "--wheelhouse $WHEELHOUSE is not a directory"
  mkdir -p "$SITE"
  # Distributions named by the wheels that the interpreter (with SITE) does not have yet.
  local missing
  missing="$(PYTHONPATH="$SITE" "$PY" - "$WHEELHOUSE" <<'EOF'
import glob, os, re, sys
from importlib.metadata import PackageNotFoundError, version
seen = set()
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.whl"))):
    dist = re.sub(r"[-_.]+", "-", os.path.basename(path).split("-")[0]).lower()
    if dist in seen:
        continue
    seen.add(dist)
    try:
        version(dist)
    except PackageNotFoundError:
        print(dist)
EOF
)"
  if [[ -z "$missing" ]]; then
    note "wheels: nothing missing"
    return 0
  fi
  local pip_ok=0
  "$PY" -m pip --version >/dev/null 2>&1 && pip_ok=1
  for dist in $missing; do
    if [[ $pip_ok == 1 ]]; then
      if "$PY" -m pip install --quiet --no-index --no-deps --upgrade --find-links "$WHEELHOUSE" \
           --target "$SITE" "$dist" >>"$OUT/wheels.log" 2>&1; then
        note "wheels: installed $dist into $SITE"
      else
        note "wheels: WARNING no compatible wheel of $dist (see wheels.log)"
      fi
    else
      # No pip on the host: a wheel is a zip; unpack the first one whose tags fit this interpreter.
      if "$PY" - "$WHEELHOUSE" "$dist" "$SITE" >>"$OUT/wheels.log" 2>&1 <<'EOF'
import glob, os, platform, re, sys, zipfile
house, dist, site = sys.argv[1:]
cp = f"cp{sys.version_info[0]}{sys.version_info[1]}"
machine = platform.machine()
for path in sorted(glob.glob(os.path.join(house, "*.whl"))):
    parts = os.path.basename(path)[:-4].split("-")
    if re.sub(r"[-_.]+", "-", parts[0]).lower() != dist:
        continue
    py, abi, pl = parts[-3:]
    if not (cp in py.split(".") or any(p.startswith("py3") for p in py.split("."))):
        continue
    if abi not in ("none", "abi3", cp):
        continue
    if pl != "any" and not (sys.platform == "linux" and "linux" in pl and pl.endswith(machine)):
        continue
    zipfile.ZipFile(path).extractall(site)
    print("unpacked", path)
    sys.exit(0)
sys.exit(1)
EOF
      then note "wheels: unpacked $dist into $SITE (no pip)"
      else note "wheels: WARNING no compatible wheel of $dist (see wheels.log)"
      fi
    fi
  done
}

install_missing
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT" || die "cannot cd to $ROOT"

run_step() {  # run_step NAME LOGFILE CMD... ; tees output, records the outcome
  local name="$1" log="$2"; shift 2
  local wrap=()
  [[ -n "$STEP_TIMEOUT" ]] && command -v timeout >/dev/null && wrap=(timeout --kill-after=30 "$STEP_TIMEOUT")
  echo "== $name: $*" | tee "$log"
  local t0=$SECONDS
  ${wrap[@]+"${wrap[@]}"} "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  note "$name: exit $rc after $((SECONDS - t0)) s (log: $log)"
  return "$rc"
}

# ---------------------------------------------------------------- environment record
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "project: $ROOT ($(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo 'not a git checkout'))"
  "$PY" - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0])
for mod in ("torch", "zmq", "safetensors", "pytest", "httpx", "pydantic", "fastapi", "vllm", "sglang",
            "checkpoint_engine"):   # the last three: README's tested versions (scripts/tested_versions.py)
    try:
        m = importlib.import_module(mod)
        print(mod, getattr(m, "__version__", "?"), getattr(m, "__file__", ""))
    except Exception as exc:
        print(mod, "MISSING", type(exc).__name__)
try:
    import torch
    print("cuda", torch.version.cuda, "available", torch.cuda.is_available(), "devices", torch.cuda.device_count())
    if torch.cuda.is_available():
        print("nccl", ".".join(map(str, torch.cuda.nccl.version())))
except Exception as exc:
    print("torch probe failed:", exc)
EOF
  command -v nvidia-smi >/dev/null && { nvidia-smi; nvidia-smi topo -m; }
  env | grep -E '^(NCCL_|PS_|CUDA_VISIBLE)' | sort
} > "$OUT/env.txt" 2>&1
"$PY" -c "import zmq" 2>/dev/null || { note "FATAL: pyzmq is not importable (add its wheel to --wheelhouse)"; exit 1; }

# ---------------------------------------------------------------- GPU tests
if [[ $SKIP_TESTS == 0 ]]; then
  if ! "$PY" -m pytest --version >/dev/null 2>&1; then
    note "gpu tests: SKIPPED, pytest is not importable (add pytest, pluggy, iniconfig, packaging wheels)"
    FAILED=1
  else
    run_step "gpu tests" "$OUT/gpu-tests.log" "$PY" -m pytest -m gpu tests/gpu -q -rA \
      --junitxml "$OUT/gpu-tests.xml" -p no:cacheprovider
    rc=$?
    if [[ $rc == 5 ]]; then note "gpu tests: none collected"; elif [[ $rc != 0 ]]; then FAILED=1; fi
  fi
fi

# ---------------------------------------------------------------- benchmark
if [[ $SKIP_BENCH == 0 ]]; then
  if [[ -z "$NPROC" ]]; then
    NPROC="$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)"
  fi
  if [[ "$NPROC" -lt 1 ]]; then
    note "benchmark: SKIPPED, no GPU visible"
    FAILED=1
  else
    common=()
    [[ -n "$REPEATS" ]] && common+=(--repeats "$REPEATS")
    bench() {  # bench NAME NPROC OUTSTEM ARGS...
      local name="$1" n="$2" stem="$3"; shift 3
      run_step "$name" "$OUT/$stem.log" "$PY" -m torch.distributed.run --standalone --nproc-per-node "$n" \
        benchmarks/update_bench.py --out "$OUT/$stem.json" ${common[@]+"${common[@]}"} "$@" ${BENCH_EXTRA[@]+"${BENCH_EXTRA[@]}"} || FAILED=1
    }
    main_args=()
    [[ -n "$CASES" ]] && main_args+=(--cases "$CASES")
    [[ -n "$DELTA_DENSITY" ]] && main_args+=(--delta-density "$DELTA_DENSITY")
    bench "benchmark ($NPROC ranks)" "$NPROC" bench ${main_args[@]+"${main_args[@]}"}
    [[ -n "$LOWMEM" ]] && bench "benchmark, $LOWMEM GiB free device memory" "$NPROC" bench-lowmem \
      --cases dense16 --free-mem-gib "$LOWMEM" --skip-pool --skip-shm
    [[ $SINGLE == 1 ]] && bench "benchmark (1 rank)" 1 bench-1gpu --cases dense16 --skip-pool --skip-shm
  fi
fi

# ---------------------------------------------------------------- real vLLM engine
if [[ -n "$VLLM_BENCH" ]]; then
  if ! "$PY" -c "import vllm" >/dev/null 2>&1; then
    note "vllm benchmark: SKIPPED, vllm is not importable (add its wheels to --wheelhouse)"
    FAILED=1
  else
    impls=ours
    "$PY" -c "import checkpoint_engine.worker" >/dev/null 2>&1 && impls=ours,reference
    IFS=, read -r -a vcases <<<"$VLLM_BENCH"
    for c in "${vcases[@]}"; do
      fmt=bf16; [[ $c == *@* ]] && { fmt=${c#*@}; c=${c%%@*}; }
      shape=${c%%:*}; quant=""; stem="vllm-$shape"
      [[ $c == *:* ]] && { quant=${c#*:}; stem="$stem-$quant"; }
      [[ $fmt != bf16 ]] && stem="$stem-$fmt"
      qargs=(); [[ -n "$quant" ]] && qargs=(--quantization "$quant")
      [[ -n "$DELTA_DENSITY" && $fmt == bf16 ]] && qargs+=(--delta-density "$DELTA_DENSITY")
      ps=$impls; [[ $fmt != bf16 ]] && ps=ours
      run_step "vllm benchmark $stem" "$OUT/$stem.log" "$PY" benchmarks/vllm_bench.py --shape "$shape" \
        --format "$fmt" ${qargs[@]+"${qargs[@]}"} --ps "$ps" --verify ${REPEATS:+--repeats "$REPEATS"} \
        --out "$OUT/$stem.json" || FAILED=1
    done
  fi
fi

# ---------------------------------------------------------------- real SGLang server
sglang_ok() {  # sglang_ok WHAT: SGLang and the stock worker it imports are importable
  if "$PY" -c "import sglang, checkpoint_engine.worker" >/dev/null 2>&1; then return 0; fi
  note "$1: SKIPPED, sglang or checkpoint_engine is not importable (see ../shared/gpu_sglang: PYTHONPATH=/tmp/ssite)"
  FAILED=1
  return 1
}
if [[ $SGLANG_TESTS == 1 ]] && sglang_ok "sglang gpu tests"; then
  run_step "sglang gpu tests" "$OUT/sglang-gpu-tests.log" "$PY" -m pytest tests/gpu/test_sglang_gpu.py -q -rA \
    --junitxml "$OUT/sglang-gpu-tests.xml" -p no:cacheprovider || FAILED=1
fi
if [[ -n "$SGLANG_BENCH" ]] && sglang_ok "sglang benchmark"; then
  IFS=, read -r -a sshapes <<<"$SGLANG_BENCH"
  for shape in "${sshapes[@]}"; do
    run_step "sglang benchmark $shape" "$OUT/sglang-$shape.log" "$PY" benchmarks/sglang_bench.py --shape "$shape" \
      ${REPEATS:+--repeats "$REPEATS"} --out "$OUT" || FAILED=1
  done
fi

echo "---- summary (also in $SUMMARY)"
cat "$SUMMARY"
exit $FAILED
