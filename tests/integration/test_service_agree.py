"""Ranks whose requests of one collective route differ, or one of which refuses its own, answer alike:
real `ckpt-engine serve` processes (2 ranks, gloo) on Unix sockets, the harness's engine workers behind
a real HTTP ``/collective_rpc``.

Every rank is asked, as a collective route must be; one rank's request is refused there (an engine
outside the operator's policy, a field that does not validate, ``inference_group_ranks`` outside the
world, ``slices`` that the others do not ask for or that ``CKPT_SLICES=0`` turns off there), or the
ranks are asked for different operations. Every rank answers the same typed error well within the
update's timeout (before, the refusing rank answered at once and the others waited in a collective
until ``PS_COLLECTIVE_TIMEOUT_S``, after which the world was broken); nothing reaches an engine; every
rank stays healthy; the next correct update delivers every tensor bit for bit.
"""

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("fastapi")
from support.data import FAULT_DTYPES, fresh_tensor, want_digests  # noqa: E402
from support.service_world import HttpEngineFront, ServiceWorld  # noqa: E402
from ckpt_core.checkpoint.safetensors import write_file  # noqa: E402

UPDATE_S = 15        # the updates' timeout: every rank must have answered well within it
COLLECTIVE_S = 25    # PS_COLLECTIVE_TIMEOUT_S: a rank left waiting in a collective shows past UPDATE_S
FORBIDDEN_URL = "http://192.0.2.7:8000/collective_rpc"   # not loopback: outside the default policy


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("agree"))
    w = ServiceWorld(2, tmp, extra=["--max-bucket-gib", "0.00005"], env={"PS_COLLECTIVE_TIMEOUT_S": str(COLLECTIVE_S)},
                     rank_env={1: {"CKPT_SLICES": "0"}})   # the operator turned slices off on rank 1 only
    front = HttpEngineFront(2)
    w.front, w.gen, w.count = front, torch.Generator().manual_seed(3301), 0
    yield w
    front.close()
    assert w.close() == [0, 0], "every rank stops cleanly: none is stuck in a collective"


def _registered(world) -> tuple[str, dict]:
    """A fresh checkpoint (one file per rank, fresh random data), registered and gathered everywhere."""
    world.count += 1
    name, paths, data = f"agree-{world.count}", [], {}
    for r in range(world.size):
        ts = {f"{name}.r{r}.{i}": fresh_tensor((211 + 53 * i,), FAULT_DTYPES[i % 4], world.gen) for i in range(6)}
        paths.append(os.path.join(world.tmp, f"{name}-{r}.safetensors"))
        write_file(paths[-1], ts)
        data.update(ts)
    got = world.all("POST", f"/v1/checkpoints/{name}/files", [{"files": [p]} for p in paths])
    assert [r.status_code for r in got] == [200, 200], [r.text for r in got]
    got = world.all("POST", f"/v1/checkpoints/{name}/gather-metas")
    assert [r.status_code for r in got] == [200, 200], [r.text for r in got]
    return name, want_digests(data)


def _held(world) -> list[dict]:
    return [world.front.engine.digests(i) for i in range(world.size)]


def _refused_alike(world, got, code: int, kind: str, needle: str, held: list, requests: int) -> None:
    """Every rank: the same status and type, the needle in its message, answered within the update's
    timeout; nothing was posted to the engine and its workers hold what they held; every rank healthy."""
    for r, resp in enumerate(got):
        err = resp.json()["error"]
        assert (resp.status_code, err["type"]) == (code, kind), f"rank {r}: {resp.status_code} {resp.text[:600]}"
        assert needle in err["message"], f"rank {r}: {err['message'][:600]}"
        assert resp.elapsed.total_seconds() < UPDATE_S, f"rank {r} answered after {resp.elapsed}"
    assert world.front.requests == requests and _held(world) == held, "nothing reached an engine"
    assert [c.get("/v1/healthz").status_code for c in world.clients] == [200, 200]


def _next_update_is_exact(world, name: str, want: dict) -> None:
    bodies = [{"timeout": UPDATE_S, "update_url": world.front.url}, {"timeout": UPDATE_S}]
    got = world.all("POST", f"/v1/checkpoints/{name}/update", bodies)
    assert [r.status_code for r in got] == [200, 200], [r.text[:600] for r in got]
    held = {k: v for d in _held(world) for k, v in d.items()}
    assert all(held.get(k) == v for k, v in want.items()), "every engine worker holds exactly the registered bytes"


URL = "{url}"
CASES = [   # (rank 0's request, rank 1's request, status, type, in every rank's message)
    ({"update_url": FORBIDDEN_URL}, {}, 403, "Forbidden", "loopback engine"),
    ({"update_url": FORBIDDEN_URL, "stage": "v1"}, {}, 403, "Forbidden", "loopback engine"),
    ({"update_url": URL, "uds": "/tmp/not-an-engine.sock"}, {}, 403, "Forbidden", "--engine-uds"),
    ({"update_url": URL, "weight_version": "v1"}, {}, 422, "ValidationError", "weight_version"),
    ({"update_url": URL}, {"timeout": -1}, 422, "ValidationError", "refused on rank(s) [1]: invalid request: body.timeout"),
    ({"update_url": URL, "inference_group_ranks": [5]}, {}, 400, "ConfigError", "outside this world"),
    ({"update_url": URL, "slices": True}, {}, 400, "ConfigError", "disagree on slices (rank 0 True, rank 1 False)"),
    ({"update_url": URL, "slices": True}, {"slices": True}, 400, "ConfigError",
     "CKPT_SLICES=0 turns them off on rank(s) [1]"),
]


@pytest.mark.parametrize("first, second, code, kind, needle", CASES,
                         ids=["engine-url", "stage-engine-url", "engine-uds", "422-rank0", "422-rank1",
                              "group-ranks", "slices-differ", "ckpt-slices-0"])
def test_what_one_rank_refuses_every_rank_answers_and_the_next_update_is_exact(world, first, second, code, kind,
                                                                             needle):
    name, want = _registered(world)
    held, requests = _held(world), world.front.requests
    bodies = [{k: (world.front.url if v == URL else v) for k, v in dict({"timeout": UPDATE_S}, **b).items()}
              for b in (first, second)]
    got = world.all("POST", f"/v1/checkpoints/{name}/update", bodies)
    _refused_alike(world, got, code, kind, needle, held, requests)
    _next_update_is_exact(world, name, want)


def test_ranks_asked_for_different_operations_refuse_alike_and_the_next_update_is_exact(world):
    """Rank 0 is asked to gather, rank 1 to update, the same checkpoint: two collectives that would
    pair their first exchanges (one rank raised a raw KeyError, 500, the other a ConfigError)."""
    name, want = _registered(world)
    held, requests = _held(world), world.front.requests
    paths = [f"/v1/checkpoints/{name}/gather-metas", f"/v1/checkpoints/{name}/update"]
    with_body = [None, {"timeout": UPDATE_S, "update_url": world.front.url}]
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda r: world.clients[r].post(paths[r], json=with_body[r]), range(2)))
    needle = "ranks disagree on the operation (rank 0 'gather', rank 1 'update')"
    _refused_alike(world, got, 400, "ConfigError", needle, held, requests)
    _next_update_is_exact(world, name, want)
