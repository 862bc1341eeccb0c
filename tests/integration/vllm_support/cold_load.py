"""Digests of a cold load: vLLM loads each checkpoint from disk, the way a fresh server does.

Runs as a script under the vLLM venv's python, with this repo first on PYTHONPATH:

    python cold_load.py --model DIR --weights FILE [FILE ...] [--tp N] [--dtype float32]
                        [--engine-kwargs JSON] [--prompts JSON --max-tokens N [--sequential]]

For each FILE, an offline engine (``vllm.LLM``, in this process, with the flags of the test
servers: float32, eager, 64 MiB of KV cache, seed 0; ``--engine-kwargs`` adds or replaces
arguments of ``vllm.LLM``, e.g. on a GPU) loads a directory holding DIR's config and tokenizer and
FILE as its only checkpoint; ``ckpt_state_digests`` is called on every worker, and with
``--prompts`` the greedy completions (token ids) are taken too. Prints one JSON line:
``{"digests": {FILE: [digests of rank 0, rank 1, ...]}, "tokens": {FILE: [[ids], ...]}}``. Engines
are built one after the other in one process (vLLM's import dominates; each takes seconds).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
from pathlib import Path

ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
       "VLLM_HOST_IP": "127.0.0.1", "VLLM_LOOPBACK_IP": "127.0.0.1"}
EXTENSION = "ckpt_vllm.VllmColocateWorkerExtension"
_SIDE_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def checkpoint_dir(model_dir: Path, weights: Path, where: Path) -> Path:
    """A model directory with ``weights`` as its only safetensors file (vLLM reads every
    ``*.safetensors`` of a directory: the test model's own directory holds several sets)."""
    out = where / weights.stem
    out.mkdir(parents=True, exist_ok=True)
    for name in _SIDE_FILES:
        if (model_dir / name).exists():
            (out / name).symlink_to((model_dir / name).resolve())
    (out / "model.safetensors").symlink_to(weights.resolve())
    return out


def greedy(llm, prompts: list[list[int]], max_tokens: int, sequential: bool = False) -> list[list[int]]:
    """Greedy completions; ``sequential``: one prompt at a time (see ``--sequential``)."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, seed=0)
    if sequential:
        return [greedy(llm, [p], max_tokens)[0] for p in prompts]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def cold_digests(model_dir: Path, weights: list[Path], tp: int, dtype: str = "float32", engine_kwargs=None,
                 prompts=None, max_tokens: int = 12, sequential: bool = False) -> dict:
    from vllm import LLM

    out: dict = {"digests": {}, "tokens": {}}
    kwargs = {"dtype": dtype, "enforce_eager": True, "max_model_len": 256, "kv_cache_memory_bytes": 64 << 20,
              "seed": 0, "worker_extension_cls": EXTENSION}
    if tp > 1:
        kwargs.update(tensor_parallel_size=tp, distributed_executor_backend="mp")
    kwargs.update(engine_kwargs or {})
    kwargs = {k: v for k, v in kwargs.items() if v is not None}   # {"kv_cache_memory_bytes": null} drops it
    with tempfile.TemporaryDirectory() as tmp:
        for w in weights:
            llm = LLM(model=str(checkpoint_dir(model_dir, w, Path(tmp))), load_format="auto", **kwargs)
            out["digests"][str(w)] = llm.collective_rpc("ckpt_state_digests")
            if prompts:
                out["tokens"][str(w)] = greedy(llm, prompts, max_tokens, sequential)
            engine_core = getattr(llm.llm_engine, "engine_core", None)
            if engine_core is not None:   # TP > 1: stop the worker processes before the next engine
                engine_core.shutdown()
            del llm
            gc.collect()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--weights", type=Path, nargs="+", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--engine-kwargs", type=json.loads, default=None, help="JSON object for vllm.LLM")
    ap.add_argument("--prompts", type=json.loads, default=None, help="JSON list of token-id lists")
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--sequential", action="store_true",
                    help="generate one prompt at a time: vLLM-CPU's FP8 (AMX) GEMM is not batch invariant, so "
                         "tokens compared with a server must come from batches of the same shape")
    ap.add_argument("--gpu", action="store_true", help="leave VLLM_TARGET_DEVICE unset")
    args = ap.parse_args(argv)
    for k, v in ENV.items():
        if not (args.gpu and k == "VLLM_TARGET_DEVICE"):
            os.environ.setdefault(k, v)
    result = cold_digests(args.model, args.weights, args.tp, args.dtype, args.engine_kwargs, args.prompts,
                          args.max_tokens, args.sequential)
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)   # engine worker processes (TP > 1) are gone; skip vLLM's atexit teardown


if __name__ == "__main__":
    main()
