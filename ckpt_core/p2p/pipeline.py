"""The P2P update's pipeline: the broadcast pipeline with the owner's host-to-device copy
replaced by a Mooncake read from the owner's registered host memory (``p2p/store.py``).

Each broadcast slot carries one status byte after the bucket (1: read, 0: not): a target
never hands its worker a bucket whose read failed. Any failure of a read on this rank, ours or
not, is recorded on the link and travels through the update's status agreement; the rank
keeps issuing the remaining broadcasts so that no peer waits for it.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass

from ckpt_core.errors import ConfigError, TransportError, UpdateTimeoutError
from ckpt_core.p2p.digests import bucket_mismatch, pieces_mismatch
from ckpt_core.p2p.metas import Peer
from ckpt_core.p2p.slices import SliceReads, slices_mismatch
from ckpt_core.p2p.store import MARK, P2PStore
from ckpt_core.planning.buckets import Bucket
from ckpt_core.transfer.pipeline import BroadcastPipeline
from ckpt_core.wire.link import Failure


@dataclass(eq=False)
class P2PBucket(Bucket):
    """A bucket as a P2P update moves it: ``owner`` is the target rank that reads and broadcasts
    it, ``source`` the rank that holds its bytes; ``nbytes`` includes the trailing status byte."""
    source: int = -1
    index: int = -1
    parts: tuple = ()    # ((owner rank, its host runs), ...): one owner, or each piece's owner in a bucket of pieces

    @property
    def sources(self) -> str:
        ranks = sorted({r for r, runs in self.parts if runs}) or [self.source]
        return f"owner rank {ranks[0]}" if len(ranks) == 1 else f"owner ranks {ranks}"


@dataclass(eq=False)
class P2PSliceBucket(P2PBucket):
    """A bucket of engine rank ``dest``'s slices (``p2p/slices.py``): ``owner``, the target that is
    that engine rank, reads it straight from ``source`` and keeps it; no other target touches it."""
    dest: int = 0
    boxes: tuple = ()    # the slices' BoxCopy entries, in the order of ``placements``
    reads: SliceReads = SliceReads((), (), 0)  # how it is read (p2p/slices.slice_reads)
    land_at: int = 0     # where its landing zone starts in the slot (after the slices, before the status byte)


class NoLink:
    """A rank outside ``ranks`` has no worker to talk to; its own failure (close()) still travels."""
    failure: Failure | None = None

    def send_abort(self, reason: str) -> None:
        pass


class NoReq:
    """A rank outside ``ranks`` runs no req_func."""
    error = None

    def join(self, timeout=None) -> None:
        pass

    def is_alive(self) -> bool:
        return False


class GroupColl:
    """The pipeline's view of the collectives: broadcasts go to the target group (of ``world_size``
    ranks: what a reader's broadcast reaches, for the pipeline's sent-bytes count). A P2P plan has
    no replica groups: buckets of slices are read by their target, never broadcast."""

    def __init__(self, coll, group, world_size: int):
        self.coll, self.target_group, self.timeout, self.world_size = coll, group, coll.timeout, world_size

    def broadcast(self, tensor, src: int, *, async_op: bool):
        return self.coll.broadcast(tensor, src, async_op=async_op, group=self.target_group)

    def group(self, ranks):
        raise ConfigError(f"a P2P update has no replica groups (asked for {list(ranks)})")


class P2PPipeline(BroadcastPipeline):
    """The broadcast pipeline with the owner's host-to-device copy replaced by a P2P read."""

    def __init__(self, *, store: P2PStore, peers: list, should_stop, read_deadline: float,
                 box_digests: dict | None = None, **kw):
        super().__init__(**kw)
        self.store, self.peers, self.should_stop, self.read_deadline = store, peers, should_stop, read_deadline
        self.box_digests = box_digests or {}   # owner rank -> its digests of the slice plan's boxes
        self.pending_read = None      # the future of a failed read: the buffer is unsettled until it is done
        self.read_bytes = 0

    def _move(self, bucket, dst) -> None:
        """A bucket of slices is read by its one target and goes no further; the others skip it."""
        if not isinstance(bucket, P2PSliceBucket):
            super()._move(bucket, dst)
        elif bucket.owner == self.rank:
            self._stage(bucket, dst)

    def _stage(self, bucket: P2PBucket, dst) -> int:
        n, ok = bucket.nbytes - 1, False
        if self.link.failure is None and self.pending_read is None:
            ok = self._read(bucket, dst)
        dst[n: n + 1].fill_(1 if ok else 0)
        return n

    def _read(self, bucket: P2PBucket, dst) -> bool:
        """Read one bucket into ``dst``; whether it arrived. A failure fails the link, never raises."""
        index = bucket.index   # a bucket's bytes (of a bucket of slices: its slices', without its landing zone)
        n = sum(p.meta.nbytes for p in bucket.placements) if isinstance(bucket, P2PSliceBucket) else bucket.nbytes - 1
        # 0-byte tensors are placed but never read: an owner serves no region of 0 bytes
        parts = [(src, [r for r in runs if r.nbytes])
                 for src, runs in (bucket.parts or ((bucket.source, bucket.copy_runs),))]
        parts = [(src, runs) for src, runs in parts if runs]
        stopped: list[str] = []

        def should_stop():
            why = self.should_stop()
            if why:
                stopped.append(why)
            return why
        try:
            base = dst.data_ptr()
            if isinstance(bucket, P2PSliceBucket):
                self._read_slices(bucket, dst, should_stop)
            else:
                for source, runs in parts:   # each piece from the owner that holds it
                    peer: Peer = self.peers[source]
                    descs = [(base + r.offset, peer.regions[r.base][0] + r.base_offset, r.nbytes) for r in runs]
                    self.store.read(peer, source, descs, what=f"bucket {index} ({n} bytes)",
                                    deadline=self.read_deadline, should_stop=should_stop)
            if parts:
                bad = self._mismatch(bucket, dst, parts[0][0])
                if bad:
                    where = "" if bucket.spans else f" at {self.peers[parts[0][0]].address}"
                    raise TransportError(f"{MARK} of bucket {index} ({n} bytes) from {bucket.sources}{where} "
                                         f"is refused: {bad}")
            self.read_bytes += (bucket.reads.nbytes if isinstance(bucket, P2PSliceBucket) else
                                sum(r.nbytes for _, runs in parts for r in runs))
            return True
        except Exception as exc:   # ours or not: it must reach every rank through the agreement
            self.pending_read = getattr(exc, "pending", None)
            done = f"; {index} of {len(self.plan.buckets)} buckets had been handed to the engines" if index else ""
            tb = ""
            if stopped:     # an echo of another rank's failure (or of close()), not a read failure
                message = f"stopped while reading bucket {index} from {bucket.sources}: {stopped[0]}"
            elif isinstance(exc, TransportError):
                message = f"{exc}{done}"
            else:
                message = (f"{MARK} of bucket {index} from {bucket.sources} failed on this rank: "
                           f"{type(exc).__name__}: {exc}{done}")
                tb = traceback.format_exc()
            self.link._fail(message, tb=tb, timeout=not stopped and isinstance(exc, UpdateTimeoutError))
            self._report()
            return False

    def _read_slices(self, bucket: P2PSliceBucket, dst, should_stop) -> None:
        """Runs alone straight into their place; spans of runs and the holes between them into the
        landing zone, round by round, each gathered into its slices before the next lands."""
        peer: Peer = self.peers[bucket.source]
        what = f"bucket {bucket.index} ({sum(p.meta.nbytes for p in bucket.placements)} bytes of slices)"

        def read(runs, at: int) -> None:
            descs = [(at + r.offset, peer.regions[r.base][0] + r.base_offset, r.nbytes) for r in runs]
            self.store.read(peer, bucket.source, descs, what=what, deadline=self.read_deadline,
                            should_stop=should_stop)
        if bucket.reads.direct:
            read(bucket.reads.direct, dst.data_ptr())
        for spans, gathers in bucket.reads.rounds:
            read(spans, dst.data_ptr() + bucket.land_at)
            for g in gathers:
                src = dst.as_strided((g.count, g.nbytes), (g.stride, 1), dst.storage_offset() + bucket.land_at + g.src)
                dst[g.dst: g.dst + g.count * g.nbytes].view(g.count, g.nbytes).copy_(src)
            self.backend.synchronize(self.index)   # gathered before the next round lands or the check reads it

    def _mismatch(self, bucket, dst, source: int) -> str | None:
        """p2p/digests.py: whole tensors against their owner's digests, pieces against each owner's,
        slices against their owner's digests of the plan's boxes (p2p/slices.py)."""
        if isinstance(bucket, P2PSliceBucket):
            return slices_mismatch(bucket, dst, self.peers[source].digests, self.box_digests.get(source))
        if bucket.spans:
            return pieces_mismatch(bucket.spans, dst, self.peers)
        return bucket_mismatch(bucket.placements, dst, self.peers[source].digests)

    def _notify(self, index: int, slot: int, event, issued: float) -> None:
        bucket = self.plan.buckets[index]
        assert isinstance(bucket, P2PBucket)  # noqa: S101 - type narrowing: a P2P plan's buckets
        self._await(event, f"the broadcast of bucket {index} from rank {bucket.owner}", issued)
        at = slot * self.slot_bytes + bucket.nbytes - 1
        theirs = isinstance(bucket, P2PSliceBucket) and bucket.owner != self.rank   # nothing of it is here
        if self.link.failure is None and not theirs and int(self.ipc.tensor[at: at + 1].item()) != 1:
            self.link._fail(f"stopped while receiving bucket {index}: its reader, rank {bucket.owner}, "
                            f"could not read it from {bucket.sources}")
        self.link.send_bucket(index, slot)
        self._report()
