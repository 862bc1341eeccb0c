"""ckpt_core.client.ServiceWorld drives a real 2-rank `ckpt-engine serve` world: every call reaches
every rank at once, results come back per rank, and every refusal is one of ckpt_core's types naming
each rank that answered it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
from support.data import FAULT_DTYPES, fresh_tensor, want_digests  # noqa: E402
from support.service_world import HttpEngineFront  # noqa: E402
from support.service_world import ServiceWorld as Processes  # noqa: E402

from ckpt_core import CheckpointNotFoundError, ClosedError, ConfigError, TransportError  # noqa: E402
from ckpt_core.checkpoint.safetensors import write_file  # noqa: E402
from ckpt_core.client import ServiceWorld  # noqa: E402


@pytest.fixture(scope="module")
def procs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("client"))
    w = Processes(2, tmp, env={"PS_MAX_BUCKET_SIZE_GB": "0.0001"})
    w.front, w.gen = HttpEngineFront(2), torch.Generator().manual_seed(3303)
    yield w
    w.front.close()
    assert w.close() == [0, 0]


@pytest.fixture
def world(procs):
    with ServiceWorld.from_template(os.path.join(procs.tmp, "ps-{rank}.sock"), 2, timeout=60) as w:
        yield w


def _checkpoint(procs, name: str) -> tuple[str, dict]:
    d = Path(procs.tmp) / name
    d.mkdir()
    data = {}
    for f in range(3):
        ts = {f"{name}.l{f}.w{i}": fresh_tensor((1500 + 97 * i,), FAULT_DTYPES[(f + i) % 4], procs.gen) for i in range(3)}
        write_file(d / f"model-{f:05d}.safetensors", ts)
        data.update(ts)
    return str(d), want_digests(data)


def _held(procs) -> dict:
    held = {}
    for i in range(procs.size):
        held.update(procs.front.engine.digests(i))
    return held


def test_register_gather_update_reach_every_rank_and_the_engine_holds_the_checkpoint(procs, world):
    directory, digests = _checkpoint(procs, "c1")
    world.register("c1", directory)
    assert world.checkpoints() == {"c1"}
    assert all(s["checkpoints"] == ["c1"] for s in world.status())
    world.gather_metas("c1")
    result = world.update("c1", update_url=procs.front.url, timeout=60)
    assert result["bytes"] > 0 and result["seconds"]["total"] > 0
    held = _held(procs)
    assert all(held.get(k) == v for k, v in digests.items())
    world.unregister("c1")
    world.unregister("c1", missing_ok=True)   # held by no rank now: fine when asked so
    with pytest.raises(CheckpointNotFoundError, match=r"rank 0: 404 .*rank 1: 404"):
        world.unregister("c1")
    assert world.checkpoints() == set()


def test_a_refused_request_raises_config_error_naming_every_rank_and_the_world_stays_usable(procs, world):
    with pytest.raises(ConfigError) as info:
        world.register("bad", [["/etc/hostname"], ["/etc/hostname"]])
    assert sorted(info.value.ranks) == [0, 1] and {e["status"] for e in info.value.ranks.values()} == {403}
    assert "rank 0: 403" in str(info.value) and "rank 1: 403" in str(info.value)
    with pytest.raises(ConfigError, match="invalid request"):   # a 422 of the service's validation
        world.update("bad", update_url=procs.front.url, timeout=-1)
    assert world.problems() == {}
    directory, digests = _checkpoint(procs, "c2")
    world.register("c2", directory)
    world.gather_metas("c2")
    world.update("c2", update_url=procs.front.url, timeout=60)
    assert all(_held(procs).get(k) == v for k, v in digests.items())
    world.unregister("c2")


def test_an_unreachable_rank_is_a_transport_error_naming_its_endpoint(procs, tmp_path):
    gone = str(tmp_path / "nobody.sock")
    with ServiceWorld([os.path.join(procs.tmp, "ps-0.sock"), gone], timeout=5) as w:
        with pytest.raises(TransportError, match=f"rank 1 \\({gone}\\) unreachable"):
            w.status()
        assert 1 in w.problems() and 0 not in w.problems()
        with pytest.raises(TransportError, match="rank 1"):
            w.check_healthy()


def test_bad_arguments_and_use_after_close_are_refused(procs):
    with pytest.raises(ConfigError):
        ServiceWorld([])
    with pytest.raises(ConfigError):
        ServiceWorld(["relative.sock"])
    with pytest.raises(ConfigError):
        ServiceWorld.from_template("/run/ps.sock", 2)
    w = ServiceWorld.from_template(os.path.join(procs.tmp, "ps-{rank}.sock"), 2)
    with pytest.raises(ConfigError, match="3 file lists for 2 ranks"):
        w.register("x", [["a"], ["b"], ["c"]])
    w.close()
    w.close()   # idempotent
    with pytest.raises(ClosedError):
        w.gather_metas("x")
