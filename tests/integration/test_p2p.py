"""P2P updates over Mooncake's real TCP transport on loopback: real PS processes, real engine workers."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from harness import EngineFront, FreshCheckpoints, PsWorld, assert_every_rank_failed

mooncake = pytest.importorskip("mooncake.engine", reason="Mooncake (the p2p extra) is not installed: "
                               "scripts/test.sh installs mooncake-transfer-engine-non-cuda and libibverbs1")

OWNERS = {"PS_P2P_HOST": "127.0.0.2"}
JOINERS = {"PS_P2P_HOST": "127.0.0.3"}
SMALL = {"max_bucket_gb": 0.00005}   # ~52 KiB buckets: every update spans many buckets


def call(world, fn, *args, ranks=None, timeout=120):
    return world.all("call", ("p2p_cases", fn, args), ranks=ranks, timeout=timeout)


def all_ok(got):
    assert all(o.ok for o in got.values()), got
    return got


def test_p2p_into_every_subset_of_targets_is_bit_exact_and_leaves_the_others_alone():
    with PsWorld("cpu", 2, init=SMALL, env=OWNERS) as w:
        ck = FreshCheckpoints(w, seed=11)
        name, want = ck.new()
        for targets in ([0], [1], [0, 1]):
            front = EngineFront("cpu", len(targets), devices=targets)
            try:
                got = all_ok(call(w, "p2p_update", name, front.address, 60, targets))
                for r in range(2):
                    assert got[r].value["target"] == (r in targets), got[r]
                for i in range(len(targets)):
                    assert front.digests(i) == want, f"targets {targets}: worker {i}"
                for r in set(range(2)) - set(targets):
                    assert w.all("ipc_buffer", ranks=[r])[r].value is None, "a non-target allocated a buffer"
                assert all(got[r].value["buckets"] >= 2 for r in targets), "the case must span several buckets"
            finally:
                front.close()


def owners_with(w, n=1, **kw):
    ck = FreshCheckpoints(w, seed=23, **kw)
    return ck, [ck.new() for _ in range(n)]


def test_a_separate_joiner_world_pulls_through_a_saved_metas_file_across_two_simulated_hosts(tmp_path):
    path = str(tmp_path / "metas.json")
    with PsWorld("cpu", 2, init=SMALL, env=OWNERS) as owners:
        _, [(name, want)] = owners_with(owners)
        all_ok(call(owners, "save_metas", path, ranks=[0]))
        import json
        doc = json.load(open(path))
        assert doc["format"] == "ckpt-engine/metas" and doc["version"] == 1
        addrs = [o["p2p"]["address"] for o in doc["checkpoints"][name]["owners"]]
        assert all(a.startswith("127.0.0.2:") for a in addrs) and len(set(addrs)) == 2, addrs
        with PsWorld("cpu", 2, init=SMALL, env=JOINERS) as joiners:
            all_ok(call(joiners, "load_metas", path))
            front = EngineFront("cpu", 2)
            try:
                got = all_ok(call(joiners, "p2p_update", name, front.address, 60, [0, 1]))
                assert sum(got[r].value["read_bytes"] for r in range(2)) == got[0].value["bytes"]
                for i in range(2):
                    assert front.digests(i) == want
                info = all_ok(call(joiners, "p2p_info"))
                assert all(info[r].value["address"].startswith("127.0.0.3:") for r in range(2)), info
                assert all(info[r].value["registered"] == 0 for r in range(2)), "staging stays registered"
            finally:
                front.close()


def test_a_pickled_foreign_or_malformed_metas_file_is_a_config_error(tmp_path):
    import pickle
    bad = {"pickled.bin": pickle.dumps({"x": 1}), "foreign.json": b'{"format": "other", "version": 1}',
           "future.json": b'{"format": "ckpt-engine/metas", "version": 99}',
           "outside.json": (b'{"format": "ckpt-engine/metas", "version": 1, "checkpoints": {"c": {"owners": '
                            b'[{"rank": 0, "p2p": {"address": "h:1", "host": "h", "nic": null, "regions": '
                            b'{"0": [4096, 8]}}, "tensors": [["w", "F32", [4], 16, 4, 0, 0]]}]}}}')}
    with PsWorld("cpu", 1, env=JOINERS) as w:
        for fname, raw in bad.items():
            (tmp_path / fname).write_bytes(raw)
            got = call(w, "load_metas", str(tmp_path / fname))
            assert not got[0].ok and got[0].error == "ConfigError", (fname, got)
        assert "pickled" in call(w, "load_metas", str(tmp_path / "pickled.bin"))[0].message
        assert "outside the region" in call(w, "load_metas", str(tmp_path / "outside.json"))[0].message


def test_an_owner_killed_mid_transfer_fails_every_target_naming_it_and_engines_keep_their_weights(tmp_path):
    with PsWorld("cpu", 2, init=SMALL, env=OWNERS) as owners:
        _, [(first, want), (second, _)] = owners_with(owners, 2, per_rank=12)
        all_ok(call(owners, "save_metas", str(tmp_path / "m.json"), ranks=[0]))
        with PsWorld("cpu", 2, init=SMALL, env=JOINERS) as joiners:
            all_ok(call(joiners, "load_metas", str(tmp_path / "m.json")))
            front = EngineFront("cpu", 2)
            try:
                all_ok(call(joiners, "p2p_update", first, front.address, 60, [0, 1]))
                slow = {i: {"sleep_s": 0.3, "mark_dir": str(tmp_path)} for i in range(2)}
                joiners.send("call", ("p2p_cases", "p2p_update", (second, front.address, 60, [0, 1], slow)))
                import time
                t0 = time.monotonic()
                while not os.path.exists(tmp_path / "w0-b1"):
                    assert time.monotonic() - t0 < 60, "the slow update never reached its second bucket"
                    time.sleep(0.01)
                owners.kill(1)
                got = joiners.collect(timeout=90)
                assert_every_rank_failed(got, "TransportError", "owner rank 1 at 127.0.0.2:", "P2P read")
                for i in range(2):
                    assert front.digests(i) == want, "an engine kept part of the failed update"
                again = call(joiners, "p2p_update", first, front.address, 60, [0, 1])
                assert_every_rank_failed(again, "TransportError", "owner rank 1 at 127.0.0.2:")
            finally:
                front.close()


def test_without_mooncake_broadcast_works_and_p2p_is_a_config_error_naming_the_extra():
    with PsWorld("cpu", 2, init=SMALL) as w:
        all_ok(call(w, "hide_mooncake"))
        ck = FreshCheckpoints(w, seed=5)
        name, want = ck.new()
        front = EngineFront("cpu", 2)
        try:
            assert all(o.ok for o in w.update(name, front).values())
            assert front.digests(0) == want and front.digests(1) == want
            got = call(w, "p2p_update", name, front.address, 30, [1])
            assert_every_rank_failed(got, "ConfigError", "'p2p' extra")
            assert all(o.ok for o in w.update(name, front).values()), "the world stays usable"
        finally:
            front.close()


def test_twenty_alternating_broadcast_and_p2p_updates_keep_memory_flat():
    from harness import process_footprint, shm_footprint
    with PsWorld("cpu", 2, init=SMALL, env=OWNERS) as w:
        ck = FreshCheckpoints(w, seed=99, per_rank=8)
        name, want = ck.new()
        every, one = EngineFront("cpu", 2), EngineFront("cpu", 1, devices=[1])
        try:
            marks = {}
            for k in range(20):
                got = (w.update(name, every) if k % 2 == 0 else call(w, "p2p_update", name, one.address, 60, [1]))
                assert all(o.ok for o in got.values()), (k, got)
                if k in (3, 19):
                    marks[k] = ([process_footprint(p) for p in w.pids], shm_footprint()["ipc_buffers"],
                                [o.value for o in call(w, "p2p_info").values()])
            assert every.digests(0) == want and every.digests(1) == want and one.digests(0) == want
            (fp3, shm3, info3), (fp19, shm19, info19) = marks[3], marks[19]
            for a, b in zip(fp3, fp19):
                assert b["rss"] - a["rss"] < 64 << 20, (a, b)
                assert b["fds"] <= a["fds"] + 4 and b["threads"] <= a["threads"] + 2, (a, b)
            assert shm19 <= shm3, "IPC buffers accumulate"
            assert [i["registered"] for i in info19] == [i["registered"] for i in info3], (info3, info19)
        finally:
            every.close()
            one.close()
