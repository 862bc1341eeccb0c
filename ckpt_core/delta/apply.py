"""The engine side of delta updates, engine-agnostic: one worker's held version, applying a delta
in place, checking it, undoing it.

An engine adapter keeps one :class:`DeltaReceiver` per worker and wraps each update's callbacks::

    receiver = DeltaReceiver(live=lambda name: params.get(name))       # tensors held verbatim
    with receiver.update(run=engine_run, on_plan=engine_on_plan, version="step-7") as cb:
        update_weights_from_ipc(ctx, handle, device, run=cb.run, on_plan=cb.on_plan, post_hook=cb.post_hook)

A full update (no delta manifest in the plan) goes to the engine's own callbacks and, once it
succeeded, the worker holds ``version``. A delta (``versions.py``: payloads named
``ckpt.delta:<tensor>``, one manifest per PS rank naming ``[base, version, rank, world]``):

- ``on_plan``: refused with ``DeltaBaseError`` unless every PS rank's manifest is there, they agree,
  and their base is the version this worker holds (before anything is mapped or written; the PS
  raises it on every rank);
- ``run``: each payload is decoded and checked whole (its body check, positions); where ``live(name)`` gives
  the tensor holding the checkpoint's bytes verbatim, the changed elements are scattered into it
  (the previous values kept for an undo); otherwise the full new tensor is rebuilt from the held
  checkpoint-format copy (``keep``) and handed to ``reload`` (the engine's own reload path) with
  the other changed tensors of the bucket. Either way the ``lin64`` digest of the result (the live
  tensor itself, or what the reload is given), computed on the device that holds it (no host copy,
  ``lin64.py``), must equal the version's, before the bucket reports done;
- any failure on any rank aborts the update on every worker (the PS's agreement), and leaving the
  ``with`` block by an exception undoes every write of this delta (scatters restored, rebuilt
  tensors reloaded from their base copy): the worker holds its base, byte for byte.

A version registered in pieces (``pieces.py``) sends a payload per changed piece, named by its box of the
whole tensor: it is scattered into that box of the live tensor (or of the tensor rebuilt from the kept copy,
which is then reloaded whole) and the piece's digest is checked there.

With ``defer_reload`` the rebuilt tensors are reloaded once, in the post hook, after every rank
checked every bucket (``DeltaReceiver``).

Pipelined (``update(pipelined=True)``, for a ``run`` handed to ``update_weights_from_ipc``): a bucket whose
every payload takes the gap16 route on a GPU is not waited for. Its checks, its swap (guarded on the device:
nothing is written unless every check passed) and its post-apply digests are queued, and ``run`` returns it
as ``wire.worker.Unfinished``; the receive loop runs the next bucket's host work while the device works on
this one, then finishes it (its values read back behind an event: a failed check or digest raises there)
and only then reports it done. Any bucket still unfinished is finished by the post hook and before the
update ends. A failure undoes every bucket's writes as above.

What is not covered yet: a post hook that fails after another worker finished (that one keeps the
new version), and engines whose reload cannot take the base copy back on undo.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable

import torch

from ckpt_core._settings import delta_drop_one
from ckpt_core.delta._gap_route import GapRoute, RouteFailed
from ckpt_core.delta._gap_route import take as take_gaps
from ckpt_core.delta._kernels import byte_span, disjoint, kernels, scatter_swap_many
from ckpt_core.delta.encode import Decoded, apply_decoded, as_words, decode_many_with, peek_payloads, undo_decoded
from ckpt_core.delta.lin64 import ReadLater, lin64_many, lin64_queue
from ckpt_core.delta.pieces import PIECE, parse_piece_name
from ckpt_core.delta.sliced import BOX, parse_box_name, region_of
from ckpt_core.delta.versions import MANIFEST, PAYLOAD, parse_manifest_name
from ckpt_core.errors import CheckpointFormatError, DeltaBaseError
from ckpt_core.wire.worker import Unfinished

Weights = list[tuple[str, torch.Tensor]]
# (checkpoint dtype, live dtype) a scatter may cast between: exact both ways, so the live tensor cast
# back holds the checkpoint's bytes (an engine serving a bf16 checkpoint in float32).
WIDENING = frozenset({(torch.bfloat16, torch.float32), (torch.float16, torch.float32)})


def apply_widened(target: torch.Tensor, d: Decoded) -> torch.Tensor | None:
    """``apply_decoded`` into a tensor of a wider dtype (``WIDENING``): the changed values cast up."""
    flat = target.reshape(-1)
    values = d.values.view(d.dtype).to(target.dtype)
    if d.positions is None:
        flat.copy_(values)
        return None
    pos = d.positions.to(flat.device)
    old = flat[pos]   # indexing copies
    flat[pos] = values.to(flat.device)
    return old


_DELTA_NAMES = "\nckpt.delta"   # what every delta name starts with (PAYLOAD, MANIFEST, BOX, PIECE)


def delta_of_plan(listing) -> tuple[str, str] | None:
    """``(base, version)`` when a plan's ``(name, dtype, shape)`` listing is a delta, None for a full
    update; ``DeltaBaseError``/``CheckpointFormatError`` when its manifests are incomplete or disagree."""
    names = [n for n, _, _ in listing]
    if _DELTA_NAMES not in "\n" + "\n".join(names):   # no name of a delta's (one search in C, not a call per name)
        return None
    parsed = [parse_manifest_name(n) for n in names if n.startswith(MANIFEST)]
    if not parsed:
        if any(n.startswith((PAYLOAD, BOX, PIECE)) for n in names):
            raise CheckpointFormatError("the update carries delta payloads but no delta manifest")
        return None
    manifests = [m for m in parsed if m is not None]
    if len(manifests) != len(parsed):
        raise CheckpointFormatError("a delta manifest's name is malformed")
    pairs = {(b, v, w) for b, v, _, w in manifests}
    if len(pairs) != 1:
        raise DeltaBaseError(f"the PS ranks' delta manifests disagree: {sorted(pairs)[:4]}")
    base, version, world = pairs.pop()
    ranks = sorted(r for _, _, r, _ in manifests)
    if ranks != list(range(world)):
        raise DeltaBaseError(f"the delta of {version!r} has manifests of PS ranks {ranks}, expected 0..{world - 1}")
    stray = [n for n in names if not n.startswith((PAYLOAD, MANIFEST, BOX, PIECE))]
    if stray:
        raise CheckpointFormatError(f"a delta update also carries whole tensors {stray[:4]}")
    return base, version


def _target_name(name: str) -> tuple[str, Any, str, tuple[int, ...] | None]:
    """(checkpoint tensor, box, name shown in errors, whole shape) of a payload's name: a whole tensor's
    (``ckpt.delta:<tensor>``, its box None and shown as itself), a box's (``sliced.BOX``: the box this engine
    rank reads) or a piece's (``pieces.PIECE``: a box of a tensor this worker holds whole, of that shape)."""
    piece = parse_piece_name(name)
    if piece is not None:
        tensor, shape, box = piece
        return tensor, box, f"{tensor}[piece {[list(b) for b in box]}]", shape
    parsed = parse_box_name(name)
    if parsed is None:
        return name[len(PAYLOAD):], None, name[len(PAYLOAD):], None
    tensor, sliced = parsed
    return tensor, sliced, f"{tensor}[box {'whole' if sliced is None else [list(b) for b in sliced]}]", None


class DeltaReceiver:
    """One engine worker's delta state.

    ``live(name)``: the live tensor that holds checkpoint tensor ``name``'s bytes verbatim
    (contiguous, the checkpoint's dtype and shape), or None where the engine derives its weights
    (fused, repacked, quantized). ``reload(weights)``: hands full checkpoint-format tensors to the
    engine's own reload path; needed for tensors ``live`` does not give. Those tensors need a
    checkpoint-format copy of the held version: the adapter gives it with :meth:`keep` (e.g. from
    its full updates' ``run``). ``held``: the version this worker holds (None: unknown).

    ``defer_reload``: rebuilt tensors go to ``reload`` once, in the post hook (after every PS rank
    agreed that every bucket arrived and was checked), not per bucket: an engine whose reload
    cannot be undone (vLLM's layerwise reload) then loads nothing of a delta that fails anywhere.
    ``complete``: that one reload also gets every kept tensor the delta did not change, for engines
    that need whole layers or a whole checkpoint per reload; or a callable that, given the names the
    delta rebuilt, names the unchanged tensors that must come with them (vLLM: the other tensors of
    the layers the changed ones load into, ``ckpt_vllm._delta_map``).

    ``live(name)`` may give a tensor of a wider float dtype than the checkpoint's (bf16 or fp16 held
    as float32: the cast is exact both ways), written with the cast and checked cast back.
    ``base(name)``: where no copy is kept, a tensor holding the held version's bytes of ``name``
    (a live tensor the engine derives its kernels from but keeps verbatim), read before the rebuild.

    ``live_box(name, box)``: for sliced deltas (``sliced.py``: the payloads of the boxes this engine
    rank reads, ``box`` None for a tensor it reads whole), the view of the live parameter that holds
    box ``box`` of checkpoint tensor ``name`` verbatim (its extent, in the box's element order; the
    checkpoint's dtype or a ``WIDENING`` of it), or None. The engine knows it from its slice plan (which
    parameter region each box was loaded into); a box it does not read must raise or give None: either
    fails the update. A contiguous view is scattered into and digested in place; a strided one (a box
    loaded into a column block of a fused parameter) through a contiguous copy of the region only: the
    copy is scattered into and digested, then written back once every payload of the bucket passed its
    check. A box without a live view (``live_box`` None, or giving None) is rebuilt as a whole tensor is,
    from the kept copy of the box (``keep(name, box tensor)``: what a sliced full update's ``run`` got),
    checked against the box's digest and handed to ``reload`` under the tensor's name.
    """

    def __init__(self, live: Callable[[str], torch.Tensor | None], *, reload: Callable[[Weights], object] | None = None,
                 held: str | None = None, defer_reload: bool = False,
                 complete: bool | Callable[[list[str]], list[str]] = False,
                 base: Callable[[str], torch.Tensor | None] | None = None,
                 live_box: Callable[[str, Any], torch.Tensor | None] | None = None):
        self.live, self.reload, self.held, self.live_box = live, reload, held, live_box
        self.defer_reload, self.complete, self.base = defer_reload, complete, base
        self.kept: dict[str, torch.Tensor] = {}
        self.last: dict = {}

    def base_of(self, name: str) -> torch.Tensor | None:
        """The held version's checkpoint-format bytes of ``name``: the kept copy, else ``base(name)``."""
        t = self.kept.get(name)
        if t is None and self.base is not None:
            t = self.base(name)
        return t

    def keep(self, name: str, tensor: torch.Tensor) -> None:
        """Keep a host copy of checkpoint tensor ``name`` of the version being made live (for deltas
        of tensors the engine derives)."""
        self.kept[name] = tensor.detach().to("cpu", copy=True)

    @contextmanager
    def update(self, *, run: Callable[[Weights], object], on_plan=None, post_hook=None, version: str | None = None,
               pipelined: bool = False):
        """The callbacks of one update (``cb.run``, ``cb.on_plan``, ``cb.post_hook``); see the module doc.

        ``pipelined``: ``cb.run`` may return a bucket's apply unfinished (``wire.worker.Unfinished``: only
        for a caller that finishes it, as ``update_weights_from_ipc``'s receive loop does) where every
        payload of the bucket takes the gap16 route (``_gap_route.py``): its checks, writes and post-apply
        digests are queued on the device, the writes guarded there by the checks' verdict, and read back
        once the next bucket's are queued. What is left unfinished is finished by the post hook and before
        the update ends, whoever calls it."""
        tx = _Update(self, run, on_plan, post_hook, pipelined)
        try:
            yield tx
            tx.finish_pending()
        except BaseException:
            tx.undo()
            raise
        tx.commit(version)


class _Update:
    def __init__(self, rx: DeltaReceiver, run, on_plan, post_hook, pipelined: bool = False):
        self.rx, self.engine_run, self.engine_on_plan, self.engine_post_hook = rx, run, on_plan, post_hook
        self.pipelined = pipelined
        self.unfinished: list[Unfinished] = []   # buckets returned unfinished (pipelined), in order
        self.delta: tuple[str, str] | None = None
        self.undo_log: list = []   # (target, decoded, old values, saved copy) per scatter, or a GapRoute
        self.rebuilt: dict[str, torch.Tensor] = {}   # tensor -> its new full bytes handed to reload
        self.writebacks: list[tuple[torch.Tensor, torch.Tensor]] = []   # (strided region, its checked new copy)
        self.figures: dict[str, Any] = {"scattered": 0, "reloaded": 0, "elements": 0, "payload_bytes": 0,
                                        "apply_s": 0.0, "verify_s": 0.0, "scattered_tensors": [],
                                        "apply_split_s": {}}   # host time of apply_s by step (see _lap)
        self.dropped = False
        self.ran = False   # a bucket reached run(): something may have been written
        self.deferred_ran = False   # the deferred reload started: the engine's own abort is what undoes it

    # -- the update's callbacks --------------------------------------------------
    def on_plan(self, listing) -> None:
        self.delta = delta_of_plan(listing)
        if self.delta is None:
            if self.engine_on_plan is not None:
                self.engine_on_plan(listing)
            return
        base, version = self.delta
        if self.rx.held != base:
            raise DeltaBaseError(f"this worker holds {self.rx.held!r}, not the base {base!r} of the delta of "
                                 f"{version!r}: nothing was written (update it whole)")

    def run(self, weights: Weights):
        self.ran = True
        if self.delta is None:
            return self.engine_run(weights)
        return self._apply(weights)

    def finish_pending(self) -> None:
        """Finish every bucket still unfinished (each once; one that failed raises again)."""
        for u in self.unfinished:
            u.finish()

    def post_hook(self):
        self.finish_pending()   # the receive loop finished them; anyone else's caller may not have
        if self.delta is not None and self.rx.defer_reload:
            weights = list(self.rebuilt.items()) + self._unchanged_companions()
            if weights:
                self.deferred_ran = True
                self.rx.reload(weights)
        if self.engine_post_hook is not None:
            return self.engine_post_hook()
        return None

    def _unchanged_companions(self) -> Weights:
        """The unchanged tensors the engine's reload needs with the rebuilt ones (``complete``)."""
        complete = self.rx.complete
        if not complete or not self.rebuilt:
            return []
        if not callable(complete):
            return [(n, t) for n, t in self.rx.kept.items() if n not in self.rebuilt]
        out = []
        for n in complete(list(self.rebuilt)):
            if n in self.rebuilt:
                continue
            t = self.rx.base_of(n)
            if t is None:
                raise CheckpointFormatError("the engine reloads this unchanged tensor with a changed one and this "
                                            "worker holds no copy of it", tensor=n)
            out.append((n, t))
        return out

    # -- delta ------------------------------------------------------------------------
    def _lap(self, step: str, since: float) -> float:
        """Add the host time since ``since`` to step ``step`` of ``apply_split_s``; now."""
        now = time.perf_counter()
        split = self.figures["apply_split_s"]
        split[step] = split.get(step, 0.0) + now - since
        return now

    def _apply(self, weights: Weights) -> Unfinished | None:
        t0 = started = time.perf_counter()
        checks: list[tuple[str, torch.Tensor, str, torch.dtype]] = []
        reloads: dict[str, torch.Tensor] = {}
        later: list[tuple[str, torch.Tensor, Decoded]] = []   # scatters for the bucket's one kernel
        named = [(_target_name(n), p) for n, p in weights if not n.startswith(MANIFEST)]
        raws = [p.reshape(-1) for _, p in named]
        heads = peek_payloads(raws, aside=self.pipelined)   # pipelined: the previous bucket's work is not waited for
        t0 = self._lap("peek", t0)
        # gap16 deltas of live tensors on a GPU: two kernels for the lot (_gap_route.py); the rest decoded here
        route, rest = take_gaps([t for t, _ in named], raws, heads, self.rx.live)
        t0 = self._lap("take", t0)
        if route is not None and not self.dropped and delta_drop_one() and route.drop_one() is not None:
            self.dropped = True
        if route is not None and not rest and self.pipelined:
            queued_bucket = self._apply_queued(route, started)
            if queued_bucket is not None:
                return queued_bucket
            route, rest = None, list(range(len(named)))   # the route's kernels failed: nothing was written
        queued = []
        if route is not None:
            try:
                queued = route.queue_checks()
            except RouteFailed:   # logged; nothing written: every payload the usual way
                route, rest = None, list(range(len(named)))
        # every payload of the bucket checked before anything is written, its checks read back together
        decoded_rest, route_values = decode_many_with([(named[i][0][2], raws[i]) for i in rest],
                                                      [heads[i] for i in rest], queued)
        if route is not None:
            route.raise_bad(route_values)
        for ((name, box, shown, whole), payload), decoded in zip((named[i] for i in rest), decoded_rest):
            d = self._maybe_drop(decoded)
            self.figures["payload_bytes"] += payload.numel()
            self.figures["elements"] += d.count
            if whole is not None:   # a piece: into its box of the whole tensor, checked there
                checks.append((shown, self._piece(name, whole, box, d, shown, reloads), d.digest, d.dtype))
                continue
            # a sliced delta's box goes into its live region, else is rebuilt like a whole tensor (from the
            # kept copy of the box: what this engine rank loaded) and reloaded
            boxed = shown != name
            target = (self.rx.live_box(name, box) if self.rx.live_box is not None else None) if boxed \
                else self.rx.live(name)
            if boxed and target is not None and not target.is_contiguous():
                checks.append((shown, self._scatter_region(name, target, d, shown), d.digest, d.dtype))
            elif target is not None:
                self._scatter_later(name, target, d, shown, later)
                checks.append((shown, target, d.digest, d.dtype))
            else:
                new = self._rebuild(name, d)
                reloads[name] = new
                checks.append((shown, new, d.digest, d.dtype))
        self._scatter_batched(later)
        if route is not None:
            self.undo_log.append(route)   # first: a swap that fails part-way undoes the groups it launched
            route.swap()
            for it in route.items:
                self.figures["payload_bytes"] += it.payload_bytes
                self.figures["elements"] += it.count
                self.figures["scattered"] += 1
                self.figures["scattered_tensors"].append(it.name)
                checks.append((it.name, it.target, it.digest, it.target.dtype))
        t1 = self._lap("decode_scatter", t0)
        self.figures["apply_s"] += t1 - started
        self._verify(checks)   # before the engine's reload: a wrong tensor is never loaded
        for region, new in self.writebacks:   # strided box regions: written once checked (their undo is saved)
            region.copy_(new)
        self.writebacks.clear()
        self.figures["verify_s"] += time.perf_counter() - t1
        if reloads:
            if self.rx.reload is None:
                raise CheckpointFormatError(f"the engine derives {next(iter(reloads))!r} and gave no reload path")
            self.rebuilt.update(reloads)
            self.figures["reloaded"] = len(self.rebuilt)   # tensors (a tensor's pieces may come in several buckets)
            if not self.rx.defer_reload:
                self.rx.reload(list(reloads.items()))
        return None

    def _apply_queued(self, route: GapRoute, t0: float) -> Unfinished | None:
        """A bucket wholly of the gap16 route, queued and left unfinished (``pipelined``): its checks, its
        guarded swap (nothing written on the device unless every check passed) and its post-apply digests,
        read back by ``finish``. None when the route's checks could not be launched (nothing was written)."""
        t = time.perf_counter()
        try:
            checks = route.queue_checks()
        except RouteFailed:
            return None
        t = self._lap("checks", t)
        self.undo_log.append(route)   # first (a swap failing part-way); its undo is guarded like the swap
        route.swap()
        t = self._lap("swap", t)
        post = lin64_queue([it.target for it in route.items], engine="torch")
        ready = ReadLater(checks + [q.total for q in post])
        self._lap("digests", t)
        for it in route.items:
            self.figures["payload_bytes"] += it.payload_bytes
            self.figures["elements"] += it.count
            self.figures["scattered"] += 1
            self.figures["scattered_tensors"].append(it.name)
        self.figures["apply_s"] += time.perf_counter() - t0

        def finish() -> None:
            t1 = time.perf_counter()
            try:
                got = ready.wait()
                route.raise_bad(got[: len(checks)])
                for it, q, value in zip(route.items, post, got[len(checks):]):
                    have = q.digest(value)
                    if have != it.digest:
                        raise CheckpointFormatError(f"after the delta's apply the tensor's bytes do not match the "
                                                    f"version's digest ({have} != {it.digest}); the update is undone",
                                                    tensor=it.name)
            finally:
                self.figures["verify_s"] += time.perf_counter() - t1

        out = Unfinished(finish)
        self.unfinished.append(out)
        return out

    def _scatter(self, name: str, target: torch.Tensor, d: Decoded, shown: str | None = None) -> None:
        """``d`` written into ``target``; ``shown``: the payload as errors name it (a box's), ``name`` the tensor."""
        widened = target.dtype != d.dtype
        if ((widened and (d.dtype, target.dtype) not in WIDENING) or tuple(target.shape) != d.shape
                or not target.is_contiguous()):
            raise CheckpointFormatError(f"the live tensor is {target.dtype} {list(target.shape)}, the delta "
                                        f"{d.dtype} {list(d.shape)}", tensor=shown or name)
        saved = target.clone() if d.positions is None else None
        self._scattered(name, target, d, apply_widened(target, d) if widened else apply_decoded(target, d), saved)

    def _scattered(self, name: str, target: torch.Tensor, d: Decoded, old: torch.Tensor | None,
                   saved: torch.Tensor | None) -> None:
        """A scatter done: its undo (the old values, or the saved whole tensor) and the figures."""
        self.undo_log.append((target, d, old, saved))
        self.figures["scattered"] += 1
        self.figures["scattered_tensors"].append(name)

    def _scatter_later(self, name: str, target: torch.Tensor, d: Decoded, shown: str,
                       later: list[tuple[str, torch.Tensor, Decoded]]) -> None:
        """``_scatter``, or kept in ``later`` for the bucket's one batched kernel where it can run there (the
        checkpoint's dtype, a list of positions, a contiguous tensor of the delta's shape, on a device where the
        kernels run); elsewhere written now, one by one, as before."""
        if (target.dtype == d.dtype and d.positions is not None and tuple(target.shape) == d.shape
                and target.is_contiguous() and kernels(target.device, "scatter") is not None):
            later.append((name, target, d))
        else:
            self._scatter(name, target, d, shown)

    def _scatter_batched(self, later: list[tuple[str, torch.Tensor, Decoded]]) -> None:
        """The kept scatters, one kernel per device and item size (``scatter_swap_many``: the old values
        gathered for the undo, the new ones written), or one by one where that kernel does not run."""
        groups: dict[tuple[torch.device, int], list[tuple[str, torch.Tensor, Decoded]]] = {}
        for item in later:
            groups.setdefault((item[1].device, item[1].element_size()), []).append(item)
        for group in groups.values():
            # one launch writes its targets at once: one overlapping a target taken (tied names of one tensor) is
            # written after it, one by one (the undo log stays in the order of the writes)
            taken, overlapping = disjoint([byte_span(t) for _, t, _ in group])
            items = [group[j] for j in taken]
            olds = scatter_swap_many([as_words(t) for _, t, _ in items],
                                     [d.positions for _, _, d in items],   # kept only with positions
                                     [d.values for _, _, d in items])
            if olds is None:
                for name, target, d in items:
                    self._scatter(name, target, d)
            else:
                for (name, target, d), old in zip(items, olds):
                    self._scattered(name, target, d, old, None)
            for j in overlapping:
                name, target, d = group[j]
                self._scatter(name, target, d)

    def _scatter_region(self, name: str, region: torch.Tensor, d: Decoded, shown: str) -> torch.Tensor:
        """A strided box region: the delta applied to a contiguous copy of it, returned for the check and
        written back after it (``writebacks``); the region's previous bytes kept for the undo."""
        saved = region.clone(memory_format=torch.contiguous_format)
        work = saved.clone()
        self._scatter(name, work, d, shown)
        self.undo_log[-1] = (region, d, None, saved)   # undo: the region's saved bytes, not the work copy's
        self.writebacks.append((region, work))
        return work

    def _piece(self, name: str, shape: tuple[int, ...], box, d: Decoded, shown: str,
               reloads: dict[str, torch.Tensor]) -> torch.Tensor:
        """A piece of a tensor this worker holds whole (``pieces.py``): scattered into its box of the live tensor,
        or applied to its box of the whole tensor rebuilt from the kept copy (one per tensor: its pieces may come
        in several buckets), then reloaded whole. Returns what the piece's digest is checked on."""
        live = self.rx.live(name)
        if live is not None:
            if tuple(live.shape) != shape:
                raise CheckpointFormatError(f"the live tensor is {list(live.shape)}, the delta's piece is of a tensor "
                                            f"of {list(shape)}", tensor=shown)
            region = region_of(live, box)
            if not region.is_contiguous():
                return self._scatter_region(name, region, d, shown)
            self._scatter(name, region, d, shown)
            return region
        new = reloads.get(name)
        if new is None:
            earlier = self.rebuilt.get(name)   # an earlier bucket's pieces (handed to reload: copied, not reused)
            base = earlier if earlier is not None else self.rx.base_of(name)
            if base is None or base.dtype != d.dtype or tuple(base.shape) != shape:
                raise CheckpointFormatError("the engine derives this tensor and this worker kept no copy of its base "
                                            "in checkpoint format", tensor=shown)
            new = reloads[name] = base.clone()
        region = region_of(new, box)
        if tuple(region.shape) != d.shape or d.dtype != new.dtype:
            raise CheckpointFormatError(f"the piece is {list(region.shape)}, its delta {d.dtype} {list(d.shape)}",
                                        tensor=shown)
        work = region if region.is_contiguous() else region.contiguous()
        apply_decoded(work, d)
        if work is not region:
            region.copy_(work)
        return work

    def _rebuild(self, name: str, d: Decoded) -> torch.Tensor:
        base = self.rx.base_of(name)
        if d.positions is None:
            new = torch.empty(d.shape, dtype=d.dtype)
        elif base is None or base.dtype != d.dtype or tuple(base.shape) != d.shape:
            raise CheckpointFormatError("the engine derives this tensor and this worker kept no copy of its base "
                                        "in checkpoint format", tensor=name)
        else:
            new = base.clone()
        apply_decoded(new, d)
        return new

    def _verify(self, checks) -> None:
        # a widened live tensor is cast back (exact), one at a time (a generator: each cast is freed once
        # its digest is queued); each digest runs on its tensor's own device, no copy to the host, and a
        # device's results are read back together
        held = (tensor if tensor.dtype == dtype else tensor.to(dtype) for _, tensor, _, dtype in checks)
        for (name, _, want, _), got in zip(checks, lin64_many(held)):
            if got != want:
                raise CheckpointFormatError(f"after the delta's apply the tensor's bytes do not match the version's "
                                            f"digest ({got} != {want}); the update is undone", tensor=name)

    def _maybe_drop(self, d: Decoded) -> Decoded:
        """CKPT_TEST_DELTA_DROP_ONE (tests only): the first scattered delta loses one changed element."""
        if self.dropped or d.positions is None or d.count == 0 or not delta_drop_one():
            return d
        self.dropped = True
        return Decoded(d.encoding, d.dtype, d.shape, d.count - 1, d.digest, d.positions[:-1], d.values[:-1])

    # -- end --------------------------------------------------------------------------
    def undo(self) -> None:
        """Put back every write of this delta (a full update: the worker's version is unknown)."""
        if not self.ran:
            return   # refused before any bucket: nothing was written, the worker holds what it held
        if self.deferred_ran:
            self.rx.held = None   # the engine's reload failed part-way: its own abort decides what it holds
        if self.delta is None:
            self.rx.held = None
            return
        self.writebacks.clear()
        for entry in reversed(self.undo_log):
            if isinstance(entry, GapRoute):
                entry.undo()
                continue
            target, d, old, saved = entry
            if saved is not None:
                target.copy_(saved)
            elif target.dtype != d.dtype:
                target.reshape(-1)[d.positions.to(target.device)] = old
            else:
                undo_decoded(target, d, old)
        self.undo_log.clear()
        if self.rebuilt and self.rx.reload is not None and not self.rx.defer_reload:
            self.rx.reload([(n, self.rx.kept[n]) for n in self.rebuilt if n in self.rx.kept])
        self.rebuilt.clear()

    def commit(self, version: str | None) -> None:
        if self.delta is None:
            self.rx.held = version
            self.rx.last = {"delta": False}
            return
        for name, new in self.rebuilt.items():
            if name in self.rx.kept or self.rx.base is None:   # a tensor read from the engine (base) is not copied
                self.rx.kept[name] = new
        self.rx.held = self.delta[1]
        self.rx.last = dict(self.figures, delta=True, base=self.delta[0], version=self.delta[1])
