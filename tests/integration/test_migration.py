"""Migrating from checkpoint-engine is an import change: every public call of the reference takes the
reference's own spelling here (pinned against the installed release's signatures, so the test follows
the reference), and a driver written for it runs unchanged but for its imports, also against an engine
that has no /reset_prefix_cache.

The reference is the stock release that scripts/stock_ce_env.sh installs (CKPT_STOCK_CE); its
signatures are read in a process of its own (importing it here would put its package on our path).
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import zmq

import ckpt_core
from support.data import digest, fresh_tensor, want_digests
from support.ports import free_port
from support.procs import pythonpath
from support.service_world import HttpEngineFront
from support.stock_workers import stock_params
from support.torchrun import run_torchrun
from ckpt_core.checkpoint.safetensors import write_file

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "tests" / "support" / "reference_driver.py"
P = inspect.Parameter

_SIGNATURES = r"""
import inspect, json, checkpoint_engine as ce
from checkpoint_engine.ps import ParameterServer
def sig(f):
    return [[p.name, p.kind.name, p.default is not p.empty] for p in inspect.signature(f).parameters.values()
            if p.name != "self"]
out = {f"ParameterServer.{n}": sig(f) for n, f in vars(ParameterServer).items()
       if inspect.isfunction(f) and (not n.startswith("_") or n == "__init__")}
out["request_inference_to_update"] = sig(ce.request_inference_to_update)
out["update_weights_from_ipc"] = sig(ce.update_weights_from_ipc)
print(json.dumps(out))
"""


def reference_signatures(folder: str) -> dict[str, list]:
    """``{"ParameterServer.method" or function: [[name, kind, has_default], ...]}`` of the installed reference."""
    proc = subprocess.run([sys.executable, "-c", _SIGNATURES], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=pythonpath(folder)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def ours(qualname: str):
    owner, _, name = qualname.rpartition(".")
    return getattr(ckpt_core.ParameterServer if owner else ckpt_core, name)


@pytest.mark.parametrize("stock", stock_params(["0.4.2"]))
def test_every_public_call_of_the_reference_takes_its_parameters_as_the_reference_spells_them(stock):
    _, folder = stock
    problems = []
    for qualname, params in reference_signatures(folder).items():
        mine = [p for p in inspect.signature(ours(qualname)).parameters.values() if p.name != "self"]
        by_name = {p.name: p for p in mine}
        for i, (name, kind, has_default) in enumerate(params):
            p = by_name.get(name)
            if p is None:
                problems.append(f"{qualname}: no parameter {name!r}")
            elif kind == "POSITIONAL_OR_KEYWORD" and (p.kind is not P.POSITIONAL_OR_KEYWORD or mine.index(p) != i):
                problems.append(f"{qualname}: {name!r} must be positional #{i} or a keyword, as in the reference")
            elif kind == "KEYWORD_ONLY" and p.kind not in (P.KEYWORD_ONLY, P.POSITIONAL_OR_KEYWORD):
                problems.append(f"{qualname}: {name!r} must be accepted as a keyword")
            elif has_default and p.default is P.empty:
                problems.append(f"{qualname}: {name!r} may be left out in the reference, not here")
        spelled = {name for name, _, _ in params}
        problems += [f"{qualname}: our extra {p.name!r} has no default" for p in mine
                     if p.name not in spelled and p.default is P.empty and p.kind not in (P.VAR_POSITIONAL,
                                                                                            P.VAR_KEYWORD)]
    assert problems == [], "\n".join(problems)


# The values a reference-style call passes, by the reference's parameter name (the PS-side calls of
# one world of one CPU rank). A parameter the reference adds fails the next test until it is here.
def _values(ps, named, engine) -> dict:
    return {"checkpoint_name": "a", "files": [], "named_tensors": named, "use_shared_memory_pool": False,
            "use_inplace_pin_memory": True, "force": True, "timeout": timedelta(minutes=2), "ranks": None,
            "req_func": engine, "metas": ps.get_metas()}


ORDER = ["register_checkpoint", "init_process_group", "gather_metas", "get_metas", "update", "load_metas",
         "store_based_barrier", "unregister_checkpoint"]


@pytest.mark.parametrize("stock", stock_params(["0.4.2"]))
def test_each_parameter_server_call_runs_with_the_references_keywords_and_positionals(stock):
    _, folder = stock
    ref = reference_signatures(folder)
    methods = sorted(q.split(".", 1)[1] for q in ref if q.startswith("ParameterServer.") and q != "ParameterServer.__init__")
    assert sorted(ORDER) == methods, f"the reference's public methods changed: {methods}"
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    named = {f"w{i}": fresh_tensor((16, 8), torch.bfloat16, gen) for i in range(3)}
    ctx, got = zmq.Context(), {}
    init = {"rank": 0, "world_size": 1, "auto_pg": True, "gpu_count": 1, "mem_fraction": 0.5,
            "master_addr": "127.0.0.1", "master_port": free_port()}
    assert [n for n, _, _ in ref["ParameterServer.__init__"]] == list(init), "the reference's constructor changed"
    with ckpt_core.ParameterServer(**init, device="cpu") as ps:
        def engine(socket_paths):   # the engine side, with the reference worker's keywords
            ckpt_core.update_weights_from_ipc(zmq_ctx=ctx, zmq_handle=dict(socket_paths)[ps.device_uuid], device_id=0,
                                              run=lambda ws: got.update({n: digest(t) for n, t in ws}),
                                              post_hook=lambda: None)
        for method in ORDER:
            values = _values(ps, named, engine)
            params = ref[f"ParameterServer.{method}"]
            missing = [n for n, _, _ in params if n not in values]
            assert missing == [], f"no value for the reference's {method}({missing})"
            getattr(ps, method)(**{n: values[n] for n, _, _ in params})   # every parameter as a keyword
        assert got == want_digests(named), "the update with the reference's keywords must load every tensor"
        # and positionally, where the reference allows it: unregister_checkpoint("a", True)
        ps.register_checkpoint("a", files=[], named_tensors=named)
        ps.unregister_checkpoint("a", True)
        assert ps.checkpoints() == []
    ctx.term()


def test_a_reference_driver_with_only_its_imports_changed_updates_an_engine_without_a_prefix_cache_route(tmp_path):
    """torchrun, 2 PS ranks, one engine of 2 workers (a real HTTP server that answers 404 to
    /reset_prefix_cache): the driver succeeds, the engine holds the checkpoint byte for byte, and the
    missing route is one warning naming the engine."""
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shards = [{f"layer{i}.{j}": fresh_tensor((24, 8), torch.float16, gen) for j in range(3)} for i in range(3)]
    for i, shard in enumerate(shards):
        write_file(str(ckpt / f"model-{i}.safetensors"), shard)
    driver = DRIVER.read_text()
    assert "from ckpt_core import ParameterServer, request_inference_to_update" in driver
    assert "checkpoint_engine" not in driver.split('"""', 2)[2], "the driver must import only ckpt_core"
    front = HttpEngineFront(2, reset_route=False)
    try:
        endpoint = front.url.removesuffix("/collective_rpc")
        run = run_torchrun([DRIVER, "--checkpoint-path", ckpt, "--endpoint", endpoint,
                            "--inference-parallel-size", "2"],
                           nproc=2, env=dict(os.environ, PYTHONPATH=pythonpath(ROOT)), timeout=300)
        assert run.returncode == 0, run.stderr[-4000:]
        # the two ranks share torchrun's stdout: one's line may land inside the other's (no newline between)
        assert sorted(re.findall(r"rank \d: updated my-checkpoint-iter-\d+", run.stdout)) == \
            ["rank 0: updated my-checkpoint-iter-0", "rank 1: updated my-checkpoint-iter-0"], run.stdout
        want = want_digests(*shards)
        assert [front.engine.digests(i) for i in range(2)] == [want, want], "both workers hold the checkpoint"
        posts = [p.split("?")[0] for p in front.paths if p.startswith("POST")]
        assert posts == ["POST /collective_rpc", "POST /reset_prefix_cache"], front.paths
        warned = [line for line in run.stderr.splitlines() if "/reset_prefix_cache" in line]
        assert len(warned) == 1 and "HTTP 404" in warned[0] and endpoint in warned[0], run.stderr[-3000:]
    finally:
        front.close()
