"""Device-resident checkpoints (``register_checkpoint(..., on_device=True)``) on CPU: real PS processes
(gloo) whose cpu device stands in for the GPU, real engine-worker processes (/dev/shm IPC buffers).

The checkpoint keeps the caller's own tensors (no host copy, no pool); every update reads them in
place, so what the caller writes into them between updates is what the next update sends, bit for
bit. Whatever needs host bytes, and tensors that cannot be read in place, are refused with
``DeviceResidentError``: at registration (local), or in the first exchange of a collective, alike on
every rank, with nothing moved and the world still usable.
"""

from __future__ import annotations

import pytest

from support.asserts import assert_every_rank_failed
from support.engine import EngineFront
from support.world import PsWorld

CASES = "support.device_source_cases"
pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def front():
    f = EngineFront("cpu", 2)
    try:
        yield f
    finally:
        f.close()


def _call(ps: PsWorld, fn: str, *args, ranks=None) -> dict:
    got = ps.all("call", (CASES, fn, args), ranks=ranks)
    return got


def _want(reports: dict) -> dict[str, str]:
    from support.device_source_cases import shared_digest
    want = {n: d for r in sorted(reports) for n, d in reports[r].value["digests"].items()}
    want["shared.w"] = shared_digest([reports[r].value["piece"] for r in sorted(reports)])
    return want


def _holds(front: EngineFront, want: dict[str, str]) -> None:
    for i in range(2):
        assert front.digests(i) == want, f"engine worker {i} does not hold the registered tensors"


def test_updates_read_the_callers_tensors_in_place_bit_exact_and_see_each_rewrite(front):
    with PsWorld("cpu", 2, init={"max_bucket_gb": (8 << 10) / (1 << 30)}) as ps:
        reg = _call(ps, "register", "dev", 1)
        assert all(o.ok for o in reg.values()), reg
        for r, o in reg.items():
            v = o.value
            assert v["on_device"] and v["same_storage"], f"rank {r} did not keep the caller's tensors: {v}"
            assert v["no_pool"] and v["pool_bytes"] == 0 and v["registered_bytes"] == 0, v
            assert v["last_register"]["on_device"] is True and v["last_register"]["bytes"] > 0
        assert all(o.ok for o in ps.all("gather", "dev").values())
        got = ps.update("dev", front, 60)
        assert all(o.ok for o in got.values()), got
        assert got[0].value["buckets"] > 2, "several buckets: the ring and the runs of several regions are used"
        _holds(front, _want(reg))
        for seed in (2, 3):   # an optimizer step writes into the same tensors; no new registration
            again = _call(ps, "rewrite", "dev", seed)
            assert all(o.ok and o.value["same_storage"] for o in again.values()), again
            assert _want(again) != _want(reg)
            got = ps.update("dev", front, 60)
            assert all(o.ok for o in got.values()), got
            _holds(front, _want(again))

        # an engine failing mid-update fails every rank; the engines keep what they held; the next one works
        failed = ps.update("dev", front, 60, {1: {"fail_bucket": 1}})
        assert_every_rank_failed(failed, "RemoteWorkerError", "injected engine failure at bucket 1")
        _holds(front, _want(again))

        # P2P readers read the owners' host memory: refused on every rank in the first exchange
        refused = _call(ps, "p2p_update", "dev", [1])
        assert_every_rank_failed(refused, "DeviceResidentError", "registered on the device", "P2P update",
                                 "without on_device")
        _holds(front, _want(again))
        got = ps.update("dev", front, 60)   # the world is intact
        assert all(o.ok for o in got.values()), got
        assert all(o.ok for o in ps.all("unregister", ("dev", {})).values())


def test_one_ranks_tensor_on_another_device_is_refused_and_every_rank_fails_the_gather_alike(front):
    with PsWorld("cpu", 2) as ps:
        got = ps.all("call", per_rank={0: (CASES, "register_bad", ("bad", None)),
                                       1: (CASES, "register_bad", ("bad", "other device"))})
        assert got[0].ok, got
        assert not got[1].ok and got[1].error == "DeviceResidentError", got
        assert "lies on meta" in got[1].message and "device cpu" in got[1].message, got[1].message
        assert ps.all("checkpoints", ranks=[1])[1].value == [], "nothing kept on the refusing rank"
        assert_every_rank_failed(ps.all("gather", "bad"), "CheckpointNotFoundError", "not registered on rank(s) [1]")
        assert_every_rank_failed(ps.update("bad", front, 30), "ConfigError", "not registered on rank 1")
        assert front.fanouts == 0, "nothing may reach an engine"

        got = ps.all("call", per_rank={0: (CASES, "register_bad", ("strided", None)),
                                       1: (CASES, "register_bad", ("strided", "not contiguous"))})
        assert got[0].ok and got[1].error == "DeviceResidentError" and "not contiguous" in got[1].message, got

        reg = _call(ps, "register", "good", 5)   # the world is intact: a good registration updates
        assert all(o.ok for o in reg.values()), reg
        assert all(o.ok for o in ps.all("gather", "good").values())
        got = ps.update("good", front, 60)
        assert all(o.ok for o in got.values()), got
        _holds(front, _want(reg))


def test_options_that_need_host_bytes_are_refused_at_registration_keeping_nothing():
    import torch
    with PsWorld("cpu", 1) as ps:
        t = {"w": torch.randn(64)}
        assert ps.all("register", ("host", {"named_tensors": t}))[0].ok
        for kwargs, needle in ((dict(files=["/nonexistent/x.safetensors"]), "files"),
                               (dict(use_shared_memory_pool=True), "use_shared_memory_pool"),
                               (dict(base="host"), "base")):
            got = ps.all("register", ("dev", {"named_tensors": t, "on_device": True, **kwargs}))
            assert not got[0].ok and got[0].error == "DeviceResidentError" and needle in got[0].message, got
        assert ps.all("register", ("dev", {"named_tensors": t, "on_device": True}))[0].ok
        got = ps.all("register", ("next", {"named_tensors": t, "base": "dev"}))   # a delta against it
        assert got[0].error == "DeviceResidentError" and "its base 'dev' on the device" in got[0].message, got
        assert ps.all("checkpoints")[0].value == ["dev", "host"]
        assert ps.all("pool_bytes")[0].value is None


def test_a_sliced_update_copies_each_workers_boxes_from_the_device_resident_tensors():
    """Slices (``update(..., slices=plan)``): rows, columns (strided boxes) and a whole tensor, each packed
    from the caller's tensors in place; each worker holds exactly its slices."""
    from support.slices_world import plan, plan_doc, sliced_update_lands
    front = EngineFront("cpu", 2, slices=(plan().digest, [0, 1]))
    try:
        with PsWorld("cpu", 2) as ps:
            got = _call(ps, "register_slices", "s", 7)
            assert all(o.ok and o.value for o in got.values()), got
            assert all(o.ok for o in ps.all("gather", "s").values())
            sliced_update_lands(ps, front, "s", 7)
            # box digests for P2P joiners are taken from host bytes: refused on every rank alike
            refused = _call(ps, "get_metas_sliced", plan_doc())
            assert_every_rank_failed(refused, "DeviceResidentError", "publishing slices to P2P readers")
            sliced_update_lands(ps, front, "s", 7)
    finally:
        front.close()
