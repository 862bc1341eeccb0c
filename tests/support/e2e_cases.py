"""End-to-end cases shared by the CPU integration tests and the GPU tests (same code, other device kind)."""

from __future__ import annotations

import os
import shutil
import uuid

import torch

from ckpt_core.checkpoint.safetensors import write_file
from support.asserts import assert_healthy_workers_aborted
from support.data import FAULT_DTYPES as DTYPES
from support.data import fresh_tensor as fresh
from support.data import want_digests
from support.engine import EngineFront
from support.world import run_ps_world


def tensors(prefix: str, n: int, gen, *, min_elems=1, max_elems=5000) -> dict[str, torch.Tensor]:
    out = {}
    for i in range(n):
        dtype = DTYPES[i % len(DTYPES)]
        numel = int(torch.randint(min_elems, max_elems, (1,), generator=gen))
        shape = (numel,) if i % 3 else (1, numel)
        out[f"{prefix}.{i}.{str(dtype).split('.')[-1]}"] = fresh(shape, dtype, gen)
    return out


class ShmDir:
    """A private folder under /dev/shm for in-place checkpoints; removed afterwards."""

    def __init__(self):
        self.path = f"/dev/shm/ckpt-test-{uuid.uuid4().hex[:8]}"
        os.makedirs(self.path)

    def write(self, name: str, ts: dict[str, torch.Tensor]) -> str:
        p = os.path.join(self.path, name)
        write_file(p, ts)
        return p

    def close(self):
        shutil.rmtree(self.path, ignore_errors=True)


def ok(results: dict[int, list], world: int) -> list:
    """All ranks' step results, asserting every step succeeded."""
    assert sorted(results) == list(range(world)), results
    for r, res in results.items():
        for step in res:
            assert step[0] == "ok", f"rank {r}: {step}"
    return results[0]


def case_mixed_sources_uneven_shares(kind: str, world: int, tmp_path, *, bucket_gb=0.00005, updates=3):
    """Files, named tensors and /dev/shm files on uneven ranks (the last owns nothing); several updates."""
    gen = torch.Generator().manual_seed(world * 7919)
    shm = ShmDir()
    front = EngineFront(kind, world)
    try:
        spec, groups = {}, []
        for r in range(world):
            if r == world - 1 and world > 1:
                spec[r] = {"named_tensors": {}}
                continue
            named = tensors(f"r{r}.named", 6 + 5 * r, gen)
            on_disk = tensors(f"r{r}.file", 5, gen)
            in_shm = tensors(f"r{r}.shm", 4, gen)
            f = str(tmp_path / f"rank{r}.safetensors")
            write_file(f, on_disk)
            spec[r] = {"named_tensors": named, "files": [f, shm.write(f"rank{r}.safetensors", in_shm)]}
            groups += [named, on_disk, in_shm]
        script = [("init", {"max_bucket_gb": bucket_gb}), ("register", ("ck", spec)), ("gather", "ck")]
        script += [("update", ("ck", front.address, 60))] * updates
        res = ok(run_ps_world(kind, world, script), world)
        want = want_digests(*groups)
        for i in range(world):
            assert front.digests(i) == want
        assert all(r[1]["buckets"] > 1 for r in res[3:]), "the case must span several buckets"
        for p in os.listdir(shm.path):   # in-place registration never deletes the caller's files
            assert os.path.getsize(os.path.join(shm.path, p)) > 0
        return res
    finally:
        front.close()
        shm.close()


def case_two_checkpoints_and_shared_pool(kind: str, world: int):
    """Two checkpoints switched by name; an RL-style re-registration into the shared pool."""
    gen = torch.Generator().manual_seed(11)
    front = EngineFront(kind, world)
    try:
        a = {r: tensors(f"a{r}", 5, gen) for r in range(world)}
        b = {r: {n: fresh(t.shape, t.dtype, gen) for n, t in a[r].items()} for r in range(world)}   # same names
        s1 = {r: {f"p{r}.{i}": fresh((4096,), torch.bfloat16, gen) for i in range(4)} for r in range(world)}
        s2 = {r: {n: fresh(t.shape, t.dtype, gen) for n, t in s1[r].items()} for r in range(world)}
        named = lambda d, **kw: {r: {"named_tensors": v, **kw} for r, v in d.items()}  # noqa: E731
        upd = lambda n: ("update", (n, front.address, 60))  # noqa: E731
        script = [("init", {"max_bucket_gb": 0.00002}),
                  ("register", ("A", named(a))), ("register", ("B", named(b))), ("gather", "A"), ("gather", "B"),
                  upd("A"), upd("B"), upd("A"),
                  ("register", ("S1", named(s1, use_shared_memory_pool=True))), ("gather", "S1"), upd("S1"),
                  ("unregister", "S1"),
                  ("register", ("S2", named(s2, use_shared_memory_pool=True))), ("gather", "S2"), upd("S2")]
        res = ok(run_ps_world(kind, world, script), world)
        merged = lambda d: {k: v for r in d.values() for k, v in r.items()}  # noqa: E731
        got = front.digests(0)
        assert {n: got[n] for n in merged(a)} == want_digests(merged(a)), "A was the last of A/B pushed"
        assert {n: got[n] for n in merged(s2)} == want_digests(merged(s2)), "S2 replaced S1 in the pool"
        assert all(front.digests(i) == got for i in range(world))
        return res
    finally:
        front.close()


def case_engine_fails_then_retry(kind: str, world: int, fail_rank: int):
    """An engine error on the last bucket fails every rank, naming the rank; the retry delivers."""
    gen = torch.Generator().manual_seed(5)
    front = EngineFront(kind, world)
    try:
        data = {r: tensors(f"e{r}", 6, gen) for r in range(world)}
        spec = {r: {"named_tensors": v} for r, v in data.items()}
        first = ok(run_ps_world(kind, world, [("init", {"max_bucket_gb": 0.00002}), ("register", ("c", spec)),
                                              ("gather", "c"), ("update", ("c", front.address, 60))]), world)
        n = first[3][1]["buckets"]
        bad = {fail_rank: {"fail_bucket": n - 1}}
        # The failing update carries new bytes, so a healthy worker that committed it would show.
        before = {i: front.digests(i) for i in range(world)}
        data = {r: {k: fresh(t.shape, t.dtype, gen) for k, t in v.items()} for r, v in data.items()}
        spec = {r: {"named_tensors": v} for r, v in data.items()}
        since = front.fanouts
        failed = run_ps_world(kind, world, [("init", {"max_bucket_gb": 0.00002}), ("register", ("c", spec)),
                                            ("gather", "c"), ("update", ("c", front.address, 60, bad))])
        assert all(failed[r][3][:2] == ("error", "RemoteWorkerError") for r in range(world)), failed
        assert_healthy_workers_aborted(front, since, before, failing=(fail_rank,))
        res = run_ps_world(kind, world, [("init", {"max_bucket_gb": 0.00002}), ("register", ("c", spec)),
                                         ("gather", "c"), ("update", ("c", front.address, 60, bad)),
                                         ("update", ("c", front.address, 60))])
        for r in range(world):
            err = res[r][3]
            assert err[0] == "error" and err[1] == "RemoteWorkerError", err
            assert f"rank {fail_rank}" in err[2] and f"injected engine failure at bucket {n - 1}" in err[2], err
            assert res[r][4][0] == "ok", f"retry on rank {r}: {res[r][4]}"
        want = want_digests(*data.values())
        assert all(front.digests(i) == want for i in range(world))
    finally:
        front.close()


def case_engine_never_connects(kind: str, world: int, timeout_s: float = 3.0):
    front = EngineFront(kind, world)
    try:
        gen = torch.Generator().manual_seed(3)
        spec = {r: {"named_tensors": tensors(f"n{r}", 2, gen)} for r in range(world)}
        lazy = {world - 1: {"never_connect": timeout_s + 3}}
        res = run_ps_world(kind, world, [("init", {}), ("register", ("c", spec)), ("gather", "c"),
                                         ("update", ("c", front.address, timeout_s, lazy))])
        for r in range(world):
            err = res[r][3]
            assert err[0] == "error" and err[1] in ("UpdateTimeoutError", "RemoteWorkerError"), err
            assert f"rank {world - 1}" in err[2], err
        assert res[world - 1][3][1] == "UpdateTimeoutError"
        return res
    finally:
        front.close()
