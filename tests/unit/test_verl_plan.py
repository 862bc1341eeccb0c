"""The verl backend's pure parts and its store channel, without verl (ckpt_verl._plan, ckpt_verl._rendezvous)."""

from __future__ import annotations

import asyncio
import json
import re
import time

import pytest
import torch

from ckpt_core.errors import (CheckpointFormatError, CheckpointNotFoundError, ConfigError, RemoteWorkerError,
                              TransportError, UpdateTimeoutError)
from ckpt_verl._plan import take_share, topology
from ckpt_verl._rendezvous import Rendezvous, decode_error, encode_error

MASTER = {"addr": "10.0.0.1", "port": 4567, "round": "r1"}


def metadata(trainers: int, rollouts: int) -> list:
    return [{"backend": "ckpt", "master": dict(MASTER)}] + [{"backend": "ckpt"}] * (trainers + rollouts - 1)


def test_topology_numbers_each_side_from_zero_and_hands_everyone_the_masters_store():
    actor, rollout = topology(2, 3, metadata(2, 3))
    assert actor == {"side": ["trainer"] * 2, "rank": [0, 1], "trainers": [2, 2], "rollouts": [3, 3],
                     "master": [MASTER] * 2}
    assert rollout["side"] == ["rollout"] * 3 and rollout["rank"] == [0, 1, 2] and rollout["master"] == [MASTER] * 3
    json.dumps([actor, rollout])   # plain data: verl ships it to every worker


@pytest.mark.parametrize("meta, why", [
    (metadata(2, 2)[:3], "expected 2 + 2"),
    ([{"backend": "ckpt"}] * 4, "masters: []"),
    ([{"backend": "ckpt"}, {"master": MASTER}, {}, {}], "masters: [1]"),
    ([{"master": MASTER}, {"master": MASTER}, {}, {}], "masters: [0, 1]"),
    ([{"master": {"addr": "h", "port": "1", "round": "r"}}, {}, {}, {}], "lacks its store"),
])
def test_topology_refuses_metadata_without_exactly_one_master_at_trainer_rank_zero(meta, why):
    with pytest.raises(ConfigError, match=re.escape(why)):
        topology(2, 2, meta)


def named(n: int, seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(f"t{i}", torch.randn(3, i + 1, generator=gen)) for i in range(n)]


def share(weights, rank: int, ranks: int):
    return asyncio.run(take_share(weights, rank, ranks))


def test_each_tensor_is_kept_by_exactly_one_trainer_rank_with_its_bytes():
    items = named(7, seed=1)
    shares = [share(iter(items), r, 3) for r in range(3)]
    assert all(local is None for _, local in shares)
    kept = [name for mine, _ in shares for name in mine]
    assert sorted(kept) == sorted(n for n, _ in items) and len(kept) == len(set(kept))
    assert list(shares[1][0]) == ["t1", "t4"]
    for mine, _ in shares:
        for name, t in mine.items():
            assert torch.equal(t, dict(items)[name])


def test_an_async_generator_is_walked_too():
    items = named(4, seed=2)

    async def gen():
        for item in items:
            yield item
    mine, local = share(gen(), 0, 2)
    assert local is None and list(mine) == ["t0", "t2"]


@pytest.mark.parametrize("bad, error, text", [
    ("duplicate", CheckpointFormatError, "twice"),
    ("not a tensor", ConfigError, "(name, tensor) pairs"),
    ("raises", ConfigError, "generator raised RuntimeError: producer died"),
])
def test_a_bad_generator_is_a_local_typed_problem_and_the_walk_goes_on(bad, error, text):
    items = named(5, seed=3)
    walked = []

    def gen():
        for i, item in enumerate(items):
            walked.append(i)
            if bad == "duplicate" and i == 3:
                yield items[0]
            elif bad == "not a tensor" and i == 3:
                yield item[0], [1, 2]
            elif bad == "raises" and i == 3:
                raise RuntimeError("producer died")
            else:
                yield item
    mine, local = share(gen(), 0, 1)
    assert isinstance(local, error) and text in str(local), local
    if bad != "raises":   # the walk went on to the end: producing a weight is collective on verl's actor group
        assert walked == list(range(5))


def test_errors_cross_as_their_own_type_by_name_only():
    exc = decode_error(encode_error(CheckpointNotFoundError("checkpoint 'x' is not registered"), "trainer rank 0"))
    assert type(exc) is CheckpointNotFoundError and str(exc) == "trainer rank 0: checkpoint 'x' is not registered"
    exc = decode_error(encode_error(ValueError("boom"), "rollout worker 1"))
    assert type(exc) is RemoteWorkerError and "rollout worker 1: ValueError: boom" in str(exc)
    for hostile in ({"type": "SystemExit", "message": "m"}, {"type": "__class__"}, "not a dict"):
        assert type(decode_error(hostile)) is RemoteWorkerError


@pytest.fixture
def stores():
    server = Rendezvous("127.0.0.1", 0, serve=True, timeout_s=5)
    client = Rendezvous("127.0.0.1", server.port, serve=False, timeout_s=5)
    yield server, client


def test_metas_reach_the_rollout_and_a_trainer_failure_arrives_as_its_type(stores):
    server, client = stores
    server.publish_metas("r1", "verl-weights", {"version": 1})
    assert client.wait_metas("r1", 5) == ("verl-weights", {"version": 1})
    server.publish_trainer_error("r2", CheckpointFormatError("bad tensor"), "trainer rank 0")
    with pytest.raises(CheckpointFormatError, match="trainer rank 0: bad tensor"):
        client.wait_metas("r2", 5)


def test_trainers_wait_for_every_rollout_and_stop_at_the_first_reported_error(stores):
    server, client = stores
    client.report_done("r1")
    client.report_done("r1")
    server.wait_rollouts("r1", 2, 5)
    client.report_error("r2", TransportError("owner died"), "rollout worker 0")
    client.report_error("r2", UpdateTimeoutError("later"), "rollout worker 1")   # the first one is kept
    with pytest.raises(TransportError, match="rollout worker 0: owner died"):
        server.wait_rollouts("r2", 2, 5)


def test_every_wait_has_a_deadline_and_a_dead_server_is_a_transport_error(stores):
    server, client = stores
    t0 = time.monotonic()
    with pytest.raises(UpdateTimeoutError, match="1 of 1 rollout"):
        server.wait_rollouts("r9", 1, 0.3)
    with pytest.raises(UpdateTimeoutError, match="published no weights"):
        client.wait_metas("r9", 0.3)
    assert time.monotonic() - t0 < 5
    server._store = None   # the only reference: the server stops, as when trainer rank 0 dies
    import gc
    gc.collect()
    with pytest.raises(TransportError, match="did it die"):
        client.wait_metas("r9", 5)
