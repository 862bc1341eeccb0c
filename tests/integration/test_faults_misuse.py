"""API misuse in a real PS world: each mistake is a typed error that names the checkpoint,
the world stays usable, and the next genuine update leaves exactly the new weights."""

from __future__ import annotations

import pytest
import torch

from support.asserts import assert_every_rank_failed, report_case
from support.engine import EngineFront
from support.world import FreshCheckpoints, PsWorld

INIT = {"max_bucket_gb": (16 << 10) / (1 << 30)}


@pytest.fixture(scope="module")
def world():
    front = EngineFront("cpu", 2)
    ps = PsWorld("cpu", 2, init=INIT)
    try:
        yield ps, front, FreshCheckpoints(ps, seed=7)
    finally:
        ps.close()
        front.close()


def assert_all(got, error: str, *needles: str) -> float:
    """support.asserts.assert_every_rank_failed; returns the slowest rank's seconds."""
    return max(o.seconds for o in assert_every_rank_failed(got, error, *needles).values())


def assert_world_still_delivers(ps, front, ckpts) -> None:
    name, want = ckpts.new("genuine")
    got = ps.update(name, front, 30)
    assert all(o.ok for o in got.values()), got
    for i in range(ps.size):
        assert front.digests(i) == want
    ckpts.drop(name)


def test_update_before_gather_metas_is_a_config_error_on_every_rank(world):
    ps, front, ckpts = world
    data = {r: {f"early{r}": torch.randn(64)} for r in range(2)}
    assert all(o.ok for o in ps.all("register", per_rank={r: ("early", {"named_tensors": data[r]})
                                                          for r in range(2)}).values())
    dt = assert_all(ps.update("early", front, 10), "ConfigError", "gather_metas('early')")
    report_case("update before gather_metas", "ConfigError naming the checkpoint, every rank", dt)
    assert all(o.ok for o in ps.all("unregister", ("early", {})).values())
    assert_world_still_delivers(ps, front, ckpts)


def test_update_of_an_unknown_checkpoint_is_checkpoint_not_found_on_every_rank(world):
    ps, front, ckpts = world
    got = ps.update("no-such-ckpt", front, 10)
    report_case("update of an unknown checkpoint", f"{got[0].error}: {got[0].message[:60]}", got[0].seconds)
    assert_all(got, "CheckpointNotFoundError", "'no-such-ckpt'", "not registered")


def test_gather_metas_of_a_checkpoint_missing_on_one_rank_names_that_rank_on_every_rank(world):
    ps, front, ckpts = world
    dt = assert_all(ps.all("gather", "nowhere"), "CheckpointNotFoundError", "'nowhere'", "rank(s) [0, 1]")
    report_case("gather_metas of an unknown checkpoint", "CheckpointNotFoundError naming ranks [0, 1]", dt)
    assert ps.all("register", ("half", {"named_tensors": {"h": torch.randn(8)}}), ranks=[0])[0].ok
    dt = assert_all(ps.all("gather", "half"), "CheckpointNotFoundError", "'half'", "rank(s) [1]")
    report_case("gather_metas of a checkpoint registered on rank 0 only", "CheckpointNotFoundError naming rank 1", dt)
    assert ps.all("unregister", ("half", {}), ranks=[0])[0].ok
    assert_world_still_delivers(ps, front, ckpts)


def test_registering_a_name_twice_is_a_config_error_and_keeps_the_first(world):
    ps, front, ckpts = world
    name, want = ckpts.new("twice")
    got = ps.all("register", (name, {"named_tensors": {"other": torch.randn(8)}}))
    dt = assert_all(got, "ConfigError", repr(name), "already registered")
    report_case("register_checkpoint of a name already registered", "ConfigError", dt)
    got = ps.update(name, front, 30)                  # the first registration is intact
    assert all(o.ok for o in got.values()), got
    assert all(front.digests(i) == want for i in range(2))
    ckpts.drop(name)


def test_unregistering_an_unknown_name_is_checkpoint_not_found(world):
    ps, front, ckpts = world
    dt = assert_all(ps.all("unregister", ("ghost", {})), "CheckpointNotFoundError", "'ghost'", "not registered")
    report_case("unregister_checkpoint of an unknown name", "CheckpointNotFoundError", dt)
    assert_world_still_delivers(ps, front, ckpts)


def test_a_non_positive_timeout_is_a_config_error(world):
    ps, front, ckpts = world
    name, want = ckpts.new("timeout0")
    dt = assert_all(ps.update(name, front, 0), "ConfigError", "timeout")
    report_case("update with timeout=0", "ConfigError", dt)
    got = ps.update(name, front, 30)
    assert all(o.ok for o in got.values()) and all(front.digests(i) == want for i in range(2)), got
    ckpts.drop(name)


@pytest.mark.parametrize("refuse_on", [0, 1], ids=["the-posting-rank", "another-rank"])
def test_a_req_funcs_precheck_refuses_the_update_on_every_rank_before_any_engine_is_asked(world, refuse_on):
    """An engine adapter's refusal (``req_func.precheck()``: SGLang cannot reload FP8 per tensor) is
    asked before the update's first exchange: one ConfigError on every rank, no engine posted to,
    the world usable."""
    ps, front, ckpts = world
    name, _ = ckpts.new("prechecked")
    posted = len(front.requests)
    got = ps.all("call", ("support.ps_fault_cases", "update_refused_by_precheck", (name, front.address, 30, refuse_on)))
    dt = assert_all(got, "ConfigError", f"refused on rank(s) [{refuse_on}]", "cannot load the checkpoint in place")
    assert len(front.requests) == posted, "refused before anything moved: no engine was asked"
    report_case("req_func.precheck refuses", "ConfigError naming the rank, every rank, no engine asked", dt)
    ckpts.drop(name)
    assert_world_still_delivers(ps, front, ckpts)


def test_a_second_update_while_one_runs_is_a_config_error_and_the_first_completes(world):
    ps, front, ckpts = world
    name, want = ckpts.new("concurrent")
    slow = {i: {"sleep_s": 0.2} for i in range(2)}        # keeps the first update busy for a while
    got = ps.all("two_updates_at_once", (name, front.address, 30.0, slow), timeout=90)
    for r, o in got.items():
        assert o.ok, (r, o)
        assert o.value["second"].startswith("ConfigError") and "already running" in o.value["second"], (r, o)
        assert o.value["first"] == "ok", (r, o)
    report_case("two updates at once", "second: ConfigError 'already running'; first completes", None)
    assert all(front.digests(i) == want for i in range(2))
    ckpts.drop(name)


def test_every_call_after_close_is_a_closed_error_and_close_is_idempotent(world):
    """Runs last in this module: it closes the world's ParameterServers."""
    ps, front, ckpts = world
    name, _ = ckpts.new("closing")
    assert all(o.ok for o in ps.all("close").values())
    assert all(o.ok for o in ps.all("close").values()), "close() twice"
    for cmd, arg in [("register", ("x", {"named_tensors": {"x": torch.randn(4)}})), ("gather", name),
                     ("unregister", (name, {}))]:
        assert_all(ps.all(cmd, arg), "ClosedError", "closed")
    dt = assert_all(ps.update(name, front, 10), "ClosedError", "closed")
    report_case("register/gather/update/unregister after close", "ClosedError", dt)
