"""Who can reach a PS's memory over Mooncake, and what close() leaves behind (issue 21, items 2, 5,
6, 7, 10): real PS processes, real Mooncake TCP on loopback, a foreign TransferEngine."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from support.exposure_cases import ForeignPeer
from support.asserts import assert_every_rank_failed
from support.engine import EngineFront
from support.procs import pythonpath
from support.world import FreshCheckpoints, PsWorld
from support.p2p_cases import JOINERS, OWNERS, SMALL, all_ok, call, owners_with

pytest.importorskip("mooncake.engine", reason="Mooncake (the p2p extra) is not installed")

WILDCARD = ("0.0.0.0", "::")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def xcall(world, fn, *args, ranks=None, timeout=120):
    return world.all("call", ("support.exposure_cases", fn, args), ranks=ranks, timeout=timeout)


def test_a_ps_that_did_not_opt_in_registers_nothing_and_a_foreign_peer_can_neither_read_nor_write_it(tmp_path):
    with PsWorld("cpu", 2, init=SMALL, env=OWNERS) as owners:
        _, [(theirs, want_theirs)] = owners_with(owners)
        all_ok(call(owners, "save_metas", str(tmp_path / "m.json"), ranks=[0]))
        with PsWorld("cpu", 2, init=SMALL, env=JOINERS) as plain:   # PS_P2P_SERVE unset: not serving
            mine, want = FreshCheckpoints(plain, seed=41).new()
            views = all_ok(xcall(plain, "memory_view", mine))
            for r in range(2):
                assert views[r].value["address"] is None, "registering made a P2P store without serve_p2p"
                assert not [s for s in views[r].value["listening"] if s[0] in WILDCARD], views[r].value
            # It reads P2P (so its store and ports exist) but still serves nothing of its own.
            all_ok(call(plain, "load_metas", str(tmp_path / "m.json")))
            front = EngineFront("cpu", 2)
            foreign = ForeignPeer()
            try:
                all_ok(call(plain, "p2p_update", theirs, front.address, 60, [0, 1]))
                assert front.digests(0) == want_theirs and front.digests(1) == want_theirs
                views = all_ok(xcall(plain, "memory_view", mine))
                for r in range(2):
                    v = views[r].value
                    assert v["address"] and v["address"].startswith("127.0.0.3:"), v
                    registered = {p for p, _ in v["registered"]}
                    assert not registered & {p for p, _ in v["regions"]}, f"rank {r} registered its checkpoint: {v}"
                    for ptr, n in v["regions"]:
                        k = min(n, 4096)
                        assert foreign.read(v["address"], ptr, k) != 0, f"a foreign peer read rank {r}'s memory"
                        assert foreign.write(v["address"], ptr, k) != 0, f"a foreign peer wrote rank {r}'s memory"
                got = plain.update(mine, front)   # the next broadcast update delivers the registered bytes
                assert all(o.ok for o in got.values()), got
                assert front.digests(0) == want and front.digests(1) == want, "the checkpoint was tampered with"
            finally:
                foreign.close()
                front.close()


def test_a_serving_owner_whose_memory_a_foreign_peer_rewrote_is_refused_before_any_engine_loads_it(tmp_path):
    with PsWorld("cpu", 2, init=SMALL, env=OWNERS) as owners:
        _, [(first, want), (second, _), (third, want3)] = owners_with(owners, 3, per_rank=12)
        doc = all_ok(call(owners, "save_metas", str(tmp_path / "m.json"), ranks=[0]))[0].value
        with PsWorld("cpu", 2, init=SMALL, env=JOINERS) as joiners:
            all_ok(call(joiners, "load_metas", str(tmp_path / "m.json")))
            front = EngineFront("cpu", 2)
            try:
                all_ok(call(joiners, "p2p_update", first, front.address, 60, [0, 1]))
                p2p = doc["checkpoints"][second]["owners"][1]["p2p"]
                ptr, n = p2p["regions"][min(p2p["regions"], key=int)]
                foreign = ForeignPeer()
                try:   # the documented exposure: whoever reaches the ports reads and writes served memory
                    assert foreign.read(p2p["address"], ptr, 4096) == 0
                    assert foreign.write(p2p["address"], ptr, 4096) == 0
                finally:
                    foreign.close()
                got = call(joiners, "p2p_update", second, front.address, 60, [0, 1])
                assert_every_rank_failed(got, "TransportError", "owner rank 1 at 127.0.0.2:",
                                         "does not match the digest its owner took at registration")
                for i in range(2):
                    assert front.digests(i) == want, "an engine loaded bytes of the tampered checkpoint"
                all_ok(call(joiners, "p2p_update", third, front.address, 60, [0, 1]))
                for i in range(2):
                    assert front.digests(i) == want3, "the next update is bit-exact"
            finally:
                front.close()


def test_close_releases_every_socket_and_a_new_ps_on_the_same_port_works_with_its_store_on_loopback():
    """close() then ParameterServer(...) on the same MASTER_PORT (the README's advice after a broken
    update): no socket of the old PS listens any more, the new one updates bit-exact; a world on
    one host (MASTER_ADDR=127.0.0.1) binds its rendezvous store to loopback only."""
    with PsWorld("cpu", 2, env=OWNERS) as w:   # serving: Mooncake's ports are open too
        FreshCheckpoints(w, seed=8).new()
        front = EngineFront("cpu", 2)
        try:
            closed = all_ok(xcall(w, "close_and_listen"))
            # every rank has closed (rank 0's store is gone) before any builds the new world
            again = all_ok(xcall(w, "reopen_and_update", front.address, 500))
            v = [{**closed[r].value, **again[r].value} for r in range(2)]
            port = v[0]["port"]
            assert ("127.0.0.1", port) in v[0]["before"], v[0]["before"]
            assert [s for s in v[0]["before"] if s[1] == port] == [("127.0.0.1", port)], "store on every interface"
            for r in range(2):
                assert [s for s in v[r]["before"] if s[0] in WILDCARD], f"rank {r}: no Mooncake port was open"
                assert v[r]["after_close"] == [], f"rank {r} still listens after close(): {v[r]['after_close']}"
                assert [s for s in v[r]["during"] if s[0] in WILDCARD], f"rank {r}: the new PS serves too"
                assert v[r]["after_second_close"] == [], f"rank {r}: {v[r]['after_second_close']}"
            want = {**v[0]["want"], **v[1]["want"]}
            assert front.digests(0) == want and front.digests(1) == want
        finally:
            front.close()


def _outward() -> str | None:
    """This host's outward interface: the source address of the route to a public address."""
    import socket
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("8.8.8.8", 53))
            host = s.getsockname()[0]
    except OSError:
        return None
    return None if host.startswith("127.") else host


def test_saved_metas_of_a_loopback_world_carry_the_outward_address_and_a_joiner_pulls_through_it(tmp_path):
    """MASTER_ADDR=127.0.0.1 (as under torchrun --standalone) and PS_P2P_HOST unset: the metas
    name the host's outward interface, not 127.0.0.1."""
    outward = _outward()
    if outward is None:
        pytest.skip("this host has no outward interface")
    serving = {k: v for k, v in OWNERS.items() if k != "PS_P2P_HOST"}
    with PsWorld("cpu", 2, init=SMALL, env=serving) as owners:
        _, [(name, want)] = owners_with(owners)
        all_ok(call(owners, "save_metas", str(tmp_path / "m.json"), ranks=[0]))
        hosts = [o["p2p"]["host"] for o in json.load(open(tmp_path / "m.json"))["checkpoints"][name]["owners"]]
        assert hosts == [outward, outward], hosts
        with PsWorld("cpu", 2, init=SMALL, env=JOINERS) as joiners:
            all_ok(call(joiners, "load_metas", str(tmp_path / "m.json")))
            front = EngineFront("cpu", 2)
            try:
                all_ok(call(joiners, "p2p_update", name, front.address, 60, [0, 1]))
                assert front.digests(0) == want and front.digests(1) == want
            finally:
                front.close()


SAVE_IN_NAMESPACE = r"""
import json, os, sys, torch
from ckpt_core import ParameterServer
out = {}
os.environ["PS_P2P_SERVE"] = "1"
for i, host in enumerate(("", "127.0.0.1")):
    os.environ["PS_P2P_HOST"] = host
    path = sys.argv[1] + f"/m{host or '-default'}.json"
    with ParameterServer(0, 1, device="cpu", master_addr="127.0.0.1", master_port=29611 + i) as ps:
        ps.register_checkpoint("c", named_tensors={"w": torch.randn(64)})
        ps.gather_metas("c")
        try:
            ps.save_metas(path)
            out[host] = ["ok", json.load(open(path))["checkpoints"]["c"]["owners"][0]["p2p"]["host"]]
        except Exception as exc:
            out[host] = [type(exc).__name__, str(exc), os.path.exists(path)]
print("RESULT " + json.dumps(out))
"""


def test_saving_metas_whose_owner_address_is_loopback_by_default_is_refused_naming_PS_P2P_HOST(tmp_path):
    """A host whose only interface is loopback (a network namespace): the default address is
    127.0.0.1, and save_metas refuses it; PS_P2P_HOST=127.0.0.1 set on purpose is allowed."""
    script = tmp_path / "save.py"
    script.write_text(SAVE_IN_NAMESPACE)
    env = {**os.environ, "PYTHONPATH": pythonpath(ROOT), "NCCL_IB_DISABLE": "1"}
    cmd = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$0" "$@"', sys.executable, str(script),
           str(tmp_path)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    except FileNotFoundError:
        pytest.skip("no unshare here")
    if proc.returncode != 0 and "Operation not permitted" in proc.stderr:
        pytest.skip("cannot make a network namespace here")
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stdout[-2000:] + proc.stderr[-3000:]
    got = json.loads(line[0][7:])
    assert got[""][0] == "ConfigError" and "PS_P2P_HOST" in got[""][1] and "127.0.0.1:" in got[""][1], got
    assert got[""][2] is False, "a refused metas file was written anyway"
    assert got["127.0.0.1"] == ["ok", "127.0.0.1"], got


def test_a_named_rdma_nic_the_host_lacks_is_a_config_error_even_with_no_rdma_device_at_all():
    from ckpt_core.p2p.store import rdma_devices_here
    if rdma_devices_here():
        pytest.skip("this host has RDMA devices")
    env = {k: v for k, v in OWNERS.items() if k != "NCCL_IB_DISABLE"}
    with pytest.raises(RuntimeError) as info:   # the serving constructor creates the store
        PsWorld("cpu", 1, env={**env, "PS_P2P_STORE_RDMA_DEVICES": "mlx5_0"}).close()
    text = str(info.value)
    assert "ConfigError" in text and "PS_P2P_STORE_RDMA_DEVICES names ['mlx5_0']" in text, text
    assert "RDMA devices here: none" in text, text
