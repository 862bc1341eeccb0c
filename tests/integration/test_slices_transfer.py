"""Routing by a slice plan on CPU: real PS processes (gloo point-to-point sends), real engine-worker
processes. Each worker receives exactly its rows, its columns and the whole tensors, bit for bit;
the result reports the bytes of each rank; ranks that disagree on the plan all refuse it."""

import slices_world as sw


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
