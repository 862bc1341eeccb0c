"""Record which part of each checkpoint tensor this vLLM worker's loaders read, and replay it.

**Recording** (:func:`record`): the model's layers are put back in checkpoint format on the meta
device (the start of vLLM's layerwise reload), and the model's own ``load_weights`` runs over
zero-storage tensors (:class:`_Lazy`, a ``_make_wrapper_subclass``) named and shaped like the
checkpoint, with the layers' own weight loaders (not the reload's buffering wrappers). A lazy
tensor follows the view ops a loader applies (narrow, view, transpose, split, ...: the geometry is
kept on a meta tensor of the checkpoint tensor's shape); its ``copy_`` into a parameter is the
sink, where the box it read (``planning.slices.view_box``) and the region it wrote are recorded.
Fills of a parameter by the loader itself (a padded vocabulary's rows) are recorded as the
engine's own writes. No byte is written anywhere: the live layers are put back afterwards.

Fail closed: a tensor a loader reads through any other op (arithmetic, ``.to``, a copy), or whose
read or write is not exactly one box, is recorded as needed whole (logged once), never as a
guessed slice. A parameter changed in any other way leaves the plan (its writers go whole).

**Replay** (:class:`SliceTensor`): a received slice is handed to the same ``load_weights`` as a
tensor of the checkpoint tensor's full shape that holds only the slice's bytes. The loader's view
ops are followed the same way; its ``copy_`` reads the slice (``planning.slices.view_in_box``),
and any op the recording did not allow is an error. So vLLM's layerwise reload, fused layers
(``qkv_proj``, ``gate_up_proj``), padding and post-load processing run exactly as for a whole
tensor.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Set as AbstractSet
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ckpt_core.checkpoint.safetensors import WIRE_DTYPES
from ckpt_core.errors import CheckpointFormatError, ConfigError
from ckpt_core.planning.slices import Box, RankSlices, SliceKey, Write, box_extent, view_box, view_in_box

__all__ = ["record", "SliceTensor", "slice_key", "ReplayPlan"]

log = logging.getLogger("ckpt_vllm")
aten = torch.ops.aten

# Pure views: the result reads elements of its input, nothing else (as ATen sees them; narrow is
# slice, chunk is split, reshape of a viewable tensor is view).
VIEW_OPS = frozenset({
    aten.slice.Tensor, aten.select.int, aten.view.default, aten._unsafe_view.default, aten.t.default,
    aten.transpose.int, aten.permute.default, aten.unsqueeze.default, aten.squeeze.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.alias.default, aten.detach.default, aten.split.Tensor, aten.split_with_sizes.default,
    aten.unbind.int, aten.expand.default, aten.as_strided.default, aten.narrow.default,
})
WRITES = frozenset({aten.copy_.default, aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default})


def _unwrap(x):
    if isinstance(x, (_Lazy, SliceTensor)):
        return x.geometry
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(v) for v in x)
    return x


def _first(args, cls):
    for a in args:
        if isinstance(a, cls):
            return a
        if isinstance(a, (list, tuple)):
            found = _first(a, cls)
            if found is not None:
                return found
    return None


def _geometry(t: torch.Tensor) -> tuple:
    return tuple(t.shape), tuple(t.stride()), t.storage_offset()


class _Lazy(torch.Tensor):
    """A zero-storage stand-in for checkpoint tensor ``name`` during a recording."""

    @staticmethod
    def __new__(cls, geometry: torch.Tensor, name: str, full: tuple[int, ...], recorder: "_Recorder", device,
                tainted: bool = False):
        self = torch.Tensor._make_wrapper_subclass(cls, geometry.shape, strides=geometry.stride(),
                                                   storage_offset=geometry.storage_offset(),
                                                   dtype=geometry.dtype, device=device)
        self.geometry, self.ckpt_name, self.full, self.recorder, self.tainted = geometry, name, full, recorder, tainted
        return self

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        lazy = _first([*args, *kwargs.values()], _Lazy)   # never `a or b`: bool() of a tensor dispatches
        rec = lazy.recorder
        rec.touched.add(lazy.ckpt_name)
        if func in WRITES and not isinstance(args[0], _Lazy):
            src = args[1] if len(args) > 1 else None
            rec.copy(args[0], src if isinstance(src, _Lazy) else None, lazy.ckpt_name)
            return args[0]
        out = func(*_unwrap(args), **_unwrap(kwargs))
        if func not in VIEW_OPS:
            rec.unsupported(lazy.ckpt_name, func)
        return _rewrap(out, lazy, tainted=lazy.tainted or func not in VIEW_OPS)


def _rewrap(out, lazy: "_Lazy", *, tainted: bool):
    if isinstance(out, torch.Tensor):
        return _Lazy(out, lazy.ckpt_name, lazy.full, lazy.recorder, lazy.device, tainted)
    if isinstance(out, (list, tuple)):
        return type(out)(_rewrap(o, lazy, tainted=tainted) for o in out)
    return out


class _Recorder(TorchDispatchMode):
    """What one ``load_weights`` over lazy tensors did to the model's parameters."""

    def __init__(self, params: dict[int, tuple[str, tuple[int, ...]]]):
        super().__init__()
        self.params = params                  # storage id of a (meta) parameter -> (name, shape)
        self.reads: dict[str, set] = {}       # checkpoint name -> boxes read (None: not a box)
        self.writes: list[Write] = []
        self.whole: dict[str, str] = {}       # checkpoint name -> why it goes whole
        self.spoiled: dict[str, str] = {}     # parameter -> why its writes cannot be described
        self.touched: set[str] = set()        # checkpoint names a loader applied any op to
        # per entry of ``writes``: the box of the checkpoint tensor that write read (None: not one box,
        # read through an op that is not a pure view, or the engine's own write); ``_delta_map.py`` reads it
        self.write_reads: list[Box | None] = []
        # per entry of ``writes``: whether it copied the whole checkpoint tensor, element i of its row-major
        # order to element i of a contiguous region (a box keeps no order: a transposed copy reads the same box)
        self.write_straight: list[bool] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(isinstance(a, _Lazy) for a in args) or _first(list(kwargs.values()), _Lazy) is not None:
            return func(*args, **kwargs)      # the lazy tensor's own dispatch handles it
        target = args[0] if args and isinstance(args[0], torch.Tensor) else None
        param = self._param_of(target)
        if param is not None and func in WRITES:
            self.copy(target, None, None)     # the loader writes this region itself (padding)
            return target
        if param is not None and torch.Tag.inplace_view not in func.tags and func._schema.is_mutable:
            self.spoiled.setdefault(param[0], f"{func} changed it in place")
            return target
        return func(*args, **kwargs)

    def _param_of(self, t) -> tuple[str, tuple[int, ...]] | None:
        if not isinstance(t, torch.Tensor) or isinstance(t, _Lazy):
            return None
        try:
            return self.params.get(t.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError):
            return None

    def copy(self, dest: torch.Tensor, src: "_Lazy | None", name: str | None) -> None:
        if dest.numel() == 0:
            return                            # e.g. a vocabulary shard with no rows of the checkpoint
        param = self._param_of(dest)
        if param is None:
            if name is not None:
                self.whole.setdefault(name, "its loader copies it into something that is not a parameter")
            return
        pname, pshape = param
        region = view_box(pshape, *_geometry(dest))
        if region is None:
            self.spoiled.setdefault(pname, "a loader writes a region of it that is not a box")
            if name is not None:
                self.whole.setdefault(name, f"it is written into {pname} in a region that is not a box")
            return
        if src is None and name is not None:   # fill_ through a lazy argument, or similar
            self.whole.setdefault(name, "its loader writes it with an op other than copy_")
            return
        read = None
        if src is not None:
            if src.tainted:
                self.whole.setdefault(src.ckpt_name, "its loader reads it through an op that is not a pure view")
            else:
                read = view_box(src.full, *_geometry(src.geometry))
                self.reads.setdefault(src.ckpt_name, set()).add(read)
        self.writes.append(Write(pname, region, None if src is None else src.ckpt_name))
        self.write_reads.append(read)
        self.write_straight.append(src is not None and _straight(dest, src))

    def unsupported(self, name: str, func) -> None:
        if name not in self.whole:
            self.whole[name] = f"its loader applies {func}, which is not a pure view"


def _straight(dest: torch.Tensor, src: "_Lazy") -> bool:
    """Whether ``dest.copy_(src)`` writes the whole checkpoint tensor in row-major order into a contiguous
    run of ``dest``'s parameter (both sides contiguous, the source at its start, as many elements)."""
    g = src.geometry
    full = 1
    for d in src.full:
        full *= d
    return (dest.is_contiguous() and g.is_contiguous() and g.storage_offset() == 0 and g.numel() == full
            and dest.numel() == full)


def tied_aliases(model: torch.nn.Module) -> set[str]:
    """Names of live parameters that are another name's parameter (a tied ``lm_head.weight``).

    Read before the reload starts: on the meta device the two become separate tensors, and the
    alias is written through its twin, never by a loader of its own.
    """
    seen: set[int] = set()
    out = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            out.add(name)
        seen.add(id(p))
    return out


def record(model: torch.nn.Module, tensors: dict[str, tuple[str, tuple[int, ...]]], device, *, rank: int,
           skip_params: frozenset = frozenset(), aliases: AbstractSet[str] = frozenset()
           ) -> tuple[RankSlices, dict[str, str]]:
    """This worker's recording: its ``RankSlices`` and, per name sent whole, why.

    Call with the model's layers in checkpoint format on the meta device (``ReloadSession.begin``)
    and put them back afterwards (``ReloadSession.abort``). ``aliases``: :func:`tied_aliases`,
    taken before; ``skip_params``: parameter names no loader fills.
    """
    rec, shapes = record_loading(model, tensors, device, skip_params=skip_params, aliases=aliases)
    return _rank_slices(rec, shapes, rank), dict(rec.whole)


def record_loading(model: torch.nn.Module, tensors: dict[str, tuple[str, tuple[int, ...]]], device, *,
                   skip_params: frozenset = frozenset(), aliases: AbstractSet[str] = frozenset()
                   ) -> tuple["_Recorder", dict[str, tuple[int, ...]]]:
    """What the model's loaders did with each checkpoint tensor, raw (the recorder: its ``writes``,
    ``write_reads``, ``whole``, ``spoiled``), and the shapes of the parameters recorded. Same
    conditions as :func:`record`."""
    params: dict[int, tuple[str, tuple[int, ...]]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for pname, p in model.named_parameters():
        if pname.rsplit(".", 1)[-1] in skip_params or pname in aliases:
            continue
        params[p.untyped_storage()._cdata] = (pname, tuple(p.shape))
        shapes[pname] = tuple(p.shape)
    loaders = _own_loaders(model)
    rec = _Recorder(params)
    current = [None]

    def lazies():
        for name, (dtype, shape) in tensors.items():
            current[0] = name
            yield name, _Lazy(torch.empty(shape, dtype=WIRE_DTYPES[dtype], device="meta"), name, tuple(shape), rec,
                              device)
        current[0] = None

    try:
        with torch.no_grad(), rec:
            model.load_weights(lazies())
    except Exception as exc:
        raise ConfigError(f"cannot record the slices of {current[0] or 'the checkpoint'}: the model's loader "
                          f"failed on a recording tensor ({type(exc).__name__}: {exc}); update without slices") from exc
    finally:
        for p, loader in loaders:
            p.weight_loader = loader
    for name in tensors:   # consumed without any op we see (kept, assigned): fail closed
        if name not in rec.touched:
            rec.whole.setdefault(name, "no loader applied an op to it that the recording sees")
    return rec, shapes


def _own_loaders(model: torch.nn.Module) -> list:
    """Point every parameter at its layer's own loader (not the reload's buffering wrapper, which
    would process a layer once it is complete); returns what to put back."""
    saved = []
    for p in model.parameters():
        loader = getattr(p, "weight_loader", None)
        if loader is None or getattr(loader, "__name__", "") != "online_process_loader":
            continue
        inner = loader
        while getattr(inner, "__name__", "") == "online_process_loader":
            inner = inner.__wrapped__
        saved.append((p, loader))
        p.weight_loader = inner
    return saved


def _rank_slices(rec: _Recorder, shapes: dict[str, tuple[int, ...]], rank: int) -> RankSlices:
    whole = dict(rec.whole)
    for w in rec.writes:
        if w.param in rec.spoiled and w.source is not None:
            whole.setdefault(w.source, f"it is written into {w.param}, which {rec.spoiled[w.param]}")
    needs: dict[str, Box | None] = {}
    for w in rec.writes:
        if w.source is None or w.source in needs:
            continue
        boxes = rec.reads.get(w.source, set())
        if w.source in whole or len(boxes) != 1 or None in boxes:
            if w.source not in whole:
                whole[w.source] = "its loaders read it in more than one box" if len(boxes) > 1 else "no box"
            needs[w.source] = None
        else:
            needs[w.source] = next(iter(boxes)) or None
    for name, why in whole.items():
        needs[name] = None   # also what reaches no parameter (a buffer, a name the loader keeps)
        _log_once(name, why)
    params = {p: s for p, s in shapes.items() if p not in rec.spoiled}
    writes = tuple(w for w in rec.writes if w.param in params)
    return RankSlices(rank, needs, params, writes)


_logged: set = set()


def _log_once(name: str, why: str) -> None:
    if name not in _logged:
        _logged.add(name)
        log.info("slices: %s is sent whole: %s", name, why)


def slice_key(model: torch.nn.Module, model_config, parallel_config, tensors: dict) -> SliceKey:
    """(model fingerprint, parallel layout, engine version) of this worker's engine."""
    import vllm

    hf = getattr(model_config, "hf_config", None)
    to_json = getattr(hf, "to_json_string", None)   # transformers' PretrainedConfig
    config = to_json(use_diff=False) if to_json is not None else repr(hf)
    params = sorted((n, list(p.shape), str(p.dtype)) for n, p in model.named_parameters())
    text = json.dumps([type(model).__name__, config, sorted((n, d, list(s)) for n, (d, s) in tensors.items()),
                       params, str(getattr(model_config, "dtype", ""))], sort_keys=True)
    layout = ",".join(f"{k}={getattr(parallel_config, a, 1)}" for k, a in (
        ("tp", "tensor_parallel_size"), ("pp", "pipeline_parallel_size"), ("dp", "data_parallel_size"),
        ("ep", "enable_expert_parallel")))
    return SliceKey(hashlib.sha1(text.encode()).hexdigest()[:16], layout, f"vllm-{vllm.__version__}")


class SliceTensor(torch.Tensor):
    """A received slice (``data``, the box ``box`` packed) posing as the whole checkpoint tensor."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, full_shape: tuple[int, ...], box: Box, name: str, geometry=None):
        if geometry is None:
            geometry = torch.empty(full_shape, dtype=data.dtype, device="meta")
        self = torch.Tensor._make_wrapper_subclass(cls, geometry.shape, strides=geometry.stride(),
                                                   storage_offset=geometry.storage_offset(),
                                                   dtype=data.dtype, device=data.device)
        self.data_, self.full_shape, self.box = data, tuple(full_shape), box
        self.ckpt_name, self.geometry = name, geometry
        return self

    __torch_function__ = torch._C._disabled_torch_function_impl

    def real(self) -> torch.Tensor:
        """The elements this view reads, as a view of the received slice."""
        size, stride, offset = _geometry(self.geometry)
        if size and 0 in size:
            return self.data_.new_empty(size)
        new_stride, new_offset = view_in_box(self.full_shape, self.box, size, stride, offset)
        # as_strided's offset counts from the start of the storage: the slice is a view of the bucket
        return self.data_.as_strided(size, new_stride, self.data_.storage_offset() + new_offset)

    def _ckpt_detached(self, storages: set[int]) -> "SliceTensor":
        """A copy that outlives the bucket buffer (a layer waiting for a later bucket keeps it)."""
        if self.data_.untyped_storage().data_ptr() not in storages:
            return self
        return SliceTensor(self.data_.clone(), self.full_shape, self.box, self.ckpt_name, self.geometry)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        me = _first([*args, *kwargs.values()], SliceTensor)
        if func is aten.copy_.default and not isinstance(args[0], SliceTensor) and args[1] is me:
            return args[0].copy_(me.real(), **kwargs)
        if func in VIEW_OPS:
            out = func(*_unwrap(args), **_unwrap(kwargs))
            return _rewrap_slice(out, me)
        raise CheckpointFormatError(f"a loader applied {func} to a received slice, which its recording did not "
                                    f"show: record the slice plan again, or update without slices", tensor=me.ckpt_name)


def _rewrap_slice(out, me: SliceTensor):
    if isinstance(out, torch.Tensor):
        return SliceTensor(me.data_, me.full_shape, me.box, me.ckpt_name, out)
    if isinstance(out, (list, tuple)):
        return type(out)(_rewrap_slice(o, me) for o in out)
    return out


class ReplayPlan:
    """This worker's part of an installed slice plan: how a received tensor is handed to the loader."""

    def __init__(self, digest: str, key: SliceKey, rank: RankSlices, tensors: dict):
        self.digest, self.key, self.rank, self.tensors = digest, key, rank, tensors

    @property
    def route(self) -> tuple[str, int]:
        """(plan digest, this worker's engine rank): what the PS must say it routed to this worker
        (``update_weights_from_ipc(..., slices=)``), else the update is refused before any load."""
        return self.digest, self.rank.rank

    def wrap(self, name: str, tensor: torch.Tensor) -> Any:
        full = tuple(self.tensors[name][1]) if name in self.tensors else None
        box = self.rank.needs.get(name)
        if full is None or tuple(tensor.shape) == full:
            return tensor                     # sent whole
        if not box or tuple(tensor.shape) != box_extent(full, box):
            raise CheckpointFormatError(
                f"received shape {list(tensor.shape)} is neither the tensor's {list(full)} nor this rank's "
                f"slice {list(box_extent(full, box)) if box else 'whole'} under slice plan {self.digest[:12]}",
                tensor=name)
        return SliceTensor(tensor, full, box, name)


    def live_layout(self, loaded: dict) -> dict:
        """The checkpoint layout a sliced update made live, ``{name: (dtype, shape)}`` with each
        tensor's full shape (``loaded`` has the shapes of the slices received), and the tensors of the
        plan this rank does not read (another rank's experts) too: what a later whole update sends."""
        out = {n: (d, tuple(self.tensors[n][1]) if n in self.tensors else tuple(s)) for n, (d, s) in loaded.items()}
        for n, (code, shape, _) in self.tensors.items():
            out.setdefault(n, (str(WIRE_DTYPES[code]).removeprefix("torch."), tuple(shape)))
        return out

    def staged_layout(self, live: dict | None) -> dict | None:
        """What a sliced stage must receive on this rank, ``{name: (dtype, shape of its slice)}``,
        given the live layout (None: unknown, nothing to compare): the tensors it reads, each in
        the extent of its box; a live tensor the plan does not know stays expected whole (so a
        stage that lacks it is refused)."""
        if not live:
            return None
        out = {n: (d, tuple(s)) for n, (d, s) in live.items() if n not in self.tensors}
        for n, box in self.rank.needs.items():
            dtype, shape = live.get(n, (str(WIRE_DTYPES[self.tensors[n][0]]).removeprefix("torch."),
                                        tuple(self.tensors[n][1])))
            out[n] = (dtype, box_extent(shape, box))
        return out


def check_installed(plan_key: SliceKey, own: SliceKey) -> None:
    if plan_key != own:
        raise ConfigError(f"the slice plan was recorded for {plan_key}, this engine is {own}: record it again")
