"""Routing by a slice plan on CPU: real PS processes (gloo point-to-point sends), real engine-worker
processes. Each worker receives exactly its rows, its columns and the whole tensors, bit for bit;
the result reports the bytes of each rank; ranks that disagree on the plan all refuse it; a worker
handed the slices of another engine rank or plan refuses them, and so does every rank."""

from support import slices_world as sw
from support.asserts import assert_every_rank_failed, assert_healthy_workers_aborted
from support.data import digest
from support.engine import EngineFront
from support.world import PsWorld


def test_each_engine_worker_receives_exactly_its_slices_and_the_whole_tensors():
    sw.case_each_worker_receives_its_slices("cpu")


def test_ranks_that_disagree_on_the_plan_all_refuse_it_and_the_next_update_works():
    sw.case_disagreeing_ranks_refuse("cpu")


def test_two_replicas_of_a_two_rank_engine_share_one_transfer_per_slice():
    sw.case_replicas_share_one_transfer("cpu")


def test_a_world_that_is_not_a_multiple_of_the_engine_ranks_is_refused_on_every_rank():
    sw.case_world_not_a_multiple_of_the_engine_refuses("cpu")


def test_trainer_shards_are_read_in_slices_across_owners_bit_exact():
    """dim-0 pieces read by dim-1 slices (every slice crosses owners), dim-0 pieces read by dim-0
    slices whose borders are not the pieces', dim-1 pieces read by rows (strided intersections),
    uneven pieces of a tensor every rank reads whole, and a tensor registered whole."""
    sw.case_slices_of_trainer_shards("cpu", 2)


def test_trainer_shards_on_four_ranks_feed_two_replicas_bit_exact():
    sw.case_slices_of_trainer_shards("cpu", 4)


def test_slices_of_a_file_on_disk_and_of_a_dev_shm_file_registered_in_place_arrive_exactly(tmp_path):
    sw.case_file_and_shm_sources("cpu", tmp_path)


def test_a_worker_beside_the_ps_rank_of_another_engine_rank_refuses_its_slices_and_every_rank_fails():
    """Two replicas of a 2-rank engine (PS rank p routes engine rank p % 2 and names it, with the plan,
    in its hello). The second replica's workers sit the other way round (its engine rank 0 beside PS
    rank 3): both refuse before loading anything, the first replica's workers are aborted, every rank
    raises, no engine changes. Likewise workers told another plan. Then the right update is bit-exact.
    Before the fix the second replica loaded each other's rows and every rank reported success."""
    plan = sw.plan().digest
    front = EngineFront("cpu", 4, slices=(plan, [0, 1, 0, 1]))
    try:
        with PsWorld("cpu", 4) as world:
            sw._register_four(world, sw.tensors(51))
            first = world.all("call", (sw.__name__, "sliced_update", ("c", front.address, 60, sw.plan_doc())))
            assert all(first[r].ok for r in range(4)), first
            before = {q: {n: digest(x) for n, x in sw.want(51, q % 2).items()} for q in range(4)}
            assert all(o.ok for o in world.all("unregister", ("c", {})).values())
            sw._register_four(world, sw.tensors(52))
            for told, failing, needle in (([0, 1, 1, 0], (2, 3), "but its parameter-server rank sends the slices of engine rank"),
                                          ([0, 1, 0, 1], (0, 1, 2, 3), "routes the update by slice plan")):
                front.expect_slices((plan if failing == (2, 3) else "e" * 40, told))
                since = front.fanouts
                got = world.all("call", (sw.__name__, "sliced_update", ("c", front.address, 60, sw.plan_doc())))
                assert_every_rank_failed(got, "RemoteWorkerError", "ConfigError", needle)
                assert_healthy_workers_aborted(front, since, before, failing=failing)
                # a refusing worker says ConfigError; one whose PS already knew of another's refusal when it
                # connected is aborted before any hello (so it cannot load a byte): which happens is a race
                outcomes = front.worker_outcomes(since)
                said = ["ConfigError" in outcomes[q][1] or "aborted by the parameter server before its hello"
                        in outcomes[q][1] for q in failing]
                assert all(said) and any("ConfigError" in outcomes[q][1] for q in failing), front.last_results
            front.expect_slices((plan, [0, 1, 0, 1]))
            again = world.all("call", (sw.__name__, "sliced_update", ("c", front.address, 60, sw.plan_doc())))
            assert all(again[r].ok for r in range(4)), again
            for q in range(4):
                assert front.digests(q) == {n: digest(x) for n, x in sw.want(52, q % 2).items()}, f"worker {q}"
    finally:
        front.close()
