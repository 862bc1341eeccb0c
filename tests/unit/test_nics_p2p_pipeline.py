"""The P2P pipeline's own steps, with small fakes for the link and the store (no Mooncake needed):
a bucket whose read failed is never handed to an engine, and a failed read stops further reads."""

import ctypes
import time
from concurrent.futures import Future
from types import SimpleNamespace

import torch

from ckpt_core.p2p.metas import Peer
from ckpt_core.p2p.pipeline import P2PBucket, P2PPipeline
from ckpt_core.planning.buckets import Placement, Plan, TensorMeta
from ckpt_core.errors import TransportError
from ckpt_core.p2p.digests import digest_of


class Link:
    def __init__(self):
        self.failure, self.sent = None, []

    def send_bucket(self, index, slot):
        if self.failure is None:
            self.sent.append(index)

    def _fail(self, message, *, tb="", timeout=False):
        if self.failure is None:
            self.failure = SimpleNamespace(message=message, timeout=timeout)


REMOTE = 4096   # where the fake owner's region "lives" in the peer's address space
OWNER = torch.randint(1, 256, (1 << 12,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))


class Store:
    """Reads copy from ``OWNER`` as Mooncake would from the owner's region."""

    def __init__(self, fail=False):
        self.fail, self.calls = fail, []

    def read(self, peer, owner, descs, *, what, deadline, should_stop):
        self.calls.append((owner, descs))
        if self.fail:
            exc = TransportError(f"P2P read of {what} from owner rank {owner} at {peer.address} failed")
            exc.pending = Future()
            raise exc
        for lp, rp, n in descs:
            ctypes.memmove(lp, OWNER.data_ptr() + rp - REMOTE, n)


def pipeline(store, nbytes=64, buckets=2, digest=None):
    meta = TensorMeta("w", "U8", (nbytes,), nbytes, 1, 0, 0)
    plan = Plan(1024, tuple(P2PBucket(owner=1, placements=[Placement(meta, 0)], nbytes=nbytes + 1, source=0, index=i)
                            for i in range(buckets)))
    p = P2PPipeline.__new__(P2PPipeline)
    p.plan, p.rank, p.link, p.store, p.slot_bytes = plan, 1, Link(), store, 128
    p.ipc = SimpleNamespace(tensor=torch.zeros(128 * buckets, dtype=torch.uint8))
    digest = digest_of(OWNER[:nbytes]) if digest is None else digest
    p.peers = [Peer("127.0.0.2:15000", "127.0.0.2", None, {0: (REMOTE, 1 << 20)}, None, {"w": digest})]
    p.should_stop, p.read_deadline, p.deadline, p.collective_s = (lambda: None), time.monotonic() + 60, 1e18, 600
    p.pending_read, p.read_bytes, p.on_failure = None, 0, None
    return p


class Done:
    def query(self):
        return True


def test_a_read_bucket_carries_status_1_and_reaches_the_worker():
    p = pipeline(Store())
    dst = p.ipc.tensor[0:65]
    assert p._stage(p.plan.buckets[0], dst) == 64
    assert int(dst[64]) == 1 and p.read_bytes == 64 and torch.equal(dst[:64], OWNER[:64])
    p._notify(0, 0, Done(), time.monotonic())
    assert p.link.sent == [0] and p.link.failure is None


def test_a_bucket_whose_bytes_differ_from_the_owners_digest_carries_status_0_and_reaches_no_worker():
    p = pipeline(Store(), digest="0" * 32)   # the owner's memory changed after it took its digests
    dst = p.ipc.tensor[0:65]
    p._stage(p.plan.buckets[0], dst)
    assert int(dst[64]) == 0 and p.pending_read is None, "a completed read leaves nothing unsettled"
    msg = p.link.failure.message
    assert msg.startswith("P2P read of bucket 0") and "owner rank 0 at 127.0.0.2:15000" in msg
    assert "tensor 'w' does not match the digest its owner took at registration" in msg
    p._notify(0, 0, Done(), time.monotonic())
    assert p.link.sent == []


def test_a_failed_read_writes_status_0_names_the_owner_and_no_engine_gets_the_bucket():
    p = pipeline(Store(fail=True))
    dst = p.ipc.tensor[0:65]
    dst[64] = 1                      # a stale status byte from an earlier bucket in this slot
    p._stage(p.plan.buckets[0], dst)
    assert int(dst[64]) == 0 and p.pending_read is not None
    assert "owner rank 0 at 127.0.0.2:15000" in p.link.failure.message
    p._stage(p.plan.buckets[1], p.ipc.tensor[128:193])
    assert len(p.store.calls) == 1, "no read after a failed one (its buffer is unsettled)"
    p._notify(0, 0, Done(), time.monotonic())
    assert p.link.sent == []


def test_a_target_that_receives_status_0_stops_before_handing_the_bucket_to_its_worker():
    p = pipeline(Store())
    p.ipc.tensor[64] = 0             # what the broadcast delivered: the reader's read failed
    p._notify(0, 0, Done(), time.monotonic())
    assert p.link.sent == [] and "its reader, rank 1, could not read it from owner rank 0" in p.link.failure.message
    assert p.link.failure.message.startswith("stopped while"), "an echo: the reader's failure is the cause"
