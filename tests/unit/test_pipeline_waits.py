"""The pipeline never waits blindly on the device: a broadcast that cannot finish is a typed error."""

import time

import pytest

from ckpt_core.transfer.pipeline import BroadcastPipeline, PipelineStats
from ckpt_core.errors import TransportError, UpdateTimeoutError


class StuckEvent:
    """Stands in for the CUDA event of a broadcast whose peer rank died: it never completes."""

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:  # what a blind wait would call: it would never return
        raise AssertionError("the pipeline must not block on synchronize()")


class DoneLater:
    def __init__(self, after_s: float):
        self.t = time.monotonic() + after_s

    def query(self) -> bool:
        return time.monotonic() >= self.t


def pipeline(deadline: float, collective_s: float = 600.0) -> BroadcastPipeline:
    p = BroadcastPipeline.__new__(BroadcastPipeline)
    p.rank, p.deadline, p.collective_s, p.stats = 1, deadline, collective_s, PipelineStats()
    return p


def test_a_broadcast_that_never_completes_ends_in_a_timeout_at_the_deadline():
    p = pipeline(time.monotonic() + 0.3)
    t0 = time.monotonic()
    with pytest.raises(UpdateTimeoutError, match="rank 1: the broadcast of bucket 3 did not complete") as info:
        p._await(StuckEvent(), "the broadcast of bucket 3", time.monotonic())
    assert 0.25 < time.monotonic() - t0 < 30, "not before the deadline; a generous ceiling after it"
    assert p.stats.awaited == 1
    assert isinstance(info.value, TransportError) and info.value.groups_broken
    assert "update timeout" in str(info.value)


def test_a_stuck_broadcast_ends_at_the_collective_timeout_when_that_comes_first():
    """A dead peer under NCCL: fail after PS_COLLECTIVE_TIMEOUT_S from the broadcast's issue,
    not at the (much later) update deadline."""
    p = pipeline(time.monotonic() + 60, collective_s=0.5)
    issued = time.monotonic() - 0.2          # issued a while ago: it has 0.3 s left
    t0 = time.monotonic()
    with pytest.raises(UpdateTimeoutError, match="PS_COLLECTIVE_TIMEOUT_S=0.5 s") as info:
        p._await(StuckEvent(), "the broadcast of bucket 2 from rank 0", issued)
    assert 0.25 < time.monotonic() - t0 < 30, "not before the collective timeout; long before the deadline"
    assert info.value.groups_broken and "rank 0" in str(info.value)


def test_work_that_completes_before_the_deadline_is_simply_awaited():
    p = pipeline(time.monotonic() + 5)
    t0 = time.monotonic()
    p._await(DoneLater(0.05), "the broadcast of bucket 0", time.monotonic())
    assert 0.04 < time.monotonic() - t0 < 4.0, "returns once the event is done, well before the 5 s deadline"
    assert p.stats.awaited == 1
