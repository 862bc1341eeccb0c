"""verl's checkpoint-engine seam drives ckpt-engine (backend ``ckpt``, ``custom_backend_module=ckpt_verl``).

Real processes under verl 0.9.1 (``CKPT_VERL_PYTHON``, scripts/verl_env.sh): two trainer processes
(the actor group; the backend built as verl's actor worker builds it) and one rollout replica of
two processes (verl's own ``CheckpointEngineWorker``, loading into a live tiny Qwen2), driven in
the order verl's ``CheckpointEngineManager`` drives them (verl_support/world.py). The world is
shared by the tests of this module; each fault test leaves it healthy (its last round bit-exact).
"""

from __future__ import annotations

import os

import pytest

from support.asserts import report_case
from verl_support.world import VerlWorld, wait_for

pytest.importorskip("mooncake.engine", reason="ckpt's verl backend reads over Mooncake (the p2p extra)")
pytestmark = pytest.mark.slow

TIMEOUT_S = 30.0                 # the backend's timeout_s: bound of every wait of a round
COLLECTIVE_S = 8.0               # PS_COLLECTIVE_TIMEOUT_S of every PS rank
SLOW = {"sleep_s": 0.03, "after": 12}   # rollouts load slowly; the mark comes a dozen tensors into the round


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    if not os.environ.get("CKPT_VERL_PYTHON"):
        pytest.skip("verl tests need CKPT_VERL_PYTHON (the python of the venv made by scripts/verl_env.sh)")
    w = VerlWorld(tmp_path_factory.mktemp("verl"), env={"PS_COLLECTIVE_TIMEOUT_S": str(COLLECTIVE_S)},
                  engine_kwargs={"timeout_s": TIMEOUT_S})
    yield w
    w.close()


def assert_bit_exact(got: dict, before: dict | None = None) -> dict:
    """Every worker answered; every rollout now holds exactly the trainers' tensors, byte for byte."""
    replies = got["trainer"] + got["rollout"]
    assert all(r.ok for r in replies), [r.traceback or r.message for r in replies if not r.ok]
    want = got["trainer"][0].value["digests"]
    assert all(r.value["digests"] == want for r in got["trainer"]), "the trainer ranks built different weights"
    for r in got["rollout"]:
        assert r.value["digests"] == want, "a rollout does not hold exactly the trainers' weights"
        assert r.value["result"]["p2p"] is True, r.value["result"]
    if before is not None:
        assert all(want[n] != before[n] for n in want), "a round sent weights the rollouts held already"
    return want


def assert_every_side_typed(got: dict, what: str) -> None:
    for side in ("trainer", "rollout"):
        for i, r in enumerate(got[side]):
            assert r.typed(), f"{what}: not a typed ckpt_core error: {r.error}: {r.message}\n{r.traceback}"
            # the promise: within the round's timeout (the trainers' own wait would end 10 s past it)
            assert r.seconds < TIMEOUT_S, f"{what}: {side} {i} answered after {r.seconds:.0f} s, past the timeout"
            report_case(f"verl: {what}", f"surviving {side} #{i}: {r.error}: {r.message.splitlines()[0][:110]}", r.seconds)


def test_verl_loads_ckpt_through_custom_backend_module_and_three_rounds_arrive_bit_exact(world):
    before = None
    for seed in (11, 12, 13):
        got = world.round(seed)
        before = assert_bit_exact(got, before)
        assert got["trainer"][0].value["metrics"]["ckpt_engine/rank_bytes"] > 0


def test_a_trainer_refusing_its_share_fails_every_side_alike_and_the_next_round_works(world):
    got = world.round(21, bad="duplicate")   # trainer rank 1's generator names a tensor twice
    replies = got["trainer"] + got["rollout"]
    assert_every_side_typed(got, "a refused share")
    assert {r.error for r in replies} == {"CheckpointNotFoundError"}, [(r.error, r.message) for r in replies]
    assert "name this tensor twice" in got["trainer"][1].traceback   # the cause, on the rank that refused
    assert all(r.message.startswith("trainer rank 0: ") for r in got["rollout"])   # told, not timed out
    assert_bit_exact(world.round(22))


def test_a_trainer_killed_mid_transfer_gives_every_side_a_typed_error_and_new_trainers_deliver(world):
    mark = world.tmp / "trainer-kill-mark"
    world.start_round(31, slow=dict(SLOW, mark=str(mark)))
    wait_for(mark, 120, "the rollouts' load reaching a dozen tensors")
    world.trainers[0].kill()   # the master: an owner of half the weights, and the store's server
    got = world.finish_round(timeout=TIMEOUT_S + 60, procs=world.trainers[1:] + world.rollouts)
    assert_every_side_typed(got, "trainer 0 killed mid-transfer")
    world.new_trainers(2)   # verl restarts its actor group; the rollout workers stay as they are
    assert_bit_exact(world.round(32))


def test_a_rollout_killed_mid_transfer_gives_every_side_a_typed_error_and_new_rollouts_deliver(world):
    mark = world.tmp / "rollout-kill-mark"
    world.start_round(41, slow=dict(SLOW, mark=str(mark)))
    wait_for(mark, 120, "the rollouts' load reaching a dozen tensors")
    world.rollouts[1].kill()
    got = world.finish_round(timeout=TIMEOUT_S + 60, procs=world.trainers + world.rollouts[:1])
    assert_every_side_typed(got, "rollout 1 killed mid-transfer")
    assert all(r.message.startswith("rollout worker 0: ") for r in got["trainer"])   # the survivor told them
    world.new_rollouts(2)   # a new replica; the trainer workers stay as they are
    assert_bit_exact(world.round(42))
