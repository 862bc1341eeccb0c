"""Routing by a slice plan on CPU: real PS processes (gloo point-to-point sends), real engine-worker
processes. Each worker receives exactly its rows, its columns and the whole tensors, bit for bit;
the result reports the bytes of each rank; ranks that disagree on the plan all refuse it."""

from harness import EngineFront, PsWorld, digest
import slices_world as sw


def test_each_engine_worker_receives_exactly_its_slices_and_the_whole_tensors():
    front = EngineFront("cpu", 2)
    try:
        with PsWorld("cpu", 2) as world:
            t = sw.tensors(7)
            world.all("register", per_rank={0: ("c", {"named_tensors": {"rows": t["rows"], "norm": t["norm"]}}),
                                            1: ("c", {"named_tensors": {"cols": t["cols"]}})})
            world.all("gather", "c")
            got = world.all("call", ("slices_world", "sliced_update", ("c", front.address, 60, sw.plan_doc())))
            for r in range(2):
                assert got[r].ok, got[r]
                result = got[r].value["slices"]
                assert result["received_bytes"] == [sw.plan().rank_bytes(0), sw.plan().rank_bytes(1)] == [116, 116]
                assert result["whole_bytes"] == 212
            for r in range(2):
                assert front.digests(r) == {n: digest(x) for n, x in sw.want(7, r).items()}, f"worker {r}"
    finally:
        front.close()


def test_ranks_that_disagree_on_the_plan_all_refuse_it_and_the_next_update_works():
    front = EngineFront("cpu", 2)
    try:
        with PsWorld("cpu", 2) as world:
            t = sw.tensors(8)
            world.all("register", per_rank={0: ("c", {"named_tensors": {"rows": t["rows"], "norm": t["norm"]}}),
                                            1: ("c", {"named_tensors": {"cols": t["cols"]}})})
            world.all("gather", "c")
            got = world.all("call", per_rank={0: ("slices_world", "sliced_update", ("c", front.address, 30, sw.plan_doc())),
                                              1: ("slices_world", "sliced_update", ("c", front.address, 30, None))})
            for r in range(2):
                assert not got[r].ok and got[r].error == "ConfigError" and "disagree on the slice plan" in got[r].message
            assert front.fanouts == 0, "no engine was asked to load anything"
            again = world.all("update", ("c", front.address, 30, None))
            assert all(again[r].ok for r in range(2)), again
            for r in range(2):
                assert front.digests(r) == {n: digest(x) for n, x in t.items()}
    finally:
        front.close()
