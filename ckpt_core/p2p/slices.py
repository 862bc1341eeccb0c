"""Slices on the P2P path (``update(name, req, ranks=[...], slices=plan)``).

The targets in rank order are engine ranks 0, 1, ... of the plan (``ranks=[1, 0]`` is ``[0, 1]``:
PS rank 0 feeds engine rank 0, as on the broadcast path, where PS rank p feeds p % T; the hello
tells each worker its engine rank, which it checks). Routing is the broadcast
path's (``planning.slice_routes.plan_sliced``): tensors every engine rank reads whole go in ordinary
buckets (one reader, verified, broadcast in the target group, as an unsliced P2P update); a
bucket of slices for engine rank ``t`` is read by target ``t`` itself, straight from the owner's
registered host memory, as the contiguous runs of each slice's box (:func:`box_runs`: a dim-0
slice is one run, a dim-1 slice of a ``[R, C]`` tensor ``R`` runs), and never sent on.

Integrity: a whole tensor's digest (taken at registration, ``p2p/digests.py``) cannot check a
slice. So every owner of this world digests each distinct box of the plan over its own tensors
(:func:`box_digests`), once per (checkpoint, plan digest), after checking those tensors against
their registration digests again (a box digest never blesses bytes rewritten since), and sends
them in the update's first exchange (JSON). A target checks every slice it read against them
(:func:`slices_mismatch`) before its engine is told to load the bucket.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import NamedTuple

from ckpt_core.errors import ConfigError, TransportError
from ckpt_core.p2p.digests import digests_of
from ckpt_core.planning.buckets import CopyRun, Plan, TensorMeta, align_up, interleave, merge_runs
from ckpt_core.planning.slice_routes import BoxCopy, SlicedBucket, plan_sliced
from ckpt_core.planning.slices import SlicePlan, box_extent, box_offsets, require_plan
from ckpt_core.transfer.pipeline import byte_box

DIGEST_BATCH_BYTES = 256 << 20   # an owner packs at most this many bytes of boxes at once to digest them
# A hole between two runs of slices shorter than this is read too, so that the runs and the hole
# are one descriptor: on Mooncake's TCP transport a descriptor costs ~40 us, the time of ~40 KB at
# its ~1 GB/s (benchmarks/p2p_slice_probe.py, docs/p2p.md). What such a read lands in a zone after
# the bucket in its slot (at most LANDING_BYTES, and at most the bucket size) and is gathered into
# the slices from there.
GAP_BYTES = 32 << 10
LANDING_BYTES = 64 << 20
NO_PIN_CHUNK = 1 << 62   # Mooncake reads host memory whatever its pinning: runs are never cut at pinned pieces


def box_key(box) -> str:
    """A box as the key of its digest (JSON of its canonical chain)."""
    return json.dumps([list(x) for x in box or ()], separators=(",", ":"))


def check_call(plan, targets: tuple[int, ...], metas: list[list[TensorMeta]]) -> None:
    """Refuse, before anything moves, a sliced P2P call that cannot be right: a plan whose engine
    ranks are not the targets, and whatever :func:`check_plan` refuses."""
    check_plan(plan, metas)
    if len(plan.ranks) != len(targets):
        raise ConfigError(f"the slice plan has {len(plan.ranks)} engine ranks but the P2P update has "
                          f"{len(targets)} target(s) {list(targets)}: the targets in rank order are its engine ranks")


def check_plan(plan, metas: list[list[TensorMeta]]) -> None:
    """Refuse a plan that cannot serve this checkpoint: not a plan, a plan recorded for another
    checkpoint (a tensor of another dtype or shape, or one that only the plan or only the
    checkpoint has), tensors registered in pieces."""
    require_plan(plan)
    if any(m.box is not None for ms in metas for m in ms):
        raise ConfigError("slices of tensors registered in pieces are not supported on P2P updates: "
                          "update without slices")
    have = {m.name: (m.dtype, tuple(m.shape)) for ms in metas for m in ms}
    for name, (dtype, shape, _) in plan.tensors.items():
        if name in have and have[name] != (dtype, tuple(shape)):
            raise ConfigError(f"the slice plan was recorded for another checkpoint: tensor {name!r} is "
                              f"{have[name][0]}{list(have[name][1])} here, {dtype}{list(shape)} in the plan")
    only_plan, only_ckpt = sorted(set(plan.tensors) - set(have)), sorted(set(have) - set(plan.tensors))
    if only_plan or only_ckpt:
        raise ConfigError(f"the slice plan was recorded for another checkpoint: the plan has {only_plan[:4]} "
                          f"({len(only_plan)}) that the checkpoint lacks, the checkpoint {only_ckpt[:4]} "
                          f"({len(only_ckpt)}) that the plan lacks")


def published_boxes(name: str, src, plan: SlicePlan) -> list[dict[str, dict[str, str]] | None]:
    """A joining world's box digests of ``plan``, per owner, from its loaded metas (the owners
    published them: ``get_metas(slices=plan)``). Every box the plan reads of an owner's tensors
    must have one; else a ConfigError naming the fix, before a byte moves."""
    wanted = read_boxes(plan)
    out = []
    for r, (ms, peer) in enumerate(zip(src.metas, src.peers)):
        mine = (peer.slices or {}).get(plan.digest) if peer is not None else None
        need = [(m.name, box_key(b)) for m in ms if m.nbytes for b in wanted.get(m.name, ())]
        missing = [f"{n} {k}" for n, k in need if (mine or {}).get(n, {}).get(k) is None]
        if missing:
            had = sorted((peer.slices or {}) if peer is not None else ())
            raise ConfigError(
                f"a sliced P2P update of {name!r} from loaded metas needs its owners' digests of the plan's slices: "
                f"owner rank {r} published none for slice plan {plan.digest[:12]} ({len(missing)} box(es), e.g. "
                f"{missing[0]}; it published plans {[h[:12] for h in had]}). Save the owners' metas with that plan: "
                "ps.save_metas(path, slices=plan) (or get_metas(slices=plan)) on every owner rank, then load_metas "
                "them here again")
        out.append(mine)
    return out


def route(metas: list[list[TensorMeta]], plan: SlicePlan, bucket_bytes: int) -> tuple[Plan, list[int]]:
    """The buckets of a sliced P2P update and the owner of each: ``plan_sliced`` per owner (owners
    and engine ranks are unrelated here: any number of owners, of this world or another, feed the
    targets), interleaved over owners so that consecutive reads leave from distinct owners.

    ``plan_sliced`` maps PS rank r to engine rank r and so wants one metas list per engine rank:
    each owner's tensors are routed as if rank 0 of such a world held them (the buckets' own
    ``owner`` is then 0; the returned list says whose they are)."""
    streams = []
    for owner, mine in enumerate(metas):
        if mine:
            part = plan_sliced([list(mine)] + [[] for _ in plan.ranks[1:]], plan, bucket_bytes)
            assert all(b.owner == 0 for b in part.buckets), "plan_sliced routed a tensor from an empty owner"  # noqa: S101 - plan_sliced's invariant, not input
            streams.append([(owner, b) for b in part.buckets])
    pairs = interleave(streams)
    return Plan(bucket_bytes, tuple(b for _, b in pairs)), [o for o, _ in pairs]


def box_runs(bc: BoxCopy) -> list[CopyRun]:
    """The contiguous runs of one slice in its owner's host memory, in the packed order of the
    slice at ``bc.offset`` of the bucket: the rows of its pitched copies (``planning/boxcopy.py``;
    a read is not cut at pinned pieces). The dims inside the innermost partial dim are read whole,
    so a slice of rows is one run and a slice of columns one run per row."""
    copies = bc.copies(pin_chunk=NO_PIN_CHUNK)
    return merge_runs(CopyRun(bc.base, c.src + i * c.pitch, c.dst + i * c.width, c.width)
                      for c in copies for i in range(c.height))


def bucket_runs(bucket: SlicedBucket) -> tuple[CopyRun, ...]:
    """Every slice of a bucket as runs, merged where host and bucket positions advance together."""
    return tuple(merge_runs(r for bc in bucket.boxes for r in box_runs(bc)))


class Gather(NamedTuple):
    """``count`` pieces of ``nbytes``, at ``src + i * stride`` of the landing zone, copied to
    ``dst + i * nbytes`` of the bucket (consecutive rows of one slice)."""
    src: int
    dst: int
    nbytes: int
    count: int  # type: ignore[assignment]  # a field named count shadows tuple.count, as intended
    stride: int


@dataclass(frozen=True)
class SliceReads:
    """How a target reads one bucket of slices: ``direct`` runs straight into their place, then each
    round's spans (``offset``: in the landing zone) into the landing zone, gathered from there."""
    direct: tuple[CopyRun, ...]
    rounds: tuple[tuple[tuple[CopyRun, ...], tuple[Gather, ...]], ...]
    landing: int           # bytes of landing zone the rounds need

    @property
    def nbytes(self) -> int:
        """Bytes read over the network (holes read with their neighbours included)."""
        return sum(r.nbytes for r in self.direct) + sum(r.nbytes for spans, _ in self.rounds for r in spans)


def _spans(runs, gap: int, cap: int) -> list[list[CopyRun]]:
    """Consecutive runs of one host region, each after the last, with holes of at most ``gap``
    bytes and a span of at most ``cap`` bytes, grouped."""
    out: list[list[CopyRun]] = []
    for r in runs:
        cur = out[-1] if out else None
        if cur and r.base == cur[0].base and 0 <= r.base_offset - (cur[-1].base_offset + cur[-1].nbytes) <= gap \
                and r.base_offset + r.nbytes - cur[0].base_offset <= cap:
            cur.append(r)
        else:
            out.append([r])
    return out


def _gathers(span: list[CopyRun], at: int) -> list[Gather]:
    """The copies out of a span read at ``at`` of the landing zone: runs of one size, one stride
    apart in the host and back to back in the bucket become one strided copy."""
    out: list[Gather] = []
    for r in span:
        src = at + r.base_offset - span[0].base_offset
        g = out[-1] if out else None
        # a second piece sets the stride (any step forward), a later one must keep it
        if g and r.nbytes == g.nbytes and r.offset == g.dst + g.count * g.nbytes and (
                src > g.src if g.count == 1 else src == g.src + g.count * g.stride):
            out[-1] = g._replace(count=g.count + 1, stride=src - g.src if g.count == 1 else g.stride)
        else:
            out.append(Gather(src, r.offset, r.nbytes, 1, r.nbytes))
    return out


def slice_reads(bucket: SlicedBucket, gap: int = GAP_BYTES, landing: int = LANDING_BYTES) -> SliceReads:
    """The read plan of a bucket of slices (pure): a run alone is read straight into the bucket; runs
    that holes of at most ``gap`` bytes separate are read as one span into the landing zone and
    gathered (``_gathers``), in rounds of at most ``landing`` bytes."""
    direct: list[CopyRun] = []
    rounds: list[tuple[tuple[CopyRun, ...], tuple[Gather, ...]]] = []
    spans: list[CopyRun] = []
    gathers: list[Gather] = []
    used = 0
    for span in _spans(bucket_runs(bucket), gap, landing):
        if len(span) == 1:
            direct.append(span[0])
            continue
        size = span[-1].base_offset + span[-1].nbytes - span[0].base_offset
        if used and align_up(used) + size > landing:
            rounds.append((tuple(spans), tuple(gathers)))
            spans, gathers, used = [], [], 0
        at = align_up(used)
        spans.append(CopyRun(span[0].base, span[0].base_offset, at, size))
        gathers += _gathers(span, at)
        used = at + size
    if spans:
        rounds.append((tuple(spans), tuple(gathers)))
    need = max((s.offset + s.nbytes for spans_, _ in rounds for s in spans_), default=0)
    return SliceReads(tuple(direct), tuple(rounds), need)


def read_boxes(plan: SlicePlan) -> dict[str, list]:
    """Per tensor, the distinct boxes the plan's ranks read of it (a whole read is not a box)."""
    out: dict[str, list] = {}
    for rs in plan.ranks:
        for name, box in rs.needs.items():
            if box and box not in out.setdefault(name, []):
                out[name].append(box)
    return {n: b for n, b in out.items() if b}


def box_digests(ckpt, registered: dict[str, str] | None, plan: SlicePlan, rank: int) -> dict[str, dict[str, str]]:
    """An owner's digests of the plan's boxes of its tensors: ``{tensor: {box_key: digest}}``.

    First every such tensor is checked against the digest taken at its registration: bytes
    rewritten since (a foreign Mooncake peer can write served memory) are a TransportError
    here, never digested into a box. Packs at most DIGEST_BATCH_BYTES of boxes at a time."""
    if registered is None:
        raise ConfigError(f"rank {rank} serves no digests of {ckpt.name!r}: a sliced P2P update cannot check it")
    wanted = read_boxes(plan)
    metas = [m for m in ckpt.metas if m.name in wanted and m.nbytes]
    host = {rid: r.tensor for rid, r in ckpt.regions.items()}
    views = [host[m.base][m.base_offset: m.base_offset + m.nbytes] for m in metas]
    for m, got in zip(metas, digests_of(views)):
        if registered.get(m.name) != got:
            raise TransportError(f"P2P slices of {ckpt.name!r} refused on owner rank {rank}: tensor {m.name!r} no "
                                 "longer matches the digest taken at its registration (its memory was written "
                                 "since: a foreign Mooncake peer can write registered memory, docs/p2p.md)")
    out: dict[str, dict[str, str]] = {}
    batch: list[tuple[str, str, object]] = []

    def flush():
        for (name, key, _), digest in zip(batch, digests_of([packed for _, _, packed in batch])):
            out.setdefault(name, {})[key] = digest
        batch.clear()
    size = 0
    for m in metas:
        for box in wanted[m.name]:
            packed = byte_box(host[m.base][m.base_offset:], m.shape, box_offsets(m.shape, box),
                              box_extent(m.shape, box), m.itemsize).contiguous().view(-1)
            batch.append((m.name, box_key(box), packed))
            size += packed.numel()
            if size >= DIGEST_BATCH_BYTES:
                flush()
                size = 0
    flush()
    return out


def slices_mismatch(bucket, slot, owner_digests: dict[str, str] | None,
                    owner_boxes: dict[str, dict[str, str]] | None) -> str | None:
    """Why the slices of a bucket just read into ``slot`` must not be loaded, or None when each
    matches its owner's digest of that box (a tensor read whole: its registration digest)."""
    want = []
    for bc, p in zip(bucket.boxes, bucket.placements):
        name = p.meta.name
        digest = ((owner_boxes or {}).get(name, {}).get(box_key(bc.box)) if bc.box else
                  (owner_digests or {}).get(name))
        if digest is None:
            return f"its owner published no digest of the slice {box_key(bc.box)} of tensor {name!r}"
        want.append((p, digest))
    got = digests_of([slot[p.offset: p.offset + p.meta.nbytes] for p, _ in want])
    for (p, digest), have in zip(want, got):
        if digest != have:
            return (f"the slice of tensor {p.meta.name!r} does not match the digest its owner took of it (its memory "
                    "was written after registration: a foreign Mooncake peer can write registered memory, docs/p2p.md)")
    return None


def per_target(buckets, order: list[int]) -> tuple[list[int], list[int]]:
    """(bytes each target's engine receives, bytes each target reads over the network) of the P2P
    buckets of a sliced update (``owner``: the reader; ``dest``: the engine rank of a bucket of
    slices; ``reads``: its read plan, holes read with their neighbours included)."""
    received = [sum(p.meta.nbytes for b in buckets if getattr(b, "dest", t) == t for p in b.placements)
                for t in range(len(order))]
    read = [sum(b.reads.nbytes if getattr(b, "reads", None) else sum(r.nbytes for _, runs in b.parts for r in runs)
                for b in buckets if b.owner == rank) for rank in order]
    return received, read
