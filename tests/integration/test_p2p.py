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
