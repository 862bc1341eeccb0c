"""Which quantized layers a delta or a direct update may write into in place (``ckpt_vllm._quant_verbatim``).

No GPU here and no FP8 kernels on this CPU: the layers below carry method and kernel objects shaped
like vLLM 0.26's (class names, the attributes its ``Fp8LinearMethod`` / ``Fp8MoEMethod`` have, defined in a
``vllm.*`` module so the walk looks into them as it does into vLLM's own). What they stand in for is
checked on a GPU vLLM by ``tests/gpu/test_vllm_gpu.py`` (direct updates and deltas of an FP8 block MoE,
each equal to a cold load)."""

import enum
import functools

import pytest
import torch

from ckpt_vllm._delta_map import verbatim_layer
from ckpt_vllm._quant_verbatim import aliases_own, foreign_tensors, quantized_as_loaded

VLLM_MODULE = "vllm.model_executor.layers.quantization.fp8"


def _vllm_class(name: str, **defaults):
    """A plain class named like vLLM's, in a ``vllm.*`` module, whose instances take attributes."""
    def __init__(self, **kw):
        for k, v in {**defaults, **kw}.items():
            setattr(self, k, v)
    return type(name, (), {"__init__": __init__, "__module__": VLLM_MODULE})


Backend = enum.Enum("Fp8MoeBackend", "TRITON BATCHED_TRITON DEEPGEMM MARLIN FLASHINFER_CUTLASS")
Fp8MoEMethod = _vllm_class("Fp8MoEMethod", block_quant=True, fp8_backend=Backend.TRITON)
Fp8LinearMethod = _vllm_class("Fp8LinearMethod", block_quant=True, use_marlin=False)
Config = _vllm_class("FusedMoEQuantConfig")
Desc = _vllm_class("FusedMoEQuantDesc")
Kernel = _vllm_class("FusedMoEKernel")
Cutlass = _vllm_class("CutlassFp8BlockScaledMMKernel")
DeepGemm = _vllm_class("DeepGemmFp8BlockScaledMMKernel")
Fp8OnlineLinearMethod = _vllm_class("Fp8OnlineLinearMethod")


class Experts(torch.nn.Module):
    """An FP8 block MoE layer after processing: fused experts and their block scales, as loaded."""

    def __init__(self, **method_kw):
        super().__init__()
        e, n, k = 4, 256, 128
        f8 = getattr(torch, "float8_e4m3fn", torch.int8)
        self.w13_weight = torch.nn.Parameter(torch.zeros(e, 2 * n, k, dtype=f8), requires_grad=False)
        self.w2_weight = torch.nn.Parameter(torch.zeros(e, k, n, dtype=f8), requires_grad=False)
        self.w13_weight_scale_inv = torch.nn.Parameter(torch.ones(e, 2 * n // 128, k // 128), requires_grad=False)
        self.w2_weight_scale_inv = torch.nn.Parameter(torch.ones(e, k // 128, n // 128), requires_grad=False)
        config = Config(_w1=Desc(scale=self.w13_weight_scale_inv), _w2=Desc(scale=self.w2_weight_scale_inv))
        self.quant_method = Fp8MoEMethod(moe_quant_config=config,
                                         moe_kernel=Kernel(fused_experts=_vllm_class("TritonExperts")(
                                             quant_config=config)), **method_kw)

    def meta(self):
        return {n: torch.empty_like(p, device="meta") for n, p in self._parameters.items()}


class Linear(torch.nn.Module):
    def __init__(self, kernel=Cutlass, method=Fp8LinearMethod, **method_kw):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(256, 128, dtype=torch.int8), requires_grad=False)
        self.weight_scale_inv = torch.nn.Parameter(torch.ones(2, 1), requires_grad=False)
        self.input_scale = None
        self.quant_method = method(fp8_linear=kernel(config=("fp8", (256, 128))), **method_kw)


def _verbatim(layer):
    return verbatim_layer(layer, {n: torch.empty_like(p, device="meta") for n, p in layer._parameters.items()},
                          dict(layer._parameters))


def test_an_fp8_block_moe_on_the_triton_backend_whose_kernel_refers_to_its_own_scales_is_verbatim():
    layer = Experts()
    assert quantized_as_loaded(layer, layer.quant_method) is None
    assert _verbatim(layer) is None
    layer = Experts(fp8_backend=Backend.BATCHED_TRITON)
    assert _verbatim(layer) is None


@pytest.mark.parametrize("kw, expect", [
    ({"fp8_backend": Backend.DEEPGEMM}, "backend DEEPGEMM"),
    ({"fp8_backend": Backend.MARLIN}, "backend MARLIN"),
    ({"fp8_backend": Backend.FLASHINFER_CUTLASS}, "backend FLASHINFER_CUTLASS"),
    ({"block_quant": False}, "not block-quantized"),
    ({"fp8_backend": None}, "backend None"),
])
def test_other_fp8_moe_backends_and_per_tensor_fp8_are_reloaded(kw, expect):
    layer = Experts(**kw)
    why = _verbatim(layer)
    assert why is not None and expect in why and "Fp8MoEMethod" in why


def _copy_in_config(layer):
    layer.quant_method.moe_quant_config._w1.scale = layer.w13_weight_scale_inv.clone()   # equal values, another storage


def _copy_in_dict(layer):
    layer.quant_method.moe_kernel.fused_experts.cache = {"w1": layer.w13_weight.clone()}


def _copy_in_closure(layer):
    packed = layer.w2_weight.clone()
    layer.quant_method.moe_kernel.fused_experts.apply = lambda x: (x, packed)


def _copy_in_partial(layer):
    layer.quant_method.moe_kernel.run = functools.partial(print, layer.w2_weight_scale_inv * 1)


def _copy_in_a_kernel_module(layer):
    holder = torch.nn.Module()
    holder.register_buffer("w", layer.w13_weight.view(torch.uint8).clone())
    layer.quant_method.moe_kernel.helper = holder


def _a_narrowed_view(layer):
    layer.quant_method.moe_quant_config._w2.scale = layer.w2_weight_scale_inv[:2]


def _in_a_list(layer):
    layer.quant_method.moe_kernel.tables = [None, (layer.w13_weight_scale_inv + 0,)]


@pytest.mark.parametrize("plant", [_copy_in_config, _copy_in_dict, _copy_in_closure, _copy_in_partial,
                                   _copy_in_a_kernel_module, _a_narrowed_view, _in_a_list])
def test_a_tensor_the_method_holds_that_is_not_a_live_parameter_sends_the_layer_to_the_reload(plant):
    layer = Experts()
    plant(layer)
    found = list(foreign_tensors(layer, layer.quant_method))
    assert len(found) == 1, found
    why = _verbatim(layer)
    assert why is not None and "not one of the layer's live parameters" in why and found[0][0] in why


def test_an_fp8_block_linear_on_the_cutlass_kernel_is_verbatim_and_other_kernels_or_methods_are_not():
    assert _verbatim(Linear()) is None
    assert "Triton" not in (_verbatim(Linear(kernel=_vllm_class("TritonFp8BlockScaledMMKernel"))) or "")
    assert "DeepGemmFp8BlockScaledMMKernel" in _verbatim(Linear(kernel=DeepGemm))
    assert "Marlin" in _verbatim(Linear(use_marlin=True))
    assert "block" in _verbatim(Linear(block_quant=False))
    assert _verbatim(Linear(method=Fp8OnlineLinearMethod)) == "quantization method Fp8OnlineLinearMethod"


def test_a_method_of_a_version_without_the_attributes_read_is_reloaded():
    layer = Linear()
    del layer.quant_method.use_marlin
    assert "Marlin" in _verbatim(layer)
    layer = Experts()
    del layer.quant_method.block_quant
    assert "not block-quantized" in _verbatim(layer)


def test_shuffled_experts_are_reloaded():
    layer = Experts()
    layer.w13_weight.is_shuffled = True
    assert "shuffled" in _verbatim(layer)


def test_a_processed_weight_still_fails_the_generic_checks():
    layer = Linear()
    layer.weight = torch.nn.Parameter(layer.weight.data.t(), requires_grad=False)   # transposed in processing
    meta = {"weight": torch.empty(256, 128, dtype=torch.int8, device="meta"),
            "weight_scale_inv": torch.empty(2, 1, device="meta")}
    assert "processing changed weight" in verbatim_layer(layer, meta, dict(layer._parameters))


def test_an_attribute_aliasing_a_parameter_is_not_derived_and_a_view_of_it_is():
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.ones(4, 2), requires_grad=False)
    meta = {"weight": torch.empty(4, 2, device="meta")}
    layer.kept = layer.weight.data
    assert aliases_own(layer, layer.kept)
    assert verbatim_layer(layer, meta, dict(layer._parameters)) is None
    layer.kept = layer.weight.data.t()
    assert not aliases_own(layer, layer.kept)
    assert "derives" in verbatim_layer(layer, meta, dict(layer._parameters))


def test_an_object_that_cannot_be_walked_sends_the_layer_to_the_reload():
    class Boom:
        __module__ = "vllm.model_executor.layers.fused_moe.fake"
        __slots__ = ("x",)

        def __getattribute__(self, name):
            if name == "x":
                raise RuntimeError("not ready")
            return object.__getattribute__(self, name)

    layer = Experts()
    layer.quant_method.moe_kernel.odd = Boom()
    why = _verbatim(layer)
    assert why is not None and "could not be walked" in why and "not ready" in why
