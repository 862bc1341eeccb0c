"""P2P updates over Mooncake's real TCP transport on loopback: real PS processes, real engine workers."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from support import p2p_cases as cases
from support.asserts import assert_every_rank_failed
from support.engine import EngineFront
from support.procs import pythonpath
from support.world import FreshCheckpoints, PsWorld
from support.p2p_cases import JOINERS, OWNERS, SMALL, all_ok, call, owners_with

mooncake = pytest.importorskip("mooncake.engine", reason="Mooncake (the p2p extra) is not installed: "
                               "scripts/test.sh installs mooncake-transfer-engine-non-cuda and libibverbs1")


@pytest.mark.parametrize("world", [1, 2])
def test_p2p_into_every_subset_of_targets_is_bit_exact_and_leaves_the_others_alone(world):
    cases.case_every_subset("cpu", world)


def test_a_separate_joiner_world_pulls_through_a_saved_metas_file_across_two_simulated_hosts(tmp_path):
    cases.case_joiner_world("cpu", 2, tmp_path)


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


@contextlib.contextmanager
def joined_after_one_update(tmp_path, joiners_env=JOINERS):
    """2 owners (127.0.0.2) with 2 checkpoints; 2 joiners (127.0.0.3) that loaded the owners'
    metas and pulled the first into their 2 engine workers. Yields (owners, joiners, front,
    [(name, digests)] * 2)."""
    with PsWorld("cpu", 2, init=SMALL, env=OWNERS) as owners:
        _, ckpts = owners_with(owners, 2, per_rank=12)
        all_ok(call(owners, "save_metas", str(tmp_path / "m.json"), ranks=[0]))
        with PsWorld("cpu", 2, init=SMALL, env=joiners_env) as joiners:
            all_ok(call(joiners, "load_metas", str(tmp_path / "m.json")))
            front = EngineFront("cpu", 2)
            try:
                all_ok(call(joiners, "p2p_update", ckpts[0][0], front.address, 60, [0, 1]))
                yield owners, joiners, front, ckpts
            finally:
                front.close()


def test_an_owner_killed_mid_transfer_fails_every_target_naming_it_and_engines_keep_their_weights(tmp_path):
    with joined_after_one_update(tmp_path) as (owners, joiners, front, [(first, want), (second, _)]):
        slow = {i: {"sleep_s": 0.3, "mark_dir": str(tmp_path)} for i in range(2)}
        joiners.send("call", ("support.p2p_cases", "p2p_update", (second, front.address, 60, [0, 1], slow)))
        import time
        t0 = time.monotonic()
        while not os.path.exists(tmp_path / "w0-b1"):
            assert time.monotonic() - t0 < 60, "the slow update never reached its second bucket"
            time.sleep(0.01)
        owners.kill(1)
        got = joiners.collect(timeout=90)
        assert_every_rank_failed(got, "TransportError", "owner rank 1 at 127.0.0.2:", "P2P read")
        info = all_ok(call(joiners, "p2p_info"))
        assert sum(info[r].value["quarantined"] for r in range(2)) >= 1, "the failed read's buffer was reused"
        for i in range(2):
            assert front.digests(i) == want, "an engine kept part of the failed update"
        again = call(joiners, "p2p_update", first, front.address, 60, [0, 1])
        assert_every_rank_failed(again, "TransportError", "owner rank 1 at 127.0.0.2:")


@pytest.mark.parametrize("bound", ["mooncake", "deadline"])
def test_a_frozen_owner_fails_every_target_in_time_naming_it_and_once_thawed_serves_again(tmp_path, bound):
    """An owner stopped with SIGSTOP (its sockets still accept, nothing answers): the joiners'
    update ends on every rank within its timeout, naming owner rank 1 and its address; the engines
    keep their weights; once the owner runs again, the next update succeeds bit-exact.
    ``mooncake``: Mooncake's MC_TRANSFER_TIMEOUT (5 s) ends the read; ``deadline``: Mooncake's
    default (30 s) outlasts the update's 12 s, whose deadline abandons the read."""
    import signal
    import time
    # Mooncake's own per-transfer timeout (seconds)
    joiners_env = dict(JOINERS, MC_TRANSFER_TIMEOUT="5") if bound == "mooncake" else dict(JOINERS)
    timeout = 30 if bound == "mooncake" else 12
    with joined_after_one_update(tmp_path, joiners_env) as (owners, joiners, front, [(_, want), (second, want2)]):
        os.kill(owners.pids[1], signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            got = call(joiners, "p2p_update", second, front.address, timeout, [0, 1], timeout=120)
            took = time.monotonic() - t0
        finally:
            os.kill(owners.pids[1], signal.SIGCONT)
        assert all(not o.ok and o.error in ("TransportError", "UpdateTimeoutError") for o in got.values()), got
        assert all("owner rank 1 at 127.0.0.2:" in o.message for o in got.values()), got
        assert took < timeout + 60, f"the update's timeout bounds a frozen owner (generous ceiling): {took:.0f} s"
        print(f"frozen owner: every target failed after {took:.1f} s: {got[0].message[:300]}")
        for i in range(2):
            assert front.digests(i) == want, "an engine kept part of the failed update"
        all_ok(call(joiners, "p2p_update", second, front.address, 60, [0, 1]))
        for i in range(2):
            assert front.digests(i) == want2, "the thawed owner served the next update bit-exact"


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
    from support.procs import process_footprint, shm_footprint
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
                    marks[k] = ([process_footprint(p) for p in w.pids], shm_footprint(w.pids)["ipc_buffers"],
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


def test_the_p2p_benchmark_runs_verified_on_cpu_and_reports_the_ratio_to_its_ceiling(tmp_path):
    """No timing asserted: the benchmark works, verifies its first update bit-exact, and records its figures."""
    import json
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "p2p.json"
    env = {**os.environ, "PYTHONPATH": pythonpath(root), "NCCL_IB_DISABLE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "p2p_bench.py"), "--gib", "0.02",
                           "--tensor-mib", "1", "--repeats", "1", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "verified bit-exact" in proc.stdout
    rep = json.loads(out.read_text())
    assert rep["bytes"] == rep["ceiling"]["bytes"] > 0 and rep["p2p_gbps"] > 0 and rep["ratio"] > 0


def test_a_target_that_cannot_plan_fails_every_rank_at_once_not_at_the_collective_timeout():
    """Rank 1 (the only target) has no room for a bucket: rank 0, outside ranks, must not wait for it."""
    with PsWorld("cpu", 2, init={"mem_fraction": 1e-9}, env={**OWNERS, "PS_COLLECTIVE_TIMEOUT_S": "300"}) as w:
        _, [(name, _)] = owners_with(w)
        got = call(w, "p2p_update", name, None, 60, [1])
        assert not got[1].ok and got[1].error == "ConfigError" and "does not fit a bucket" in got[1].message, got
        assert not got[0].ok and got[0].error == "RemoteWorkerError" and "does not fit a bucket" in got[0].message
        assert max(o.seconds for o in got.values()) < 60, got   # far below PS_COLLECTIVE_TIMEOUT_S


def test_a_read_after_the_owner_replaced_its_checkpoint_in_place_is_refused_not_loaded():
    """Real Mooncake TCP between two stores: the owner re-fills the same memory with another
    checkpoint (a shared pool does that) between two reads; the second read must be refused."""
    import logging
    import time
    from ckpt_core.p2p.store import P2PStore
    from ckpt_core.errors import TransportError
    log = logging.getLogger("test")
    owner = P2PStore("127.0.0.2", local_rank=0, ps_devices="", nccl_ib_hca="", log=log, rdma=False, serving=True)
    reader = P2PStore("127.0.0.3", local_rank=0, ps_devices="", nccl_ib_hca="", log=log, rdma=False)
    gen = torch.Generator().manual_seed(3)
    n = 1 << 20
    region = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    dst = torch.zeros(n, dtype=torch.uint8)
    try:
        owner.register(region.data_ptr(), n)
        reader.register(dst.data_ptr(), n)
        slot, stamp = owner.stamp()
        peer = owner.describe({0: (region.data_ptr(), n)}, stamp)

        def read():
            reader.read(peer, 0, [(dst.data_ptr(), region.data_ptr(), n)], what="bucket 0",
                        deadline=time.monotonic() + 60, should_stop=lambda: None)
        read()
        assert torch.equal(dst, region)
        owner.clear_stamp(slot)                   # what unregister_checkpoint does first
        region.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen))
        owner.stamp()                             # the next checkpoint in the same memory
        with pytest.raises(TransportError, match="owner rank 0 at 127.0.0.2:.*unregistered or replaced"):
            read()
    finally:
        owner.close(0)
        reader.close(0)


def test_the_example_driver_broadcasts_then_p2p_and_a_joiner_world_pulls_through_its_metas_file(tmp_path):
    """examples/vllm_update.py under torchrun: owners --update-method all --save-metas-file
    --sleep-time; a second torchrun world --load-metas-file feeds two other engines."""
    import json
    import threading
    import time
    from support.data import fresh_tensor, want_digests
    from support.torchrun import run_torchrun, start_torchrun
    from ckpt_core.checkpoint.safetensors import write_file
    from test_topology_example import EXAMPLE, ROOT, _EngineHttp, _UnixHttp
    gen = torch.Generator().manual_seed(7)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shards = [{f"layer{i}.{j}": fresh_tensor((64, 32), torch.bfloat16, gen) for j in range(3)} for i in range(3)]
    for i, shard in enumerate(shards):
        write_file(str(ckpt / f"model-{i}.safetensors"), shard)
    want, metas = want_digests(*shards), str(tmp_path / "metas.json")
    fronts, servers = [], []

    def engines(tag):
        socks = []
        for g in range(2):
            front = EngineFront("cpu", 1, env={"PS_CPU_VISIBLE_DEVICES": str(g)})
            srv = _UnixHttp(str(tmp_path / f"{tag}{g}.sock"), _EngineHttp)
            srv.front = front
            threading.Thread(target=srv.serve_forever, daemon=True).start()
            fronts.append(front)
            servers.append(srv)
            socks.append(str(tmp_path / f"{tag}{g}.sock"))
        return fronts[-2:], ",".join(socks)

    def example(*args):
        return [EXAMPLE, "--inference-parallel-size", "1", "--device", "cpu", "--timeout", "90", "--ready-timeout", "30",
                *args]

    def env(host):
        return dict(os.environ, PYTHONPATH=str(ROOT), PS_P2P_HOST=host, NCCL_IB_DISABLE="1")

    try:
        own_fronts, own_socks = engines("owner")
        owners_out, owners_err = tmp_path / "owners.out", tmp_path / "owners.err"
        owners = start_torchrun(example("--checkpoint-path", ckpt, "--uds", own_socks, "--update-method", "all",
                                        "--save-metas-file", metas, "--sleep-time", "60"),
                                nproc=2, out=owners_out, err=owners_err, env=env("127.0.0.2"))
        t0 = time.monotonic()
        while not all(len(f.requests) == 2 for f in own_fronts):   # broadcast, then p2p, done
            assert owners.poll() is None, owners_err.read_text()[-4000:]
            assert time.monotonic() - t0 < 240, "the owners' two updates did not finish"
            time.sleep(0.2)
        join_fronts, join_socks = engines("joiner")
        joiners = run_torchrun(example("--load-metas-file", metas, "--uds", join_socks), nproc=2, env=env("127.0.0.3"),
                               timeout=300)
        out = joiners.stdout
        assert joiners.returncode == 0, joiners.stderr[-4000:]
        assert [json.loads(x)["method"] for x in out.splitlines() if x.startswith("{")] == ["p2p", "p2p"], out
        for front in own_fronts + join_fronts:
            assert front.digests(0) == want
        owners.terminate()   # it would sleep on (--sleep-time); torchrun passes SIGTERM on to its ranks
        owners.wait(timeout=60)
        out = owners_out.read_text()
        lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
        assert sorted((x["rank"], x["method"]) for x in lines) == [(0, "broadcast"), (0, "p2p"), (1, "broadcast"),
                                                                   (1, "p2p")], out
        assert json.load(open(metas))["format"] == "ckpt-engine/metas"
    finally:
        for srv in servers:
            srv.shutdown()
            srv.server_close()
        for f in fronts:
            f.close()


@pytest.mark.parametrize("mode", ["close", "abort"])
def test_p2p_target_groups_in_a_trainers_default_group_are_freed_by_close_and_abort(mode, monkeypatch):
    """Issue 14 defect 5's sibling: each P2P update makes a target group; 10 ParameterServers in a
    default group the caller owns, each after a P2P update, must leave no group or fd behind."""
    from support.ps_fault_cases import assert_census_clean, group_census
    for key, value in OWNERS.items():
        monkeypatch.setenv(key, value)   # inherited by the census processes
    front = EngineFront("cpu", 1, devices=[1])
    try:
        got = group_census("cpu", 10, mode, p2p=front.address)
        assert len(front.requests) == 11, "every ParameterServer's P2P update reached rank 1's engine"
    finally:
        front.close()
    assert_census_clean(got)
