"""Pytest fixtures and helpers of the real-vLLM tests (imported by tests/integration/test_vllm_*.py).

Everything vLLM or transformers runs under ``CKPT_VLLM_PYTHON`` (the vLLM venv, made by
scripts/vllm_env.sh) in subprocesses; the tests themselves and the parameter server run in the
project venv. Without ``CKPT_VLLM_PYTHON`` every test here is skipped, with that reason.
"""

from __future__ import annotations

import json
import os
import random
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ckpt_core import ParameterServer

from support.forked import Zygote, run_python
from support.procs import pythonpath

from .server import REPO, VllmServer, free_port

HERE = Path(__file__).resolve().parent
TINY_MODEL = HERE / "tiny_model.py"
MAX_TOKENS = 12


def prompts_for(seed: int) -> list[list[int]]:
    """Token-id prompts; the long one fills whole KV blocks so a stale prefix cache would show."""
    rng = random.Random(seed)
    return [[rng.randrange(2, 380) for _ in range(n)] for n in (5, 17, 200)]


@dataclass
class TinyModel:
    """A locally built tiny Qwen2: its directory, two weight sets, the HF references of both."""

    dir: Path
    seed: int
    weights: list[Path]
    prompts: list[list[int]]
    python: str
    _refs: dict[str, list[list[int]]] = field(default_factory=dict)
    _pending: Future | None = None   # references being computed in the background (see build_tiny_model)

    def _settle(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._refs.update(pending.result(timeout=600))
            assert self.reference(self.weights[0]) != self.reference(self.weights[1]), \
                "the two random weight sets give the same greedy output; the switch test would prove nothing"

    def reference(self, weights: Path) -> list[list[int]]:
        """Hugging Face transformers' greedy completions of ``prompts`` with ``weights`` (cached)."""
        self._settle()
        key = str(weights)
        if key not in self._refs:
            self._refs.update(hf_reference(self.python, self.dir, [weights], self.prompts))
        return self._refs[key]

    def references(self, *weights: Path) -> None:
        """Compute several references in one subprocess (transformers' import dominates)."""
        self._settle()
        todo = [w for w in weights if str(w) not in self._refs]
        if todo:
            self._refs.update(hf_reference(self.python, self.dir, todo, self.prompts))


# The vLLM venv's python, forked from a helper that imported what tiny_model.py needs once
# (tests/forked.py): it runs dozens of times in the suite (builds, transformers references).
_TINY_MODEL_PRELOAD = "import torch, safetensors.torch, transformers\nfrom transformers import AutoModelForCausalLM"
_ZYGOTES: dict[str, Zygote] = {}


def _tiny_model_zygote(python: str) -> Zygote:
    if python not in _ZYGOTES:
        _ZYGOTES[python] = Zygote(python, _TINY_MODEL_PRELOAD, env=dict(os.environ, PYTHONPATH=pythonpath(REPO)),
                                  cwd=str(REPO))
    return _ZYGOTES[python]


def run_vllm_python(python: str, *args: str, timeout: float = 300) -> str:
    proc = run_python(_tiny_model_zygote(python), python, [str(TINY_MODEL), *args], timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"tiny_model.py {args[0]} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout


def hf_reference(python: str, model_dir: Path, weights: list[Path], prompts) -> dict[str, list[list[int]]]:
    out = run_vllm_python(python, "reference", "--model", str(model_dir), "--weights", *map(str, weights),
                          "--prompts", json.dumps(prompts), "--max-tokens", str(MAX_TOKENS))
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def vllm_python() -> str:
    python = os.environ.get("CKPT_VLLM_PYTHON")
    if not python:
        pytest.skip("real vLLM tests need CKPT_VLLM_PYTHON (the python of the venv made by "
                    "scripts/vllm_env.sh; scripts/test.sh sets it)")
    if not Path(python).exists():
        pytest.fail(f"CKPT_VLLM_PYTHON={python} does not exist: run scripts/vllm_env.sh")
    return python


TINY_CONFIG = {"num_key_value_heads": 2}


def build_tiny_model(python: str, out: Path, *, tie: bool = False) -> TinyModel:
    # Fresh random weights every session (printed, to reproduce a failure with CKPT_TEST_SEED).
    seed = int(os.environ.get("CKPT_TEST_SEED") or random.randrange(1, 2**31 - 4))
    print(f"tiny model ({'tied' if tie else 'untied'} embeddings) seed: {seed} "
          f"(set CKPT_TEST_SEED={seed} to reproduce)")
    # Two KV heads: at TP 2 each rank holds one, so k_proj/v_proj are split like q_proj (the
    # replicated case, one KV head, has its own models in test_vllm_slices and the parity tests).
    run_vllm_python(python, "build", "--out", str(out), "--seed", str(seed), "--variants", "2",
                    "--config-json", json.dumps(TINY_CONFIG), *(["--tie"] if tie else []))
    model = TinyModel(dir=out, seed=seed, weights=[out / "weights-0.safetensors", out / "weights-1.safetensors"],
                      prompts=prompts_for(seed), python=python)
    # The references are computed in the background: the first server boots meanwhile; the first
    # reference() waits for them (and checks that the two weight sets answer differently).
    model._pending = _BACKGROUND.submit(hf_reference, python, out, model.weights, model.prompts)
    return model


_BACKGROUND = ThreadPoolExecutor(max_workers=2, thread_name_prefix="vllm-test-refs")


# The test modules import these fixtures, and pytest makes an imported fixture a fixture of that
# module: a session-scoped one would run once per module (each module building its own tiny
# model and booting its own "shared" servers). One instance per pytest process instead:
_SESSION: dict[str, object] = {}


def _once(key: str, make):
    if key not in _SESSION:
        _SESSION[key] = make()
    return _SESSION[key]


@pytest.fixture(scope="session")
def tiny_model(vllm_python, tmp_path_factory) -> TinyModel:
    """Untied Qwen2 (lm_head has its own weight)."""
    return _once("tiny_model", lambda: build_tiny_model(vllm_python, tmp_path_factory.mktemp("tiny-qwen2")))


@pytest.fixture(scope="session")
def tiny_tied_model(vllm_python, tmp_path_factory) -> TinyModel:
    """Qwen2 with lm_head tied to embed_tokens (the checkpoint has no lm_head.weight)."""
    return _once("tiny_tied_model",
                 lambda: build_tiny_model(vllm_python, tmp_path_factory.mktemp("tiny-qwen2-tied"), tie=True))


def start_server(python: str, model: TinyModel, log_dir: Path, **kwargs) -> VllmServer:
    return ready(launch_server(python, model, log_dir, **kwargs))


def launch_server(python: str, model: TinyModel, log_dir: Path, **kwargs) -> VllmServer:
    """Start a server without waiting for it (see ``ready``): work done meanwhile overlaps its boot."""
    return VllmServer(python, model.dir, log_dir / "vllm-server.log", **kwargs).launch()


def ready(*servers: VllmServer) -> VllmServer:
    """Wait until every launched server serves (each stopped, all of them, if one fails); the first."""
    try:
        for server in servers:
            server.wait_ready()
            print(f"vLLM server up in {server.start_seconds:.1f} s, log {server.log_path}")
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers[0]


class SharedServers:
    """One server per (model, arguments) for the whole session, shared by the test modules that
    ask for the same one (a cold start costs ~40 s of the suite's 2 cores), stopped at the end.

    A module that uses one declares it, ``SHARED_SERVER = ("tiny_model", {arguments})`` (the model
    fixture's name, the arguments of ``get``): when the session first asks for a shared server,
    every server the selected modules declare boots at once (``launch_declared``; a cold start is
    mostly one core's work, so two boot in about the time of one), and the later modules find
    theirs ready.

    A test on a shared server must not assume what an earlier module left in it: it pushes the
    weights it checks (``VllmServer.pushed`` says whether anything was pushed yet).
    """

    def __init__(self, python: str, base: Path):
        self.python, self.base = python, base
        self._servers: dict[tuple, VllmServer] = {}

    def _launch(self, model: TinyModel, kwargs: dict) -> VllmServer:
        """The server of (model, kwargs): the running or booting one, else a new one, launched."""
        key = (str(model.dir), json.dumps(kwargs, sort_keys=True, default=str))
        server = self._servers.get(key)
        if server is None or not server.alive():
            where = self.base / f"server-{len(self._servers)}"
            server = self._servers[key] = launch_server(self.python, model, where, **kwargs)
        return server

    def get(self, model: TinyModel, **kwargs) -> VllmServer:
        server = self._launch(model, kwargs)
        if server.start_seconds is None:   # launched, not yet waited for
            ready(server)
        return server

    def launch_declared(self, request) -> None:
        """Launch (without waiting) the ``SHARED_SERVER`` of every module the session selected."""
        seen = []
        for item in request.session.items:
            declared = getattr(item.module, "SHARED_SERVER", None)
            if declared is not None and item.module not in seen:
                seen.append(item.module)
                name, kwargs = declared
                self._launch(request.getfixturevalue(name), dict(kwargs))

    def stop(self) -> None:
        for server in self._servers.values():
            server.stop()
        self._servers.clear()


@pytest.fixture(scope="session")
def shared_servers(request, vllm_python, tmp_path_factory):
    """The session's one ``SharedServers`` (see ``_SESSION``); every module's copy of this fixture
    ends with the session and stops it (``stop`` is idempotent)."""
    registry = _SESSION.get("shared_servers")
    if registry is None:
        registry = _SESSION["shared_servers"] = SharedServers(vllm_python, tmp_path_factory.mktemp("shared-vllm"))
        registry.launch_declared(request)
    try:
        yield registry
    finally:
        registry.stop()


def push(server: VllmServer, files: list[Path], *, path: str, name: str = "ckpt",
         max_bucket_gb: float | None = None, timeout: float = 120, req_func=None, **update_kwargs) -> dict:
    """One PS rank (world of 1, on CPU) pushes ``files`` into ``server``; returns the PS's result.

    ``update_kwargs`` go to ``VllmClient.update`` (``pause``, ...); ``req_func`` replaces the client's.
    """
    return push_parts(server, [files], path=path, name=name, max_bucket_gb=max_bucket_gb, timeout=timeout,
                      req_func=req_func, **update_kwargs)[0]


def push_parts(server: VllmServer, parts: list[list[Path]], *, path: str, name: str = "ckpt",
               max_bucket_gb: float | None = None, timeout: float = 120, req_func=None, **update_kwargs) -> list:
    """One PS pushes each part as its own PS update; several parts form one weight update of the
    server (backend path: start with the first, finish with the last). Returns the PS's results."""
    results = []
    with ParameterServer(rank=0, world_size=1, device="cpu", master_addr="127.0.0.1",
                         master_port=free_port(), max_bucket_gb=max_bucket_gb) as ps:
        for i, files in enumerate(parts):
            part = f"{name}-{i}"
            ps.register_checkpoint(part, files=[str(f) for f in files])
            ps.gather_metas(part)
            if len(parts) > 1:
                update_kwargs.update(start=i == 0, finish=i == len(parts) - 1)
            fn = req_func or server.client.req_func(path=path, timeout=timeout, **update_kwargs)
            server.pushed = True
            results.append(ps.update(part, fn, timeout=timeout))
    return results


def split_copy(src: Path, out_dir: Path, parts: int = 2) -> list[Path]:
    """``src``'s tensors dealt round-robin into ``parts`` files (one checkpoint, several PS updates)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(src))
    files = []
    for i in range(parts):
        names = sorted(tensors)[i::parts]
        files.append(out_dir / f"part-{i}.safetensors")
        save_file({n: tensors[n] for n in names}, str(files[-1]))
    return files


def broken_copy(src: Path, dst: Path, *, drop: str | tuple[str, ...] | None = None,
                reshape: str | None = None) -> Path:
    """``src`` without tensor(s) ``drop``, or with tensor ``reshape`` transposed / cut (same dtype)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(src))
    for name in ([drop] if isinstance(drop, str) else drop or ()):
        del tensors[name]
    if reshape:
        t = tensors[reshape]
        tensors[reshape] = (t.t() if t.shape[0] != t.shape[1] else t[:, : t.shape[1] // 2]).contiguous()
    save_file(tensors, str(dst))
    return dst


class OneAhead:
    """The cases of a parametrized module fixture, each prepared while the tests of the case before
    it run: ``prepare(case)`` (build a model, boot its server, compute its references) runs in a
    background thread as soon as the previous case is ready, so the next server boots on the core
    that a case's tests (pushes and completions) leave idle. ``get(case)`` waits for ``case`` and
    starts the one after it; ``close()`` waits for what is still being prepared and closes every
    case not handed out (a handed-out case is the fixture's to close). At most two cases (two
    servers) exist at once. The order is that of the session's selected tests (``-k`` respected:
    nothing is prepared for a deselected case)."""

    def __init__(self, request, fixture: str, prepare, close, timeout: float = 1800):
        self._prepare, self._close, self._timeout = prepare, close, timeout
        self._order = []
        for item in request.session.items:
            spec = getattr(item, "callspec", None)
            if (item.module is request.module and spec is not None and fixture in spec.params
                    and spec.params[fixture] not in self._order):
                self._order.append(spec.params[fixture])
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-test-ahead")
        self._futures: dict[int, Future] = {}

    def _submit(self, index: int) -> Future:
        if index not in self._futures:
            self._futures[index] = self._pool.submit(self._prepare, self._order[index])
        return self._futures[index]

    def get(self, case):
        index = self._order.index(case)
        future = self._submit(index)
        try:
            prepared = future.result(timeout=self._timeout)
        finally:
            del self._futures[index]
            if index + 1 < len(self._order):
                self._submit(index + 1)   # runs once this case is ready: the pool has one thread
        return prepared

    def close(self) -> None:
        for future in self._futures.values():
            try:
                self._close(future.result(timeout=self._timeout))
            except Exception:
                pass   # a case that failed to prepare owns nothing (its own cleanup stopped its server)
        self._futures.clear()
        self._pool.shutdown(wait=True)
