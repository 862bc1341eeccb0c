"""NCCL_IB_HCA parsing, RDMA NIC selection and P2P receiver assignment (pure planning)."""

import pytest

from ckpt_core.planning.nics import HcaFilter, assign_readers, nic_for_rank, parse_nccl_ib_hca, select_rdma_devices
from ckpt_core.errors import ConfigError

HOST = ["mlx5_0", "mlx5_1", "mlx5_10", "mlx4_0", "bnxt_re0"]


@pytest.mark.parametrize("text, want", [
    ("", None),
    ("   ", None),
    ("mlx5", HcaFilter(("mlx5",))),
    ("mlx5_0:1,mlx5_1:1", HcaFilter(("mlx5_0", "mlx5_1"))),
    ("^mlx5_0", HcaFilter(("mlx5_0",), exclude=True)),
    ("=mlx5_1", HcaFilter(("mlx5_1",), exact=True)),
    ("^=mlx5_1:1, mlx4_0", HcaFilter(("mlx5_1", "mlx4_0"), exclude=True, exact=True)),
    ("mlx5_0,,", HcaFilter(("mlx5_0",))),
])
def test_nccl_ib_hca_is_parsed_with_nccl_syntax(text, want):
    assert parse_nccl_ib_hca(text) == want


@pytest.mark.parametrize("text", ["^", "=", "^=", "^ , "])
def test_an_nccl_ib_hca_that_names_nothing_after_a_modifier_is_an_error(text):
    with pytest.raises(ConfigError, match="names no device"):
        parse_nccl_ib_hca(text)


@pytest.mark.parametrize("ps, hca, want", [
    ("", "", sorted(HOST)),                                   # nothing set: every device
    ("", "mlx5", ["mlx5_0", "mlx5_1", "mlx5_10"]),            # prefix
    ("", "mlx5_1", ["mlx5_1", "mlx5_10"]),                    # a prefix matches mlx5_10 too, like NCCL
    ("", "=mlx5_1", ["mlx5_1"]),                              # exact
    ("", "^mlx5", ["bnxt_re0", "mlx4_0"]),                    # exclude prefix
    ("", "^=mlx5_1,mlx4_0:1", ["bnxt_re0", "mlx5_0", "mlx5_10"]),
    ("", "mlx5_0:1,mlx4_0:2", ["mlx4_0", "mlx5_0"]),          # ports ignored
    ("", "ib9", []),                                          # nothing matches: TCP
    ("mlx5_1,mlx5_0", "^mlx5", ["mlx5_1", "mlx5_0"]),         # PS_P2P_STORE_RDMA_DEVICES wins, order kept
])
def test_rdma_devices_are_chosen_by_precedence(ps, hca, want):
    assert select_rdma_devices(HOST, ps_devices=ps, nccl_ib_hca=hca) == want


def test_a_host_without_rdma_uses_tcp_and_an_unknown_named_nic_is_an_error():
    assert select_rdma_devices([], nccl_ib_hca="mlx5") == []
    assert nic_for_rank(3, []) is None
    with pytest.raises(ConfigError, match="mlx5_7"):
        select_rdma_devices(HOST, ps_devices="mlx5_0,mlx5_7")


@pytest.mark.parametrize("devices, ranks, want", [
    (["a", "b"], [0, 1, 2, 3], ["a", "b", "a", "b"]),
    (["a"], [0, 1], ["a", "a"]),
    (["a", "b", "c", "d"], [0, 1], ["a", "b"]),
])
def test_ranks_of_one_host_take_distinct_nics_while_there_are_enough(devices, ranks, want):
    assert [nic_for_rank(r, devices) for r in ranks] == want


@pytest.mark.parametrize("buckets, targets", [
    ([(0, 100), (1, 100), (0, 100), (1, 100)], [2, 3]),
    ([(0, 10), (1, 10), (2, 10), (0, 10), (1, 10), (2, 10)], [0, 1, 2]),
    ([(0, 100)] * 7, [5]),
    ([(0, 1000), (1, 10), (1, 10), (1, 10)], [0, 1]),
    ([(r % 4, 64 + r) for r in range(40)], [1, 3, 6]),
])
def test_readers_balance_bytes_and_concurrent_reads_pair_distinct_readers_and_owners(buckets, targets):
    got = assign_readers(buckets, targets)
    assert len(got) == len(buckets) and set(got) <= set(targets)
    assert got == assign_readers(buckets, targets), "every rank must compute the same assignment"
    load = {t: sum(n for (o, n), r in zip(buckets, got) if r == t) for t in targets}
    biggest = max(n for _, n in buckets)
    assert max(load.values()) - min(load.values()) <= biggest, load
    if len(targets) > 1 and len({n for _, n in buckets}) == 1:
        # equal buckets: consecutive buckets (in flight together) go to distinct readers
        assert all(a != b for a, b in zip(got, got[1:])), got


def test_overlapping_reads_of_an_interleaved_plan_pair_distinct_readers_with_distinct_owners():
    owners = [0, 1, 0, 1, 0, 1]
    got = assign_readers([(o, 8) for o in owners], [0, 1])
    assert got == [0, 1, 0, 1, 0, 1]
    for i in range(len(got) - 1):
        assert got[i] != got[i + 1] and owners[i] != owners[i + 1]


@pytest.mark.parametrize("targets", [[], [1, 1]])
def test_bad_targets_are_config_errors(targets):
    with pytest.raises(ConfigError):
        assign_readers([(0, 1)], targets)
