"""benchmarks/trainer_bench.py carries vLLM's CUDA IPC handles over JSON (its engine process never
unpickles): the arguments of a CUDA ``reduce_tensor`` round-trip, and a class that is not one of
torch's tensor or storage classes is refused."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))
from _trainer_bench_engine import decode, encode  # noqa: E402


def cuda_like_args():
    """The shape of ``reduce_tensor(cuda_tensor)[1]`` (torch 2.x), with made-up handles."""
    return (torch.Tensor, torch.Size([4, 8]), (8, 1), 0, torch.storage.TypedStorage, torch.bfloat16, 0,
            os.urandom(64), 64, 0, False, os.urandom(16), 3, os.urandom(64), True)


def test_ipc_handles_as_vllm_nests_them_round_trip_through_json():
    import json

    handles = [{"GPU-1234": cuda_like_args()}, {"GPU-1234": cuda_like_args()}]   # one per tensor (non-packed)
    assert decode(json.loads(json.dumps(encode(handles)))) == handles
    packed = {"GPU-1234": cuda_like_args()}                                       # one buffer (packed)
    assert decode(json.loads(json.dumps(encode(packed)))) == packed


@pytest.mark.parametrize("bad, match", [
    ({"class": "os:system"}, "not torch's"),
    ({"class": "torch:device"}, "not a tensor or storage class"),
    ({"dtype": "nn"}, "not a torch dtype"),
    ({"pickle": "gASV"}, "unknown encoded kind"),
    ([1, 2], "bare JSON list"),
])
def test_anything_else_is_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        decode(bad)


def test_a_value_without_a_json_form_is_refused_when_encoding():
    with pytest.raises(TypeError, match="no JSON form for a object"):
        encode(object())
