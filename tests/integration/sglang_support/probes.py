"""Test-only scheduler calls of the CPU SGLang stand-in (``engine.py``), run on every TP rank through
``tp.FanOut`` (their names start with ``tp.TEST_OP``): parameter digests, a cold load into a fresh
shard of the model, and one-shot fault injections into our staging loader and SGLang's model."""

from __future__ import annotations

import hashlib
import os
import time


def digest(t) -> str:   # same format as tests/support/data.py's digest
    t = t.detach().cpu().contiguous()
    return hashlib.sha256(t.reshape(-1).view(__import__("torch").uint8).numpy().tobytes()).hexdigest() \
        + f"|{t.dtype}|{tuple(t.shape)}"


def probe_calls(model, model_config, tp_rank: int) -> dict:
    """The test-only scheduler calls (``tp.TEST_OP``), run on every rank; each returns JSON."""
    import torch

    def digests(_arg):
        return {n: digest(p) for n, p in model.named_parameters()}

    def cold_digests(model_dir):   # a fresh shard of the model, loaded as a cold start loads it
        from safetensors.torch import load_file
        from sglang.srt.models.qwen2 import Qwen2ForCausalLM

        fresh = Qwen2ForCausalLM(model_config.hf_config)
        with torch.no_grad():
            for f in sorted(os.listdir(model_dir)):
                if f.endswith(".safetensors"):
                    fresh.load_weights(list(load_file(os.path.join(model_dir, f)).items()))
        return {n: digest(p) for n, p in fresh.named_parameters()}

    def cold_state(model_dir):   # every parameter and buffer of a fresh shard, cold-loaded (the probe's digests)
        from safetensors.torch import load_file
        from sglang.srt.models.qwen2 import Qwen2ForCausalLM

        from ckpt_sglang._digest import state_digests

        fresh = Qwen2ForCausalLM(model_config.hf_config)
        with torch.no_grad():
            for f in sorted(os.listdir(model_dir)):
                if f.endswith(".safetensors"):
                    fresh.load_weights(list(load_file(os.path.join(model_dir, f)).items()))
        return state_digests(fresh)

    def setenv(arg):   # {name: value or None}: the engine process's environment (e.g. CKPT_TEST_DELTA_DROP_ONE);
        # "_rank": only that TP rank's
        arg = dict(arg)
        if arg.pop("_rank", tp_rank) != tp_rank:
            return None
        for k, v in arg.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        return arg

    def next_commit(arg):
        """The next commit's ``load_weights`` on rank ``arg["fail_rank"]`` raises at its second bucket."""
        if arg["fail_rank"] != tp_rank:
            return None
        calls = []

        def failing(weights):
            calls.append(1)
            if len(calls) == 2:
                del model.load_weights   # one commit only
                raise RuntimeError(f"injected load_weights failure on TP rank {tp_rank}")
            return type(model).load_weights(model, weights)

        model.load_weights = failing
        return arg

    def next_stage(arg):
        return _next_stage(arg, tp_rank)

    return {f"ckpt_test_{fn.__name__}": fn for fn in (digests, cold_digests, cold_state, setenv, next_stage,
                                                      next_commit)}


def _next_stage(arg: dict, tp_rank: int):
    """The next stage's receiver on rank ``arg["rank"]`` (-1: every rank) raises after staging
    ``fail_after`` buckets (a worker failing mid-way), or as it seals the stage (``fail_seal``: its
    post hook, after the PS's last bucket; the other ranks have sealed theirs), and/or takes
    ``slow_s`` longer per bucket (a big checkpoint's transfer, which outlasts the pause that opens
    the stage; the tiny one here would not)."""
    import ckpt_sglang.staging as staging
    real = staging.SglangStagingArea
    if arg["rank"] not in (-1, tp_rank):
        return None
    fail_after, slow_s, fail_seal = arg["fail_after"], arg["slow_s"], arg["fail_seal"]

    class TestArea(real):
        def add(self, weights):
            staging.SglangStagingArea = real   # one stage only
            if 0 <= fail_after <= len(self.buckets):
                raise RuntimeError(f"injected failure after {fail_after} staged bucket(s)")
            time.sleep(slow_s)
            super().add(weights)

        @property
        def sealed(self):
            return self.__dict__.get("_sealed", False)

        @sealed.setter
        def sealed(self, value):
            if value and fail_seal:
                raise RuntimeError(f"injected failure on TP rank {tp_rank} as the stage was sealed")
            self.__dict__["_sealed"] = value

    staging.SglangStagingArea = TestArea
    return arg
