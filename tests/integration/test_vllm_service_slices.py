"""Service ranks whose update requests differ in ``slices``, on the real TP-2 vLLM-CPU server: the rank
that posts asks for slices (and could record the plan from the engine), the other does not. Every
rank refuses with the same ConfigError within the update's timeout, before the engine is asked for
anything (before, the posting rank recorded the plan and waited in the plan's exchange for a peer that
had already answered 400, until PS_COLLECTIVE_TIMEOUT_S broke the world); the engine keeps its weights
byte for byte; the next sliced update equals a whole update of the same checkpoint byte for byte and
answers like Hugging Face.
"""

import pytest

from vllm_support.fixtures import MAX_TOKENS, shared_servers, tiny_model, vllm_python  # noqa: F401
from vllm_support.parity import differences, tp_server_args

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]
TP = 2
SHARED_SERVER = ("tiny_model", {"extension": True, "backend": "ckpt", **tp_server_args(TP)})   # SharedServers
UPDATE_S = 60          # the updates' timeout
COLLECTIVE_S = 90      # PS_COLLECTIVE_TIMEOUT_S: a rank left waiting shows past UPDATE_S


def _shards(weights, where, tag: str) -> list[str]:
    """``weights`` split by tensor over the TP ranks (each PS rank registers one file)."""
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(weights))
    names = sorted(tensors)
    out = []
    for r in range(TP):
        out.append(str(where / f"{tag}-{r}.safetensors"))
        save_file({n: tensors[n] for n in names[r::TP]}, out[-1])
    return out


def test_service_ranks_that_disagree_on_slices_refuse_alike_and_the_next_sliced_update_is_exact(
        shared_servers, tiny_model, tmp_path):
    from support.service_world import ServiceWorld

    server = shared_servers.get(tiny_model, **SHARED_SERVER[1])
    w0, w1 = tiny_model.weights
    tiny_model.references(w0, w1)
    url = f"{server.endpoint}/collective_rpc"
    world = ServiceWorld(TP, str(tmp_path), env={"PS_COLLECTIVE_TIMEOUT_S": str(COLLECTIVE_S)})
    try:
        for tag, weights in (("w0", w0), ("w1", w1)):
            files = _shards(weights, tmp_path, tag)
            got = world.all("POST", f"/v1/checkpoints/{tag}/files", [{"files": [f]} for f in files])
            assert [x.status_code for x in got] == [200] * TP, [x.text for x in got]
            assert [x.status_code for x in world.all("POST", f"/v1/checkpoints/{tag}/gather-metas")] == [200] * TP

        def update(tag: str, slices: tuple[bool, bool]):
            bodies = [{"timeout": UPDATE_S, "slices": s} for s in slices]
            bodies[1]["update_url"] = url   # rank 1 posts to the engine (and records its plan when sliced)
            return world.all("POST", f"/v1/checkpoints/{tag}/update", bodies)

        assert [x.status_code for x in update("w0", (False, False))] == [200] * TP
        on_w0 = server.client.collective_rpc("ckpt_state_digests")
        refused = update("w1", (False, True))
        for r, resp in enumerate(refused):
            assert resp.status_code == 400, f"rank {r}: {resp.status_code} {resp.text[:800]}"
            err = resp.json()["error"]
            assert err["type"] == "ConfigError" and "disagree on slices (rank 0 False, rank 1 True)" in err["message"]
            assert resp.elapsed.total_seconds() < UPDATE_S, f"rank {r} answered after {resp.elapsed}"
        assert [c.get("/v1/healthz").status_code for c in world.clients] == [200] * TP
        assert not differences(server.client.collective_rpc("ckpt_state_digests"), on_w0), "the engine changed"
        assert server.complete(tiny_model.prompts, MAX_TOKENS) == tiny_model.reference(w0)

        sliced = update("w1", (True, True))
        assert [x.status_code for x in sliced] == [200] * TP, [x.text[:800] for x in sliced]
        result = sliced[0].json()["result"]["slices"]
        assert sum(result["received_bytes"]) < TP * result["whole_bytes"], result
        after = server.client.collective_rpc("ckpt_state_digests")
        assert server.complete(tiny_model.prompts, MAX_TOKENS) == tiny_model.reference(w1)
        assert [x.status_code for x in update("w1", (False, False))] == [200] * TP   # whole, for the comparison
        differ = differences(after, server.client.collective_rpc("ckpt_state_digests"))
        assert not differ, "\n".join(differ[:40])
    finally:
        assert world.close() == [0] * TP
