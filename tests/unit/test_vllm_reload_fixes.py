"""What vLLM-CPU's oneDNN W8A8 layers lose in vLLM's layerwise reload, kept (``ckpt_vllm._reload_fixes``).

Plain torch modules shaped like vLLM's: a layer whose scheme's kernel holds a oneDNN handle built
from the layer's scales (``layer_param_names``), its ``weight`` released to None. The real kernel
and reload are checked on vLLM-CPU by ``test_vllm_quant_parity.py`` (ct-mixed on a CPU without AMX).
"""

import gc
import weakref
from types import SimpleNamespace

import torch

import pytest

from ckpt_vllm._reload_fixes import (KEPT, empty_slots, install, keep_pointed_tensors, quiet_buffer_accounting,
                                    restore_empty_slots)


class Obj:
    """A plain object of vLLM's (the walk looks only into objects of modules under ``vllm.``)."""
    __module__ = "vllm.model_executor.fake"

    def __init__(self, **kw):
        self.__dict__.update(kw)


def _w8a8_layer():
    layer = torch.nn.Module()
    layer.register_parameter("weight", None)   # prepacked into the handle, released
    layer.weight_scale = torch.nn.Parameter(torch.rand(6, 1), requires_grad=False)
    layer.azp_adj = torch.nn.Parameter(torch.rand(1, 6), requires_grad=False)
    kernel = Obj(dnnl_handler=Obj(n=6), layer_param_names=(
        "weight", "weight_scale", "input_scale", "input_zero_point", "azp_adj"))
    layer.scheme = Obj(kernel=kernel, kernel_class=type(kernel), helper=len)   # a class and a function: not entered
    return layer, kernel


def test_the_tensors_a_handle_points_to_live_as_long_as_the_handle_after_the_layer_lets_them_go():
    layer, kernel = _w8a8_layer()
    processed = weakref.ref(layer.weight_scale)
    assert keep_pointed_tensors(layer) == 1
    held = getattr(kernel.dnnl_handler, KEPT)
    assert [t is getattr(layer, n) for t, n in zip(held, ("weight_scale", "azp_adj"))] == [True, True]
    layer.weight_scale = torch.nn.Parameter(torch.rand(6, 1), requires_grad=False)   # the reload's restore
    gc.collect()
    assert processed() is not None, "the processed scales the handle reads were freed"
    kernel.dnnl_handler = Obj(n=6)   # the next processing builds a new handle
    del held
    gc.collect()
    assert processed() is None, "the kept tensors go with their handle"


def test_layers_without_a_onednn_handle_keep_nothing():
    plain = torch.nn.Linear(4, 4)
    plain.quant_method = Obj(kernel=Obj(dnnl_handler=None, layer_param_names=("weight",)))
    assert keep_pointed_tensors(plain) == 0
    other = torch.nn.Linear(4, 4)   # an object outside vLLM is not looked into
    other.quant_method = SimpleNamespace(kernel=Obj(dnnl_handler=Obj(n=4), layer_param_names=("weight",)))
    assert keep_pointed_tensors(other) == 0


def test_an_empty_weight_slot_a_layer_put_back_lost_is_registered_again():
    layer, _ = _w8a8_layer()
    other = torch.nn.Linear(2, 2)
    slots = empty_slots([layer, other])
    assert slots == [(layer, ["weight"], [])]
    layer.weight = torch.nn.Parameter(torch.empty(6, 4, device="meta"))   # checkpoint format during the reload
    delattr(layer, "weight")   # what vLLM's _place_kernel_tensors does before putting the live tensors back
    assert not hasattr(layer, "weight")
    assert restore_empty_slots(slots) == 1
    assert "weight" in layer._parameters and layer.weight is None
    assert restore_empty_slots(slots) == 0


def test_the_copy_step_is_wrapped_once_and_keeps_the_pointed_tensors_before_it_runs():
    calls = []

    def copy_and_restore(layer, info):
        calls.append(getattr(layer.scheme.kernel.dnnl_handler, KEPT, None) is not None)

    layerwise = SimpleNamespace(_copy_and_restore_kernel_tensors=copy_and_restore)
    assert install(layerwise) and install(layerwise)
    wrapped = layerwise._copy_and_restore_kernel_tensors
    assert wrapped.__wrapped__ is copy_and_restore
    layer, _ = _w8a8_layer()
    wrapped(layer, None)
    assert calls == [True]
    assert install(SimpleNamespace()) is False   # a vLLM without that step: nothing to wrap



def _layerwise_like():
    """A module shaped like vLLM 0.26's layerwise reload: its loader looks ``has_device_tensors`` up
    at call time and, while two layers buffer, sums every buffered weight's bytes for a warning."""
    mod = SimpleNamespace(sums=0, buffered=[[1] * 300, [1] * 300])

    def has_device_tensors(bound_args):
        return True

    def loader(n_weights):
        for _ in range(n_weights):
            if mod.has_device_tensors(None) and len(mod.buffered) >= 2:
                mod.sums += sum(len(b) for b in mod.buffered)   # the quadratic part
    mod.has_device_tensors, mod.loader = has_device_tensors, loader
    return mod, has_device_tensors


def test_the_buffer_warning_sums_nothing_while_our_buckets_load_and_comes_back_after():
    mod, original = _layerwise_like()
    mod.loader(10)
    assert mod.sums == 6000                      # what vLLM 0.26 does per weight
    mod.sums = 0
    with quiet_buffer_accounting(mod) as quieted:
        assert quieted
        mod.loader(10)
    assert mod.sums == 0
    assert mod.has_device_tensors is original    # restored
    with pytest.raises(RuntimeError), quiet_buffer_accounting(mod):
        raise RuntimeError("a bucket vLLM rejected")
    assert mod.has_device_tensors is original    # restored on failure too


def test_a_vllm_without_the_device_check_is_left_alone():
    mod = SimpleNamespace()
    with quiet_buffer_accounting(mod) as quieted:
        assert not quieted
    assert not hasattr(mod, "has_device_tensors")
