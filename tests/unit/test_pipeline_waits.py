"""The pipeline never waits blindly on the device: a broadcast that cannot finish is a typed error."""

import time

import pytest

from ckpt_core._broadcast import BroadcastPipeline
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


def pipeline(deadline: float) -> BroadcastPipeline:
    p = BroadcastPipeline.__new__(BroadcastPipeline)
    p.rank, p.deadline = 1, deadline
    return p


def test_a_broadcast_that_never_completes_ends_in_a_timeout_at_the_deadline():
    p = pipeline(time.monotonic() + 0.3)
    t0 = time.monotonic()
    with pytest.raises(UpdateTimeoutError, match="rank 1: the broadcast of bucket 3 did not complete") as info:
        p._await(StuckEvent(), "the broadcast of bucket 3")
    assert 0.25 < time.monotonic() - t0 < 2.0
    assert isinstance(info.value, TransportError) and info.value.groups_broken


def test_work_that_completes_before_the_deadline_is_simply_awaited():
    p = pipeline(time.monotonic() + 5)
    t0 = time.monotonic()
    p._await(DoneLater(0.05), "the broadcast of bucket 0")
    assert time.monotonic() - t0 < 1.0
