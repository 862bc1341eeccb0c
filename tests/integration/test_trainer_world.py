"""The trainer side of the ``ckpt`` vLLM backend on two trainer ranks, in real processes, on CPU.

Two trainer processes (each a PS rank, gloo) drive ``ckpt_vllm.trainer`` through vLLM's client
protocol into two real engine-worker processes (``support.engine.EngineFront``: the core's
receive loop, as vLLM's ``/update_weights`` runs it). Every round's weights are fresh; after each
the workers hold them bit for bit. What one rank or the sender's requests get wrong fails every
rank alike, before or during the update, and the next round works.
"""

from __future__ import annotations

import pytest

from support.engine import EngineFront
from support.trainer_ranks import SHAPES, run_trainer_world, want, weights_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture
def front():
    f = EngineFront("cpu", 2)
    try:
        yield f
    finally:
        f.close()


def _holds(front, seed: int) -> None:
    for i in range(2):
        assert front.digests(i) == want(seed), f"engine worker {i} does not hold the weights of seed {seed}"


def _same_failure(got: dict, index: int, error: str, *needles: str) -> None:
    for rank, results in got.items():
        r = results[index]
        assert not r["ok"] and r["error"] == error, f"rank {rank}, round {index}: {r}"
        for needle in needles:
            assert needle in r["message"], f"rank {rank}: {needle!r} not in {r['message'][:3000]!r}"


def test_three_rounds_of_fresh_replicated_weights_arrive_bit_exact_each_rank_registering_its_half(front):
    rounds = [("send", {"seed": s}) for s in (11, 12, 13)]
    got = run_trainer_world(2, front.address, rounds[:1])
    assert all(r[0]["ok"] for r in got.values()), got
    _holds(front, 11)
    got = run_trainer_world(2, front.address, rounds[1:])
    assert all(r[i]["ok"] for r in got.values() for i in (0, 1)), got
    _holds(front, 13)
    total = sum(t.numel() * t.element_size() for t in weights_of(13).values())
    assert got[0][1]["bytes"] == total
    assert 0 < got[0][1]["registered"] < total and got[0][1]["registered"] + got[1][1]["registered"] == total
    assert got[0][-1]["calls"] == ["init_weight_transfer_engine", "start_weight_update", "update_weights",
                                   "finish_weight_update step-1", "start_weight_update", "update_weights",
                                   "finish_weight_update step-2"]
    assert got[1][-1]["calls"] == []   # only rank 0 talks to the engine


def test_a_weight_source_split_by_held_names_arrives_whole(front):
    names = sorted(SHAPES)
    held = {0: names[: len(names) // 2], 1: names[len(names) // 2:]}
    got = run_trainer_world(2, front.address, [("send", {"seed": 21, "kind": "source", "held": held})])
    assert all(r[0]["ok"] for r in got.values()), got
    _holds(front, 21)


def test_a_hole_in_held_names_fails_every_rank_naming_the_tensor_and_nothing_moves(front):
    names = sorted(SHAPES)
    held = {0: names[:3], 1: names[4:]}   # names[3] is held by nobody
    got = run_trainer_world(2, front.address, [("send", {"seed": 31}),
                                               ("send", {"seed": 32, "kind": "source", "held": held}),
                                               ("send", {"seed": 33})])
    _same_failure(got, 1, "CheckpointFormatError", names[3], "held_names() must cover the model")
    assert all(r[0]["ok"] and r[2]["ok"] for r in got.values()), got
    _holds(front, 33)
    assert front.fanouts == 2   # the failed round reached no engine


def test_one_ranks_unreadable_weights_fail_every_rank_alike_before_any_engine_is_touched(front):
    got = run_trainer_world(2, front.address, [("send", {"seed": 41}), ("send", {"seed": 42, "bad_on_rank": 1}),
                                               ("send", {"seed": 43})])
    assert all(r[0]["ok"] and r[2]["ok"] for r in got.values()), got
    errors = {r[1]["error"] for r in got.values()}
    assert len(errors) == 1 and not got[0][1]["ok"], got   # the same type on both ranks
    assert "not a tensor" in got[1][1]["message"]
    assert front.fanouts == 2
    _holds(front, 43)


@pytest.mark.parametrize("method", ["init_weight_transfer_engine", "start_weight_update", "update_weights"])
def test_the_senders_failing_request_fails_every_rank_typed_and_the_next_round_works(front, method):
    got = run_trainer_world(2, front.address, [("send", {"seed": 51, "client_fails": method}), ("send", {"seed": 52})],
                            timeout_s=20)
    _same_failure(got, 0, "RemoteWorkerError", "req_func raised", "cannot reach FakeSyncClient", method)
    assert all(r[0]["seconds"] < 20 for r in got.values())
    assert all(r[1]["ok"] for r in got.values()), got
    _holds(front, 52)


def test_vllm_026s_factory_form_and_versionless_client_send_rounds_bit_exact(front):
    """vLLM 0.26 (tests/fakes/vllm026, its signatures): the factory is ``trainer_init(backend, config,
    init_info, ...)``, the engine's base class takes that config, and the client's
    ``finish_weight_update()`` takes no version; rounds still arrive whole, every rank alike."""
    got = run_trainer_world(2, front.address, [("send", {"seed": 61}), ("send", {"seed": 62})], vllm026=True)
    assert all(r[0]["ok"] and r[1]["ok"] for r in got.values()), got
    _holds(front, 62)
    assert "vllm.distributed.weight_transfer.base.TrainerWeightTransferEngine" in got[0][-1]["bases"]
    assert got[0][-1]["calls"] == ["init_weight_transfer_engine", "start_weight_update", "update_weights",
                                   "finish_weight_update", "start_weight_update", "update_weights",
                                   "finish_weight_update"]


def test_on_device_rounds_register_the_trainers_tensors_in_place_and_arrive_bit_exact(front):
    """``on_device=True`` (the cpu device stands in for the GPU): each rank's share is registered where
    it lies, no pinned pool, and every round arrives whole; auto (None) keeps CPU weights in the pool."""
    got = run_trainer_world(2, front.address, [("send", {"seed": 71}), ("send", {"seed": 72})],
                            info={"on_device": True})
    assert all(r[i]["ok"] and r[i]["on_device"] for r in got.values() for i in (0, 1)), got
    _holds(front, 72)
    got = run_trainer_world(2, front.address, [("send", {"seed": 73})])
    assert all(r[0]["ok"] and r[0]["on_device"] is False for r in got.values()), got
    _holds(front, 73)


def test_on_device_with_one_ranks_strided_tensor_fails_every_rank_alike_and_the_next_round_works(front):
    got = run_trainer_world(2, front.address, [("send", {"seed": 81, "strided_on_rank": 1}), ("send", {"seed": 82})],
                            info={"on_device": True})
    errors = {(r[0]["ok"], r[0].get("error")) for r in got.values()}
    assert errors == {(False, "CheckpointNotFoundError")}, got   # the same type on both ranks
    assert "not registered on rank(s) [1]" in got[0][0]["message"]
    assert "DeviceResidentError" in got[1][0]["message"] and "not contiguous" in got[1][0]["message"], got[1][0]
    assert front.fanouts == 1, "the failed round reached no engine (the next one did)"
    assert all(r[1]["ok"] for r in got.values()), got
    _holds(front, 82)
