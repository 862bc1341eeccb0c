"""Several engines fed by one PS world: 4 PS ranks, two engine instances of 2 workers each on one
host, each reachable only through its own Unix socket that only its group's ranks are told about.
The first rank of each inference group posts its group's handles (the reference's examples/update.py)."""

from __future__ import annotations

import uuid

import pytest

from support.engine import EngineFront
from support.world import FreshCheckpoints, PsWorld
from ckpt_core import ConfigError, local_device_key

IPS = 2   # devices per engine instance


def test_cpu_device_keys_follow_PS_CPU_VISIBLE_DEVICES(monkeypatch):
    plain = [local_device_key("cpu", i) for i in range(4)]
    monkeypatch.setenv("PS_CPU_VISIBLE_DEVICES", "2,3")
    assert [local_device_key("cpu", i) for i in range(2)] == plain[2:]
    with pytest.raises(ConfigError, match="cpu device 2 is not visible"):
        local_device_key("cpu", 2)
    monkeypatch.setenv("PS_CPU_VISIBLE_DEVICES", "1,x")
    with pytest.raises(ConfigError, match="PS_CPU_VISIBLE_DEVICES"):
        local_device_key("cpu", 0)


def test_four_ranks_feed_two_engines_each_through_its_own_unix_socket_twice(tmp_path):
    socks = [str(tmp_path / f"engine{g}-{uuid.uuid4().hex[:6]}.sock") for g in range(2)]
    # The second engine numbers its workers 0 and 1, like a second vLLM on GPUs 2,3 with
    # CUDA_VISIBLE_DEVICES=2,3; PS_CPU_VISIBLE_DEVICES is the cpu kind's equivalent.
    fronts = [EngineFront("cpu", IPS, uds=socks[0]),
              EngineFront("cpu", IPS, uds=socks[1], env={"PS_CPU_VISIBLE_DEVICES": "2,3"})]
    try:
        with PsWorld("cpu", 2 * IPS, init={"max_bucket_gb": 0.00002}) as ps:
            keys = ps.device_uuids
            ckpts = FreshCheckpoints(ps, seed=4242)
            for round_ in range(2):
                name, want = ckpts.new(f"round{round_}")
                per_rank = {r: (name, socks[r // IPS], IPS, 30) for r in range(ps.size)}
                got = ps.all("update_group", per_rank=per_rank, timeout=120)
                assert all(o.ok for o in got.values()), got
                assert all(o.value["buckets"] > 1 for o in got.values()), "the case must span several buckets"
                for g, front in enumerate(fronts):
                    assert front.requests[-1] == sorted(keys[g * IPS:(g + 1) * IPS]), \
                        f"engine {g} must be asked by its own group's first rank, with its group's handles only"
                    assert len(front.requests) == round_ + 1, f"engine {g} was asked more than once per update"
                    for i in range(IPS):
                        assert front.digests(i) == want, f"engine {g} worker {i} after round {round_}"
    finally:
        for f in fronts:
            f.close()
